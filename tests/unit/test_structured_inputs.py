"""Every JSON and YAML document the project parses goes through ``dsv41.fileio``'s strict parsers,
and hostile documents give one line and a non-zero exit, never a traceback.

The class: what ``json.loads`` / ``yaml.safe_load`` accept or do silently that no reader of this
project wants: nesting past Python's recursion limit (``RecursionError`` is no ``ValueError``:
``dsv41 engram layout`` and ``dsv41 window decide`` printed tracebacks), ``NaN``/``Infinity``
(not JSON; a NaN passes every range check and JSON Schema's ``minimum``: a candidate with
``min_effect: .nan`` validated, exit 0, and printed ``NaN``), and a key given twice (the last
wins silently). The parse sites are enumerated from the package's own source (every call of
``json.load(s)`` / ``yaml.*load``), so a new reader is caught the day it is added.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import yaml

from dsv41 import cli, fileio
from dsv41.errors import run_app

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "python" / "dsv41").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])

# Parse sites that keep their own parser, and why.
OWN_PARSER = {
    "python/dsv41/codec.py": "the strict parsers themselves",
    "python/dsv41/engine/protocol.py": "request bodies: BigInt for over-long integers, RecursionError and "
    "NaN refused per field as HTTP 400 (test_engine_api_fuzz.py)",
    "plugins/modules/rdma_link.py": "`ip -j` output on a managed host, where the module runs without dsv41",
}
LOADERS = {
    ("json", "loads"),
    ("json", "load"),
    ("yaml", "safe_load"),
    ("yaml", "load"),
    ("yaml", "full_load"),
    ("yaml", "unsafe_load"),
    ("yaml", "safe_load_all"),
    ("yaml", "load_all"),
}


def _parse_sites() -> dict[str, list[int]]:
    sites: dict[str, list[int]] = {}
    for f in SOURCES:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in LOADERS
            ):
                sites.setdefault(str(f.relative_to(ROOT)), []).append(node.lineno)
    return sites


def test_every_parse_site_uses_the_strict_parsers() -> None:
    sites = _parse_sites()
    assert set(OWN_PARSER) <= set(sites), set(OWN_PARSER) - set(sites)  # the list stays current
    stray = {f: lines for f, lines in sites.items() if f not in OWN_PARSER}
    assert not stray, f"parse with dsv41.fileio.loads_json / loads_yaml instead: {stray}"
    uses = sum(f.read_text().count("fileio.loads_json(") + f.read_text().count("fileio.loads_yaml(") for f in SOURCES)
    assert uses > 30, uses


DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_JSON = {
    "deep array": (DEEP, "nested too deeply"),
    "deep object": ('{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    "NaN": ('{"a": NaN}', "NaN is not a JSON number"),
    "Infinity": ("[1, -Infinity]", "-Infinity is not a JSON number"),
    "duplicate key": ('{"a": 1, "b": {"c": 2, "c": 3}}', "key 'c' appears twice"),
    "huge integer": ("1" * 5000, "Exceeds the limit"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_loads_json_refuses_as_a_json_error(case: str) -> None:
    text, why = HOSTILE_JSON[case]
    with pytest.raises(json.JSONDecodeError, match=why) as info:
        fileio.loads_json(text)
    assert str(info.value).count("\n") == 0
    assert fileio.loads_json('{"a": [1, 2.5e300, "NaN"], "b": null}') == {"a": [1, 2.5e300, "NaN"], "b": None}


HOSTILE_YAML = {
    "duplicate key": ("a: 1\nb: {c: 2, c: 3}\n", "found key 'c' twice"),
    ".nan": ("x: .nan\n", "'.nan' is not a finite number"),
    "-.inf": ("x: [1, -.Inf]\n", "'-.Inf' is not a finite number"),
    "deep": ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_YAML))
def test_loads_yaml_refuses_as_a_yaml_error(case: str) -> None:
    text, why = HOSTILE_YAML[case]
    with pytest.raises(yaml.YAMLError, match=why):
        fileio.loads_yaml(text)


def test_loads_yaml_reads_what_safe_load_reads() -> None:
    """Every shipped YAML document the package reads parses the same as with ``safe_load``."""
    docs = [*(ROOT / "candidates").glob("*.yml"), ROOT / "roles" / "monitoring" / "defaults" / "main.yml"]
    assert len(docs) >= 4
    for p in docs:
        assert fileio.loads_yaml(p.read_text()) == yaml.safe_load(p.read_text()), p
    assert fileio.loads_yaml("a: &x {b: 1}\nc: *x\nd: 1.5\n") == {"a": {"b": 1}, "c": {"b": 1}, "d": 1.5}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    rc = run_app(cli.app, argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err[-2000:]
    return rc, out.err


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_json_reading_commands_give_one_line(case: str, tmp_path: Path, capsys) -> None:
    """The commands that read a JSON config, a JSONL cells file and a manifest, with each hostile
    document: exit 1, one ``dsv41: error:`` line naming the file."""
    text, _why = HOSTILE_JSON[case]
    p = tmp_path / "doc.json"
    p.write_text(text + "\n")
    for argv in (
        ["engram", "layout", str(p)],
        ["window", "decide", str(p)],
        ["engram", "verify", "--manifest", str(p)],
    ):
        rc, err = _run(argv, capsys)
        assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("dsv41: error: ") and "doc.json" in err, (
            argv,
            rc,
            err[-500:],
        )


GOOD_CANDIDATE = (ROOT / "candidates" / "aa.yml").read_text().replace("name: aa", "name: x")
HOSTILE_CANDIDATES = {
    "duplicate key": (GOOD_CANDIDATE + "min_effect: 0.5\n", "found key 'min_effect' twice in one mapping"),
    ".nan": (GOOD_CANDIDATE.replace("min_effect: 0.05", "min_effect: .nan"), "'.nan' is not a finite number"),
    ".inf": (GOOD_CANDIDATE.replace("min_effect: 0.05", "min_effect: -.inf"), "'-.inf' is not a finite number"),
    "deep": (GOOD_CANDIDATE.replace("roles: {}", "roles: " + "[" * 5000 + "]" * 5000), "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CANDIDATES))
def test_a_hostile_candidate_is_refused_in_one_line(case: str, tmp_path: Path, capsys) -> None:
    text, why = HOSTILE_CANDIDATES[case]
    assert text != GOOD_CANDIDATE
    (tmp_path / "x.yml").write_text(text)
    rc, err = _run(["window", "candidate", "--root", str(tmp_path), "x"], capsys)
    assert rc == 1 and len(err.splitlines()) == 1 and "x.yml is not readable YAML" in err and why in err, (
        rc,
        err[-500:],
    )
    (tmp_path / "x.yml").write_text(GOOD_CANDIDATE)
    assert _run(["window", "candidate", "--root", str(tmp_path), "x"], capsys)[0] == 0


def test_finite_false_reads_the_package_s_own_open_ci_and_stays_strict_otherwise() -> None:
    """A window decision whose CI win2 could not bound (``[-inf, inf]``, method ``none``) as
    ``json.dumps`` writes it is still read by promotion; duplicates and depth are still refused."""
    doc = {"verdict": "UNRESOLVED", "ci": [-float("inf"), float("inf")]}
    assert fileio.loads_json(json.dumps(doc), finite=False) == doc
    with pytest.raises(json.JSONDecodeError, match="Infinity is not a JSON number"):
        fileio.loads_json(json.dumps(doc))
    for case in ("duplicate key", "deep array"):
        with pytest.raises(json.JSONDecodeError):
            fileio.loads_json(HOSTILE_JSON[case][0], finite=False)
