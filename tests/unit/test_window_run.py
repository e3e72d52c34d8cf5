"""``harness.window_run.run_window`` called directly with a :class:`WindowParams` (no CLI): the
result, the report files, ``run.pid`` removed, the progress callbacks, refusals before anything
is written, an interrupted window; and every ``dsv41 window run`` option reaching a params field
with the same default."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from dsv41.harness import bench, win2, window, window_pid, window_run
from dsv41.harness.window import WindowError

SPEC = str(Path(__file__).resolve().parents[2] / "candidates" / "specs" / "drill.json")


def _fake_stream(client, url, body, prompt_id, category):
    return bench.RequestResult(
        prompt_id,
        category,
        body.get("seed", 0),
        body.get("max_tokens", 8),
        ok=True,
        ttft_ms=50.0,
        step_ms_p50=20.0,
        tok_s=50.0,
        tokens_per_step=1.0,
        steps=8,
        step_ms=[20.0] * 7,
        finish_reason="length",
        completion_tokens=8,
    )


@pytest.fixture
def fake_arms(monkeypatch):
    monkeypatch.setattr(bench, "stream_one", _fake_stream)
    monkeypatch.setattr(bench, "served_model", lambda url, **kw: "dsv41-lab")
    monkeypatch.setattr(bench, "smoke", lambda *a, **kw: {"canary": {"ok": True}, "greedy": {"ok": True}})


def _params(tmp_path, **kw) -> window_run.WindowParams:
    return window_run.WindowParams(
        control="http://x",
        candidate="http://x",
        spec=bench.load_spec(SPEC),
        seed=3,
        windows_dir=str(tmp_path),
        snapshot_metrics=False,
        **kw,
    )


def test_run_window_writes_the_report_and_returns_the_decision(tmp_path, fake_arms):
    seen: dict = {"cells": 0}

    @contextlib.contextmanager
    def progress(wid, total):
        seen.update(wid=wid, total=total)
        yield lambda rec: seen.update(cells=seen["cells"] + 1)

    res = window_run.run_window(_params(tmp_path, window_id="w1"), progress=progress)
    plan = window.plan_cells(bench.load_spec(SPEC), 3, "s")
    assert (res.window_id, res.dir, res.interrupted) == ("w1", str(tmp_path / "w1"), False)
    assert seen == {"wid": "w1", "total": len(plan), "cells": len(plan)}
    assert res.summary_path == str(tmp_path / "w1" / "summary.md") and os.path.isfile(res.summary_path)
    dec = json.loads((tmp_path / "w1" / "decision.json").read_text())
    assert dec["decision"]["verdict"] == res.decision.verdict
    assert len(Path(res.cells_path).read_text().splitlines()) == len(plan)
    assert not (tmp_path / "w1" / window_pid.RUN_PID_NAME).exists()
    # the cap recorded the window (params.cap defaults to True, as the CLI without --no-cap)
    assert [w["window"] for w in json.loads((tmp_path / "questions.json").read_text())["aa:step_ms_p50"]] == ["w1"]


def test_run_window_refusals_before_anything_is_written(tmp_path, fake_arms):
    with pytest.raises(win2.Win2Error, match="unknown metric 'p99'"):
        window_run.run_window(_params(tmp_path, window_id="w", metric="p99"))
    assert not (tmp_path / "w").exists()
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "cells.jsonl").write_text("")
    with pytest.raises(WindowError, match="already has cells"):
        window_run.run_window(_params(tmp_path, window_id="w"))
    with pytest.raises(WindowError, match="switching to the control arm failed"):
        window_run.run_window(_params(tmp_path, window_id="w2", switch_cmd="exit 3"))
    assert not (tmp_path / "w2" / window_pid.RUN_PID_NAME).exists()  # removed on the way out
    assert not (tmp_path / "questions.json").exists()


def test_run_window_interrupted_keeps_cells_and_decides_invalid(tmp_path, fake_arms, monkeypatch):
    calls = {"n": 0}

    def stream(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return _fake_stream(*a, **kw)

    monkeypatch.setattr(bench, "stream_one", stream)
    res = window_run.run_window(_params(tmp_path, window_id="wi", cap=False))
    assert res.interrupted and res.decision.verdict == "INVALID"
    assert len(Path(res.cells_path).read_text().splitlines()) == 2
    meta = json.loads((tmp_path / "wi" / "decision.json").read_text())
    assert meta["interrupted"] is True and not (tmp_path / "questions.json").exists()


# CLI options whose params field has another name (or sense); as_json is the printing's alone.
_RENAMED = {
    "refs_file": ("refs_path", lambda v: v),
    "no_cap": ("cap", lambda v: not v),
    "no_metrics": ("snapshot_metrics", lambda v: not v),
    # the JSON facts become {rank: url} (dsv41.harness.rank_metrics.urls); empty: none
    "rank_metrics": ("rank_urls", lambda v: {} if v == "" else v),
}


def test_every_window_run_option_reaches_a_params_field_with_its_default():
    import dataclasses

    from typer.main import get_command

    from dsv41.harness import window_cli

    fields = {f.name: f for f in dataclasses.fields(window_run.WindowParams)}
    cmd = get_command(window_cli.app).commands["run"]
    covered = set()
    for p in cmd.params:
        if p.name in ("as_json", "spec"):  # spec: the CLI loads the file (bench.load_spec) into params.spec
            continue
        name, conv = _RENAMED.get(p.name, (p.name, lambda v: v))
        assert name in fields, f"--{p.name} has no WindowParams field"
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            want = f.default
        elif f.default_factory is not dataclasses.MISSING:
            want = f.default_factory()
        else:
            assert p.required, f"--{p.name}: the field is required but the option is not"
            covered.add(name)
            continue
        got = conv(list(p.default) if isinstance(p.default, tuple) else p.default)
        assert got == want, f"--{p.name}: CLI default {p.default!r}, WindowParams {want!r}"
        covered.add(name)
    assert set(fields) - covered == {"spec"}


def test_run_window_starts_the_fault_command_and_triggers_it_after_n_cells(tmp_path, fake_arms, monkeypatch):
    """The mid-cell drill's wiring: --fault-cmd starts before the cells and waits for {trigger},
    which appears once --fault-after-cells cells are written; the trigger file is gone after."""
    calls = {"n": 0}
    marks = tmp_path / "marks"

    def stream(*a, **kw):
        calls["n"] += 1
        marks.open("a").write(f"cell {calls['n']}\n")
        return _fake_stream(*a, **kw)

    monkeypatch.setattr(bench, "stream_one", stream)
    cmd = f"while [ ! -e {{trigger}} ]; do sleep 0.02; done; echo struck >> {marks}"
    res = window_run.run_window(_params(tmp_path, window_id="wf", cap=False, fault_after_cells=2, fault_cmd=cmd))
    lines = marks.read_text().splitlines()
    assert "struck" in lines and lines.index("struck") >= 2  # not before the second cell was written
    assert not (Path(res.dir) / "fault.trigger").exists()


def test_a_fault_drill_that_failed_is_recorded_and_named(tmp_path, fake_arms):
    """The mid-cell drill's command failed after its trigger: the decision is written with the
    fault's record (rc, log) and the result names the failure (window run exits non-zero)."""
    cmd = "while [ ! -e {trigger} ]; do sleep 0.02; done; echo unreachable >&2; exit 2"
    res = window_run.run_window(_params(tmp_path, window_id="wbad", cap=False, fault_after_cells=1, fault_cmd=cmd))
    doc = json.loads((Path(res.dir) / "decision.json").read_text())
    assert doc["fault"]["triggered"] and doc["fault"]["rc"] == 2 and doc["fault"]["log"] == "fault.log"
    assert (Path(res.dir) / "fault.log").read_text() == "unreachable\n"
    assert res.fault_failure.startswith("fault drill command failed (rc 2)")
    ok = window_run.run_window(
        _params(
            tmp_path,
            window_id="wok",
            cap=False,
            fault_after_cells=1,
            fault_cmd="while [ ! -e {trigger} ]; do sleep 0.02; done",
        )
    )
    assert ok.fault_failure is None
    assert json.loads((Path(ok.dir) / "decision.json").read_text())["fault"]["rc"] == 0


def test_rank_endpoints_are_snapshotted_once_besides_the_metrics_urls():
    assert window_run._with_ranks(
        ["http://a:1/metrics"], {"0": "http://a:1/metrics", "1": "http://b:9471/metrics"}
    ) == ["http://a:1/metrics", "http://b:9471/metrics"]
    assert window_run._with_ranks(["http://a:1/metrics"], {}) == ["http://a:1/metrics"]
