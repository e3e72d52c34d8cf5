"""Every JSON document the project writes goes through ``dsv41.fileio.dumps_json``: no ``NaN`` or
``Infinity`` ever reaches a file, stdout or a peer.

The class: ``json.dumps`` writes ``NaN``/``Infinity``/``-Infinity`` by default (not JSON, RFC 8259
section 6). A window whose every prompt had one block wrote ``"ci": [-1.0, Infinity]`` into
its ``decision.json``, which ``jq`` and the package's own strict reader refuse (promotion read it
with ``finite=False``); a scraped ``NaN`` in a cell record made ``cells.jsonl`` unreadable for the
decision. The write sites are enumerated from the package's own source (every call of
``json.dump`` / ``json.dumps`` / ``JSONEncoder``), so a new writer is caught the day it is added;
every call of the one place says what a non-finite value becomes there (``nonfinite``).
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from dsv41 import fileio

ROOT = Path(__file__).resolve().parents[2]
# library/ holds symlinks to plugins/modules (ansible.cfg's library=library): scanned through plugins/
SOURCES = sorted([*(ROOT / "python" / "dsv41").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])

# Write sites that keep their own encoder, and why.
OWN_ENCODER = {
    "python/dsv41/codec.py": "dumps_json itself (allow_nan=False)",
}
WRITERS = {("json", "dumps"), ("json", "dump"), ("json", "JSONEncoder")}
ONE_PLACE = {"dumps_json", "atomic_write_json"}


def _calls() -> list[tuple[str, int, ast.Call]]:
    out = []
    for f in SOURCES:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call):
                out.append((str(f.relative_to(ROOT)), node.lineno, node))
    return out


def _is(node: ast.Call, pairs: set) -> bool:
    return (
        isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and (node.func.value.id, node.func.attr) in pairs
    )


def test_every_json_writer_goes_through_dumps_json() -> None:
    calls = _calls()
    sites: dict[str, list[int]] = {}
    for f, line, node in calls:
        if _is(node, WRITERS):
            sites.setdefault(f, []).append(line)
    assert set(OWN_ENCODER) <= set(sites), set(OWN_ENCODER) - set(sites)  # the list stays current
    stray = {f: lines for f, lines in sites.items() if f not in OWN_ENCODER}
    assert not stray, f"write JSON with dsv41.fileio.dumps_json / atomic_write_json instead: {stray}"
    uses = [(f, line, node) for f, line, node in calls if _is(node, {("fileio", n) for n in ONE_PLACE})]
    assert len(uses) > 50, len(uses)
    # each writer's choice is deliberate and readable at the call: absent (refuse) or a literal
    vague = [
        (f, line)
        for f, line, node in uses
        for kw in node.keywords
        if kw.arg == "nonfinite" and not (isinstance(kw.value, ast.Constant) and kw.value.value in ("refuse", "null"))
    ]
    assert not vague, f"nonfinite= must be the literal 'refuse' or 'null': {vague}"
    assert not any(kw.arg is None for _f, _l, node in uses for kw in node.keywords), (
        "no **kwargs: the choice is read at the call"
    )


def _nulls() -> set[str]:
    return {
        f
        for f, _line, node in _calls()
        if _is(node, {("fileio", n) for n in ONE_PLACE})
        and any(kw.arg == "nonfinite" and getattr(kw.value, "value", None) == "null" for kw in node.keywords)
    }


def test_the_measurement_records_write_null_with_a_reason() -> None:
    """The writers of measurement records keep the record (null plus the reason); canonical bytes,
    digests and requests to peers refuse (the default)."""
    measured = {
        "python/dsv41/harness/window.py",
        "python/dsv41/harness/drill_report.py",
        "python/dsv41/harness/bench_cli.py",
        "python/dsv41/harness/window_cli.py",
        "python/dsv41/entrypoints/qualify.py",
        "python/dsv41/entrypoints/status_cli.py",
        "python/dsv41/harness/metrics_cli.py",
    }
    canonical = {
        "python/dsv41/promotion/package.py",
        "python/dsv41/promotion/journal.py",
        "python/dsv41/engram/manifest.py",
        "python/dsv41/wheelhouse.py",
        "python/dsv41/overlay/fence.py",
    }
    nulls = _nulls()
    assert measured <= nulls, measured - nulls
    assert not canonical & nulls, canonical & nulls


DOCS = {
    "open CI": ({"verdict": "UNRESOLVED", "ci": [-math.inf, math.inf]}, {"/ci/0": "-inf", "/ci/1": "inf"}),
    "nested NaN": ({"a": {"b/c": [1.0, math.nan]}, "t": (2.5, "x")}, {"/a/b~1c/1": "nan"}),
    "numpy float64": ({"x": __import__("numpy").float64("inf")}, {"/x": "inf"}),
}


@pytest.mark.parametrize("case", sorted(DOCS))
def test_refuse_names_the_pointer_and_null_records_the_reason(case: str) -> None:
    doc, where = DOCS[case]
    with pytest.raises(fileio.EncodeError, match=f"cannot write the doc: {next(iter(where))} is ") as info:
        fileio.dumps_json(doc, what="the doc")
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    text = fileio.dumps_json(doc, nonfinite="null", indent=1)
    back = fileio.loads_json(text)  # strict: no NaN/Infinity in it
    assert back[fileio.NONFINITE_KEY] == where
    assert "NaN" not in text and "Infinity" not in text
    assert doc == DOCS[case][0] or case == "nested NaN"  # the caller's document is not changed
    assert fileio.loads_json(fileio.dumps_json({"a": [1, 2.5e300, "NaN"], "b": None})) == {
        "a": [1, 2.5e300, "NaN"],
        "b": None,
    }


def test_null_refuses_where_the_reason_has_no_place() -> None:
    with pytest.raises(fileio.EncodeError, match="not a JSON object"):
        fileio.dumps_json([1.0, math.nan], nonfinite="null")
    with pytest.raises(fileio.EncodeError, match="already has a 'nonfinite' key"):
        fileio.dumps_json({"nonfinite": {}, "x": math.inf}, nonfinite="null")
    with pytest.raises(fileio.EncodeError, match="is not JSON serializable"):
        fileio.dumps_json({"x": object()})
    with pytest.raises(fileio.EncodeError, match="Out of range float"):  # made by default=: refused in either mode
        fileio.dumps_json({"x": object()}, default=lambda o: math.inf, nonfinite="null")
    with pytest.raises(ValueError, match="nonfinite must be"):
        fileio.dumps_json({}, nonfinite="string")


def test_atomic_write_json_refuses_before_anything_is_replaced(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text('{"old": 1}\n')
    with pytest.raises(fileio.EncodeError, match=r"cannot write report .*r\.json: /x is nan"):
        fileio.atomic_write_json(p, {"x": math.nan}, "report")
    assert p.read_text() == '{"old": 1}\n' and sorted(tmp_path.iterdir()) == [p]
    from dsv41.errors import ConfigError

    with pytest.raises(ConfigError, match="/x is nan"):  # the caller's own error class
        fileio.atomic_write_json(p, {"x": math.nan}, "report", error=ConfigError)
    assert p.read_text() == '{"old": 1}\n'
    fileio.atomic_write_json(p, {"x": math.nan}, "report", nonfinite="null")
    assert fileio.read_json(p) == {"x": None, "nonfinite": {"/x": "nan"}}


def test_a_window_with_no_ci_writes_a_strict_decision(tmp_path: Path) -> None:
    """Every prompt with a single block: WIN2 has no CI (method none, [-inf, inf] in memory). The
    written decision.json reads back with the strict reader, the bounds null with the reason, and
    promotion still reads its verdict."""
    from dsv41.harness import bench, win2, window
    from dsv41.promotion import package

    sp = bench.load_spec(env={})
    sp["blocks_per_prompt"] = 1
    cells = []
    for i, c in enumerate(window.plan_cells(sp, 1, "s")):
        step = 20.0 if c["arm"] == "control" else 19.0 + (i % 3) * 0.1
        res = bench.RequestResult(
            c["prompt_id"],
            c["category"],
            c["seed"],
            c["max_tokens"],
            ok=True,
            ttft_ms=50.0,
            step_ms_p50=step,
            tok_s=50.0,
            tokens_per_step=1.5,
            steps=10,
            step_ms=[step] * 9,
            finish_reason="length",
            completion_tokens=14,
        )
        cells.append(window.cell_record(c, res))
    d = win2.decide(cells, n_resamples=199)
    assert d.verdict == "UNRESOLVED" and d.ci == (-1.0, math.inf), (d.ci, d.reasons)  # expm1 of [-inf, inf]
    window.write_report(str(tmp_path / "w1"), d, cells, {"window_id": "w1", "candidate": "aa"})
    doc = fileio.read_json(tmp_path / "w1" / "decision.json")  # strict
    assert doc["decision"]["ci"] == [-1.0, None] and doc["nonfinite"]["/decision/ci/1"] == "inf"
    cats = doc["decision"]["categories"]
    assert cats and all(doc["nonfinite"][f"/decision/categories/{c}/ci/1"] == "inf" for c in cats), doc["nonfinite"]
    assert any("no CI" in r for r in doc["decision"]["reasons"])
    assert package.window_verdict(doc) == "UNRESOLVED"
    assert json.loads((tmp_path / "w1" / "decision.json").read_text()) == doc
