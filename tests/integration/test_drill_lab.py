"""The short form of the fault drill on the deployed lab: ``playbooks/drill.yml`` with two faults
(the table server stopped, the async proxy SIGKILLed) held a few seconds each under the bench
client's load. Asserts what issue 12 asks of every fault: zero failed requests, the fallbacks /
respawns counted, recovery after clearing, greedy references 6/6, and the playbook ending with
production verified. The full drill (every fault, longer) is ``make drill`` (docs/drills.md)."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from labutil import ROOT, needs_lab, play

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]


def test_short_drill_zero_failed_requests_and_recovery(deployed_lab) -> None:
    did = f"pytest-{uuid.uuid4().hex[:8]}"
    out = ROOT / "drills" / did
    try:
        r = play(
            "playbooks/drill.yml",
            "-e",
            "drill_faults=engram_server,async_proxy",
            "-e",
            "drill_duration_s=5",
            "-e",
            "drill_baseline_s=3",
            "-e",
            "drill_recover_timeout_s=40",
            "-e",
            "drill_streams=3",
            "-e",
            f"drill_id={did}",
            timeout=900,
        )
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
        rep = json.loads((out / "report.json").read_text())
        assert rep["ok"] is True and [f["fault"] for f in rep["faults"]] == ["engram_server", "async_proxy"]
        for f in rep["faults"]:
            assert f["requests"] > 0 and f["failed"] == 0, f["failures"]
            assert f["requests_across_fault"] > 0
            assert f["recovered"] and f["recovery_s"] is not None and f["recovery_s"] <= 40
            assert f["refs_ok"] and f["refs"]["summary"].startswith("6/6"), f["refs"]
        srv, proxy = rep["faults"]
        # The table server down: both ranks fell back to their local readers, and counted it.
        assert srv["fallbacks"]["0"] > 0 and srv["fallbacks"]["1"] > 0
        assert srv["inject"]["action"] == "systemctl stop dsv41-engram-server.service"
        # The proxy SIGKILLed by pid: the engine's watchdog respawned it (a new pid).
        assert proxy["proxy_respawns"] >= 1 and proxy["clear"]["respawned"] is True
        assert proxy["inject"]["proxy_pid"] != proxy["clear"]["proxy_pid"]
        assert (out / "summary.md").read_text().count("| yes |") == 2
        assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
        # The playbook cleared everything (nothing left to clear) and ended with production verified.
        assert "Verify | readiness of both ranks" in r.stdout and "failed=1" not in r.stdout
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_unknown_fault_is_one_error_before_anything_changes() -> None:
    """No lab needed: the first play refuses the name, so no status read and no fault injected."""
    before = sorted((ROOT / "drills").glob("*")) if (ROOT / "drills").exists() else []
    r = play("playbooks/drill.yml", "-e", "drill_faults=engram_server,tablez", timeout=120)
    assert r.returncode != 0
    assert "drill: unknown fault 'tablez' (known: engram_server, drafter_worker, async_proxy," in r.stdout
    assert "PLAY [Status |" not in r.stdout and "Inject and clear" not in r.stdout
    assert (sorted((ROOT / "drills").glob("*")) if (ROOT / "drills").exists() else []) == before
