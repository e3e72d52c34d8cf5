"""Every option of every module in plugins/modules with a value of its type that no module can
use fails the module naming the option, never a traceback.

Found by a hostile-user round: Ansible's ``int`` type converts a 5000-digit string, which the
module then cannot print (``repr`` raises ValueError past 4300 digits: component_check,
engram_manifest, greedy_refs, rdma_link died); a NUL in a path reached ``open`` (dsv41_status
``windows_dir``, qualify_report ``out_dir``: ValueError "embedded null byte"); ``float`` options
took ``nan``/``inf``. The modules and their options are enumerated from the modules' own
``argument_spec`` (captured from ``AnsibleModule``), so a new module or option is covered the day
it is added.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MODULES = sorted(
    p.stem for p in (Path(__file__).resolve().parents[4] / "plugins" / "modules").glob("*.py") if p.stem != "__init__"
)


class _Captured(Exception):
    pass


def _spec(name: str, monkeypatch) -> tuple[object, dict, dict]:
    from ansible.module_utils import basic

    mod = importlib.import_module(f"ansible_collections.dsv41.offload.plugins.modules.{name}")
    got = {}

    def init(self, argument_spec, **kw):
        got["spec"], got["kw"] = argument_spec, kw
        raise _Captured

    with monkeypatch.context() as m:
        m.setattr(basic.AnsibleModule, "__init__", init)
        with pytest.raises(_Captured):
            mod.main()
    return mod, got["spec"], got["kw"]


# Per Ansible option type: values that convert but no module can use.
# (A digit string past 4300 digits is not here: ansible-core's own argument validation fails on it
# before the module runs, and its fail_json then raises formatting the value: docs/field-reports.md.)
HOSTILE = {
    "int": [2**63, -(2**63) - 1, 10**4000],
    "float": ["nan", "inf", "-inf", "1e999"],
    "str": ["a\x00b"],
    "path": ["/tmp/a\x00b"],
    "raw": ["a\x00b"],
    "list": [["ok", "a\x00b"]],
    "dict": [{"k": "a\x00b"}],
}
FILL = {
    "str": "zz",
    "path": "/nonexistent/dsv41-hostile",
    "int": 1,
    "float": 1.0,
    "bool": False,
    "dict": {},
    "list": [],
    "raw": "zz",
}


def _filled(spec: dict, kw: dict, skip: str) -> dict:
    """Valid stand-ins for the required options (and those ``required_if`` then asks for)."""

    def fill(k):
        v = spec[k]
        return v["choices"][0] if v.get("choices") else FILL[v.get("type", "str")]

    args = {k: fill(k) for k, v in spec.items() if k != skip and v.get("required")}
    for rule in kw.get("required_if", []):
        key, val, needs = rule[0], rule[1], rule[2]
        if args.get(key) == val:
            args.update({k: fill(k) for k in needs if k != skip})
    return args


def _hostile(o: dict) -> list:
    if o.get("options"):  # sub-options: valid required ones, a NUL in the first string one
        sub = o["options"]
        element = _filled(sub, {}, "")
        first = next(k for k, v in sorted(sub.items()) if v.get("type", "str") == "str" and not v.get("choices"))
        element[first] = "a\x00b"
        return [[element]] if o.get("type") == "list" else [element]
    if o.get("type") == "list" and o.get("elements") == "dict":
        return [[{"k": "a\x00b"}]]
    return HOSTILE.get(o.get("type", "str"), [])


def test_every_module_is_enumerated() -> None:
    assert len(MODULES) >= 9 and "dsv41_status" in MODULES and "rdma_link" in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_every_option_refuses_unusable_values_by_name(name: str, run_module, monkeypatch) -> None:
    mod, spec, kw = _spec(name, monkeypatch)
    checked, failures = 0, []
    for opt, o in sorted(spec.items()):
        for value in _hostile(o):
            args = {**_filled(spec, kw, opt), opt: value}
            if o.get("choices"):
                continue  # Ansible's choices check refuses anything else already
            try:
                kind, res = run_module(mod, args)
            except Exception as exc:  # noqa: BLE001 - the defect under test
                failures.append((opt, repr(value)[:24], f"{type(exc).__name__}: {str(exc)[:120]}"))
                continue
            checked += 1
            if kind != "fail" or not res["msg"].startswith(f"option {opt}: "):
                failures.append((opt, repr(value)[:24], kind, str(res.get("msg", res))[:160]))
    assert checked, name
    assert not failures, f"{name}: {failures}"


def test_usable_values_pass_the_check() -> None:
    try:
        from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import option_problem
    except ImportError:  # pragma: no cover - library/ layout
        from ansible.module_utils.dsv41_common import option_problem
    for kind, value in [
        ("int", 2**63 - 1),
        ("int", -(2**63)),
        ("float", 1e308),
        ("str", "a\nb"),
        ("path", "/tmp/x"),
        ("list", ["a", 1]),
        ("dict", {"a": [1, "b"]}),
        ("bool", True),
    ]:
        assert option_problem(kind, value) is None, (kind, value)


# Values that are not strings; Ansible's str/path types turn each into its text (a list given as
# qualify_report's out_dir became the directory "['l']" in the repository's working directory).
NOT_STRINGS = [["l"], {"k": "v"}, 5, True, 1.5]


def _string_options(spec: dict, prefix: str = "") -> list[tuple[str, list[str], dict]]:
    """``(label, path of option names, spec)`` of every ``str``/``path`` option, also inside
    ``options`` (sub-options of a dict or list of dicts), without ``choices``."""
    out = []
    for name, o in sorted(spec.items()):
        if o.get("type", "str") in ("str", "path") and not o.get("choices"):
            out.append((prefix + name, [name], o))
        for label, path, sub in _string_options(o.get("options") or {}, f"{prefix}{name}."):
            out.append((label, [name, *path], sub))
    return out


@pytest.mark.parametrize("name", MODULES)
def test_every_string_option_refuses_a_value_that_is_not_a_string(name: str, run_module, monkeypatch, tmp_path) -> None:
    mod, spec, kw = _spec(name, monkeypatch)
    options = _string_options(spec)
    assert options, name
    failures = []
    for label, path, _o in options:
        for value in NOT_STRINGS:
            if len(path) == 1:
                args = {**_filled(spec, kw, path[0]), path[0]: value}
                want = f"option {label}: "
            else:  # a sub-option: the parent holds one element with valid required sub-options
                parent = spec[path[0]]
                element = {**_filled(parent["options"], {}, path[1]), path[1]: value}
                args = {**_filled(spec, kw, path[0]), path[0]: [element] if parent.get("type") == "list" else element}
                want = f"option {path[0]}[0].{path[1]}: " if parent.get("type") == "list" else f"option {label}: "
            kind, res = run_module(mod, args)
            if kind != "fail" or not res["msg"].startswith(want) or "is not a string" not in res["msg"]:
                failures.append((label, repr(value), kind, str(res.get("msg", res))[:160]))
    assert not failures, f"{name}: {failures}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused option still wrote something"


def test_not_a_string_finds_nested_and_listed_values() -> None:
    try:
        from ansible_collections.dsv41.offload.plugins.module_utils.dsv41_common import not_a_string
    except ImportError:  # pragma: no cover - library/ layout
        from ansible.module_utils.dsv41_common import not_a_string
    spec = {
        "a": {"type": "path"},
        "b": {"type": "list", "elements": "str"},
        "c": {"type": "int"},
        "d": {"type": "list", "elements": "dict", "options": {"x": {"type": "str"}}},
    }
    assert not_a_string(spec, {"a": "p", "b": ["x", None], "c": 5, "d": [{"x": "s"}]}) is None
    assert not_a_string(spec, {"a": ["l"]}) == ("a", ["l"])
    assert not_a_string(spec, {"b": ["x", 7]}) == ("b[1]", 7)
    assert not_a_string(spec, {"d": [{"x": "s"}, {"x": {"k": 1}}]}) == ("d[1].x", {"k": 1})
    assert not_a_string(spec, {"a": None, "c": "5"}) is None  # unset, and types other than str/path
