"""The DSV41_* environment contract (dsv41.envs): every row parses and refuses as its table row
says, the old VLLM_ENGRAM_REMOTE* spellings are refused, the rules across variables hold, the
roles' templates and docs/interfaces.md name exactly the table's variables, and no module but
envs.py reads a DSV41_* name from an environment."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from dsv41 import envs, errors
from dsv41.envs import ENV_VARS, RENAMED, ConfigError, EnvVar, Settings, parse

REPO = Path(__file__).resolve().parents[2]
# A variable name; a name followed by "*" is a family mention ("DSV41_DRAFTER_*"), not a variable.
NAME = re.compile(r"\bDSV41_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)")


def _valid(v: EnvVar) -> str:
    if v.type is bool:
        return "1"
    if v.type is int:
        return str(int(v.max if v.max is not None else (v.min or 0) + 7))
    if v.type is float:
        return str(v.max if v.max is not None else 1.5)
    return v.choices[0] if v.choices else "some-value"


# Variables whose valid value needs a partner (rules across variables, tested below).
PARTNERS = {
    "DSV41_DRAFTER_REMOTE": {"DSV41_DRAFTER_DIR": "/d"},
    "DSV41_ENGRAM_REMOTE_REQUIRED": {"DSV41_ENGRAM_REMOTE": "tcp://h:1"},
    "DSV41_DRAFTER_SHADOW": {},
}


def test_settings_fields_are_the_table() -> None:
    got = {f.name: f for f in dataclasses.fields(Settings)}
    assert list(got) == [v.field for v in ENV_VARS.values()]
    for v in ENV_VARS.values():
        assert v.name.startswith("DSV41_") and v.field == v.name.removeprefix("DSV41_").lower()
        assert got[v.field].default == v.default, v.name
        assert isinstance(v.default, v.type), v.name
        assert v.doc.strip(), f"{v.name} has no doc"
        if v.type in (int, float):
            assert v.min is not None and v.max is not None and v.min <= v.default <= v.max, v.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse({}).drafter_k = 3  # type: ignore[misc]


def test_unset_and_empty_give_defaults() -> None:
    want = {v.field: v.default for v in ENV_VARS.values()}
    assert dataclasses.asdict(parse({})) == want
    assert dataclasses.asdict(parse({name: "" for name in ENV_VARS})) == want
    assert dataclasses.asdict(parse({name: "  " for name in ENV_VARS})) == want


@pytest.mark.parametrize("name", sorted(ENV_VARS))
def test_each_variable_parses_a_valid_value(name: str) -> None:
    v = ENV_VARS[name]
    got = getattr(parse({**PARTNERS.get(name, {}), name: _valid(v)}), v.field)
    if v.type is bool:
        assert got is True
    else:
        assert got == v.type(_valid(v)) and type(got) is v.type


@pytest.mark.parametrize("name", sorted(n for n, v in ENV_VARS.items() if v.type in (int, float)))
def test_each_number_refuses_out_of_range_and_junk(name: str) -> None:
    v = ENV_VARS[name]
    step = 1 if v.type is int else v.min / 2 if v.min > 0 else 1
    assert getattr(parse({name: str(v.min if v.type is float else int(v.min))}), v.field) == v.min
    for bad in (str(v.min - step), str(v.max + 1), "lots", "1e400" if v.type is float else "1.5", "nan", "1_0"):
        with pytest.raises(ConfigError) as ei:
            parse({name: bad})
        assert str(ei.value).startswith(name) and ei.value.name == name
        assert ("integer" if v.type is int else "number") in str(ei.value)


@pytest.mark.parametrize("name", sorted(n for n, v in ENV_VARS.items() if v.type is bool))
def test_each_bool(name: str) -> None:
    v = ENV_VARS[name]
    for raw, want in (("1", True), ("true", True), ("ON", True), ("0", False), ("no", False), ("off", False)):
        assert getattr(parse({**PARTNERS.get(name, {}), name: raw}), v.field) is want
    with pytest.raises(ConfigError, match=f"^{name} must be 0 or 1"):
        parse({name: "maybe"})


def test_config_error_is_one_line_for_the_cli() -> None:
    with pytest.raises(ConfigError) as ei:
        parse({"DSV41_DRAFTER_K": "x"})
    assert isinstance(ei.value, errors.Dsv41Error) and isinstance(ei.value, ValueError)
    assert isinstance(ei.value, errors.ConfigError) and "\n" not in str(ei.value)


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_old_engram_names_are_refused_naming_the_new(old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=f"^{old} was renamed: set {new} instead"):
        parse({old: "1"})
    with pytest.raises(ConfigError, match=new):
        parse({old: ""})  # even empty: a leftover env file line must be noticed


@pytest.mark.parametrize(
    "env,name,msg",
    [
        ({"DSV41_ENGRAM_REMOTE_REQUIRED": "1"}, "DSV41_ENGRAM_REMOTE_REQUIRED", "DSV41_ENGRAM_REMOTE is empty"),
        (
            {"DSV41_DRAFTER_REMOTE": "tcp://h:1", "DSV41_DRAFTER_LOCAL": "/d", "DSV41_DRAFTER_DIR": "/d"},
            "DSV41_DRAFTER_REMOTE",
            "only one",
        ),
        ({"DSV41_DRAFTER_REMOTE": "tcp://h:1"}, "DSV41_DRAFTER_DIR", "needs DSV41_DRAFTER_DIR"),
        ({"DSV41_DRAFTER_ASYNC": "1", "DSV41_DRAFTER_SHADOW": "1"}, "DSV41_DRAFTER_SHADOW", "synchronous"),
        (
            {"DSV41_DRAFTER_CAPACITY_MODE": "1", "DSV41_DRAFTER_LOCAL": "/d"},
            "DSV41_DRAFTER_CAPACITY_MODE",
            "frees no memory",
        ),
        (
            {"DSV41_DRAFTER_CAPACITY_MODE": "1", "DSV41_DRAFTER_REMOTE": "tcp://h:1", "DSV41_DRAFTER_DIR": "/d"},
            "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS",
            "> 0",
        ),
    ],
)
def test_rules_across_variables(env: dict, name: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as ei:
        parse(env)
    assert ei.value.name == name and str(ei.value).startswith("DSV41_")


def test_drafter_k_is_parsed_once_with_one_error_type() -> None:
    assert parse({}).drafter_k == 5 and parse({"DSV41_DRAFTER_K": "3"}).drafter_k == 3
    for bad in ("x", "-1", "65", str(1 << 40)):
        with pytest.raises(ConfigError, match=r"^DSV41_DRAFTER_K must be an integer in \[0, 64\]"):
            parse({"DSV41_DRAFTER_K": bad})


def test_parse_reads_os_environ_by_default(monkeypatch) -> None:
    monkeypatch.setenv("DSV41_NIXL_PROGRESS_DELAY_US", "250")
    assert parse().nixl_progress_delay_us == 250
    monkeypatch.setenv("DSV41_TRANSPORT_PURE", "sometimes")
    with pytest.raises(ConfigError, match="^DSV41_TRANSPORT_PURE"):
        parse()


def test_names_outside_the_table_are_ignored_by_parse() -> None:
    assert parse({"DSV41_BENCH_DIR": "/x", "UCX_TLS": "tcp"}) == parse({})


# --------------------------------------------------------------------------- the table vs the repo


def _names(text: str) -> set[str]:
    return set(NAME.findall(text))


def test_role_templates_use_only_table_variables() -> None:
    # env files are written from role templates and from role task YAML (dsv41_service's env dict)
    templates = sorted(p for p in (REPO / "roles").glob("*/templates/*") if p.is_file())
    templates += sorted((REPO / "roles").glob("*/tasks/*.yml"))
    templates += sorted((REPO / "roles").glob("*/defaults/*.yml"))
    assert templates, "no role templates found"
    seen: set[str] = set()
    for p in templates:
        unknown = _names(p.read_text()) - set(ENV_VARS)
        assert not unknown, f"{p.relative_to(REPO)} names {sorted(unknown)}, not in dsv41.envs.ENV_VARS"
        seen |= _names(p.read_text())
    assert "DSV41_ENGRAM_REMOTE" in seen and not any("VLLM_ENGRAM" in p.read_text() for p in templates)


def test_interfaces_doc_lists_exactly_the_table() -> None:
    doc = _names((REPO / "docs" / "interfaces.md").read_text())
    assert doc - set(ENV_VARS) == set(), "docs/interfaces.md names variables the table lacks"
    assert set(ENV_VARS) - doc == set(), "variables missing from docs/interfaces.md"


def _env_reads(path: Path) -> list[str]:
    """``X.get("DSV41_..")``, ``X["DSV41_.."]``, ``getenv("DSV41_..")``, ``"DSV41_.." in X`` and
    ``setdefault/pop`` of a DSV41_* name: every way a module reads an environment by name."""
    tree = ast.parse(path.read_text(), str(path))
    hits = []

    def dsv41(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("DSV41_")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and dsv41(node.args[0]):
            f = node.func
            attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if attr in ("get", "getenv", "setdefault", "pop", "environ"):
                hits.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Subscript) and dsv41(node.slice):
            hits.append(f"{path.name}:{node.lineno}")
        elif (
            isinstance(node, ast.Compare)
            and dsv41(node.left)
            and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops)
        ):
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_no_module_but_envs_reads_a_dsv41_variable(tmp_path: Path) -> None:
    roots = [REPO / "python" / "dsv41", REPO / "library", REPO / "plugins"]
    files = [p for r in roots if r.is_dir() for p in r.rglob("*.py") if p.name != "envs.py" or p.parent.name != "dsv41"]
    assert len(files) > 20
    hits = [h for p in files for h in _env_reads(p)]
    assert hits == [], f"DSV41_* read outside dsv41/envs.py: {hits}"
    # the checker sees the readings it is meant to catch
    probe = REPO / "python" / "dsv41" / "envs.py"
    assert len(_env_reads(probe)) == 0  # envs.py reads through the table, by variable object
    sample = tmp_path / "probe.py"
    sample.write_text(
        'import os\nos.environ.get("DSV41_X")\nos.getenv("DSV41_Y")\nos.environ["DSV41_Z"]\n'
        'env = {}\nenv.get("DSV41_K", "5")\n"DSV41_Q" in env\n'
    )
    assert len(_env_reads(sample)) == 5


def test_envs_module_has_the_contract_api() -> None:
    for name in ("ConfigError", "EnvVar", "ENV_VARS", "Settings", "parse"):
        assert hasattr(envs, name), name
    assert dataclasses.is_dataclass(Settings) and Settings.__dataclass_params__.frozen
    assert EnvVar.__dataclass_params__.frozen
