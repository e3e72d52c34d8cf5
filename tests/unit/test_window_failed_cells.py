"""A window whose engine dies mid-cell ends as a decided INVALID window, not an aborted run.

Issue 11: a refused ``/metrics`` read (rank 0's engine SIGKILLed by the mid-cell drill) used to
raise out of ``dsv41 window run``; no decision.json was written. Now the cell is recorded failed,
the WIN2 rule decides INVALID, the report is written and the run exits 0 printing ``INVALID``
(window.yml then restores with both ranks restarted and ends non-zero).
"""

from __future__ import annotations

import json
import os

from dsv41.harness import bench, win2, win2_cap, window

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "candidates", "specs", "drill.json")


def _ok_result(prompt_id, category, seed, max_tokens):
    return bench.RequestResult(
        prompt_id,
        category,
        seed,
        max_tokens,
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


def _fake_stream(client, url, body, prompt_id, category):
    return _ok_result(prompt_id, category, body.get("seed", 0), body.get("max_tokens", 8))


class _Metrics:
    """snapshot_metrics that answers ``ok_calls`` times, then is refused like a killed engine."""

    def __init__(self, ok_calls):
        self.calls, self.ok_calls = 0, ok_calls

    def __call__(self, urls, timeout_s=10.0):
        self.calls += 1
        if self.calls > self.ok_calls:
            raise bench.BenchError("GET http://198.18.0.11:8000/metrics failed: [Errno 111] Connection refused")
        return {u: {"dsv41_engram_lookups_total": float(self.calls)} for u in urls}


def _plan():
    return window.plan_cells(bench.load_spec(SPEC), 3, "s")


def test_refused_metrics_before_a_cell_is_a_failed_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "stream_one", _fake_stream)
    snap = _Metrics(ok_calls=4)  # two cells measured (before + after each), the third's "before" refused
    monkeypatch.setattr(bench, "snapshot_metrics", snap)
    out = tmp_path / "cells.jsonl"
    plan = _plan()
    done = window.run_cells(
        plan,
        {"control": "http://x", "candidate": "http://x"},
        "m",
        {"temperature": 1.0},
        5.0,
        str(out),
        metrics={"control": ["http://x/metrics"], "candidate": ["http://x/metrics"]},
    )
    assert [c["ok"] for c in done] == [True, True, False]
    assert "before the cell refused" in done[2]["error"] and "Connection refused" in done[2]["error"]
    assert "ttft_ms" not in done[2]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == done  # the failed cell is on disk too
    d = win2.decide(done + [window.failed_cell(c, "not run") for c in plan[3:]], n_resamples=199)
    assert d.verdict == "INVALID"


def test_refused_metrics_after_a_cell_fails_that_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "stream_one", _fake_stream)
    monkeypatch.setattr(bench, "snapshot_metrics", _Metrics(ok_calls=1))
    done = window.run_cells(
        _plan(),
        {"control": "http://x", "candidate": "http://x"},
        "m",
        {},
        5.0,
        str(tmp_path / "c.jsonl"),
        metrics={"control": ["u"], "candidate": ["u"]},
    )
    assert len(done) == 1 and done[0]["ok"] is False
    assert "after the cell refused" in done[0]["error"] and done[0]["ttft_ms"] == 50.0


def test_failed_switch_is_a_failed_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "stream_one", _fake_stream)
    seen = []

    def switch(arm):
        seen.append(arm)
        if len(seen) == 2:
            raise window.WindowError("switching to the candidate arm failed (exit 2): x")

    done = window.run_cells(
        _plan(),
        {"control": "http://x", "candidate": "http://x"},
        "m",
        {},
        5.0,
        str(tmp_path / "c.jsonl"),
        switch=switch,
    )
    assert done[-1]["ok"] is False and done[-1]["error"].startswith("arm switch failed: switching to the")
    assert all(c["ok"] for c in done[:-1])


def test_cli_run_writes_an_invalid_decision_when_metrics_are_refused(tmp_path, monkeypatch, capsys):
    from dsv41.cli import main

    monkeypatch.setattr(bench, "stream_one", _fake_stream)
    monkeypatch.setattr(bench, "snapshot_metrics", _Metrics(ok_calls=6))
    monkeypatch.setattr(bench, "served_model", lambda url, **kw: "dsv41-lab")
    monkeypatch.setattr(bench, "smoke", lambda *a, **kw: {"canary": {"ok": True}, "greedy": {"ok": True}})
    rc = main(
        [
            "window",
            "run",
            "--control",
            "http://x",
            "--candidate",
            "http://x",
            "--spec",
            SPEC,
            "--name",
            "aa",
            "--seed",
            "3",
            "--windows-dir",
            str(tmp_path),
            "--id",
            "w-killed",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("INVALID")
    dec = json.loads((tmp_path / "w-killed" / "decision.json").read_text())
    assert dec["decision"]["verdict"] == "INVALID"
    cells = [json.loads(x) for x in (tmp_path / "w-killed" / "cells.jsonl").read_text().splitlines()]
    assert [c["ok"] for c in cells] == [True, True, True, False]
    # an INVALID window does not count against the question's two-window cap
    assert win2_cap.check_cap(str(tmp_path), "aa", "step_ms_p50") == 1


def test_cli_run_stdout_is_the_decision_even_with_a_noisy_switch(tmp_path, monkeypatch, capfd):
    """window.yml reads the verdict from the first line of `dsv41 window run`'s stdout (an INVALID
    window must be seen): a switch command's own output (ansible-playbook's) goes to stderr."""
    from dsv41.cli import main

    monkeypatch.setattr(bench, "stream_one", _fake_stream)
    monkeypatch.setattr(bench, "snapshot_metrics", _Metrics(ok_calls=6))
    monkeypatch.setattr(bench, "served_model", lambda url, **kw: "dsv41-lab")
    monkeypatch.setattr(bench, "smoke", lambda *a, **kw: {"canary": {"ok": True}, "greedy": {"ok": True}})
    rc = main(
        [
            "window",
            "run",
            "--control",
            "http://x",
            "--candidate",
            "http://x",
            "--spec",
            SPEC,
            "--name",
            "aa",
            "--seed",
            "3",
            "--windows-dir",
            str(tmp_path),
            "--id",
            "w-noisy",
            "--switch-cmd",
            "echo; echo PLAY switching to {arm}",
        ]
    )
    out, err = capfd.readouterr()
    assert rc == 0 and out.startswith("INVALID"), out
    assert "PLAY switching to control" in err and "PLAY switching" not in out
