"""Every state writer of the harness and the promotion code is atomic under concurrency: the
writers are enumerated from the sources (each function that calls a fileio writer) and each is
classified; the read-modify-write ones are run by concurrent processes and lose nothing, the
immutable package store gives one clear outcome, and no raw OS error escapes."""

from __future__ import annotations

import ast
import multiprocessing as mp
from pathlib import Path

import pytest

from dsv41.harness import win2, win2_cap
from dsv41.promotion import package as pkg

REPO = Path(__file__).resolve().parents[2]
WRITER_CALLS = {"atomic_write", "atomic_write_json", "stage", "append", "Appender", "atomic_path"}
#: (module, function) -> how concurrent writers stay correct.
#: whole: the new contents come only from the call's own arguments (no read of the old file), put
#:   in place by rename: concurrent writers each leave one whole file, none is torn.
#: locked-rmw: read-modify-write under filelock (test below). append: one O_APPEND write per entry.
#: immutable: content-addressed store; racing writers of one id converge (test below).
#: private: a file only its own run writes (a run's pid record, its cells, its own report).
WRITERS = {
    ("harness/bench_cli.py", "run"): "private",
    ("harness/drill_report.py", "plot_timeline"): "private",
    ("harness/drill_report.py", "write_report"): "private",
    ("harness/refs.py", "save_refs"): "whole",
    ("harness/win2_cap.py", "stage_window"): "locked-rmw",
    ("harness/window.py", "_save_plot"): "private",
    ("harness/window.py", "cell_done"): "private",
    ("harness/window.py", "run_cells"): "private",
    ("harness/window.py", "write_report"): "private",
    ("harness/window_cli.py", "candidate"): "whole",
    ("harness/window_cli.py", "simulate"): "whole",
    ("harness/window_pid.py", "write_run_pid"): "private",
    ("promotion/journal.py", "append"): "append",
    ("promotion/oplock.py", "acquire"): "locked-rmw",
    ("promotion/package.py", "_tarball"): "immutable",
    ("promotion/package.py", "write"): "immutable",
    ("promotion/workers.py", "_write"): "private",
}


def _writer_functions() -> set[tuple[str, str]]:
    found = set()
    for sub in ("harness", "promotion"):
        for path in sorted((REPO / "python" / "dsv41" / sub).glob("*.py")):
            tree = ast.parse(path.read_text())
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "fileio"
                        and node.func.attr in WRITER_CALLS
                    ):
                        found.add((f"{sub}/{path.name}", fn.name))
    return found


def test_every_writer_is_classified():
    found = _writer_functions()
    assert sorted(found - set(WRITERS)) == [], "classify these new state writers in WRITERS"
    assert {k for k in WRITERS if k not in found} == set(), "WRITERS lists a function that writes nothing"


def _record(args):
    state_dir, i = args
    win2_cap.record_window(state_dir, "aa", "tok_s", f"w{i}", "WIN")
    return i


def test_ten_concurrent_cap_records_keep_ten(tmp_path):
    n = 10
    with mp.get_context("fork").Pool(n) as pool:
        assert sorted(pool.map(_record, [(str(tmp_path), i) for i in range(n)])) == list(range(n))
    kept = win2_cap._load_questions(str(tmp_path))[win2_cap.question_key("aa", "tok_s")]
    assert sorted(w["window"] for w in kept) == sorted(f"w{i}" for i in range(n))
    assert not list(tmp_path.glob("*.tmp*"))


def _write_pkg(root):
    from promotionpkgutil import PROV, _hosts as hosts

    try:
        return pkg.write(root, *pkg.build(hosts(), PROV, b'{"refs": []}\n'))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails on it
        return ("error", f"{type(exc).__name__}: {exc}")


def test_concurrent_writes_of_one_package_give_one_outcome(tmp_path):
    n = 8
    with mp.get_context("fork").Pool(n) as pool:
        got = pool.map(_write_pkg, [str(tmp_path)] * n)
    assert all(g[0] != "error" for g in got), got
    assert len({g[0] for g in got}) == 1 and sum(1 for g in got if g[1]) == 1
    pkg.verify(tmp_path, got[0][0])
    assert pkg.known_ids(tmp_path) == [got[0][0]] and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("bad", ["*", "../x", "a/b"])
def test_cap_record_refuses_a_path_as_window_id(tmp_path, bad):
    with pytest.raises(win2.Win2Error):
        win2_cap.record_window(str(tmp_path), "aa", "tok_s", bad, "WIN")
