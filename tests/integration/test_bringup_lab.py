"""The staged bring-up (bringup.yml) on the deployed three-host lab, started over
(``-e bringup_restart=true``): every stage up to ``async`` passes its gate in the published order,
each is one ``stage_passed`` step of the promotion journal, the stage-1 references and baseline
are recorded before any offload, and the final production is deploy.yml's (a deploy afterwards
changes nothing on the Sparks). A re-run afterwards has nothing left to run but the window.

``make lab-long`` runs it (lab_long: it restarts the TP pair four times).
"""

from __future__ import annotations

import json
import re

import pytest

from labutil import ROOT, inside, needs_lab, play
from promotionutil import JOURNAL

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab]

STAGES = ("stock", "links_rows", "remote_engram", "remote_drafter", "async")


def _bringup_entries() -> list[dict]:
    entries = [json.loads(line) for line in JOURNAL.read_text().splitlines() if line.strip()]
    begins = {e["op"]: e for e in entries if e["step"] == "begin" and e.get("kind") == "bringup"}
    run = list(begins.values())[-1]["bringup"]
    return [e for e in entries if e["op"] in begins and begins[e["op"]]["bringup"] == run]


def _changed(stdout: str, host: str) -> int:
    m = re.search(rf"^{host}\s*:\s*ok=\d+\s+changed=(\d+)", stdout.split("PLAY RECAP")[-1], re.MULTILINE)
    assert m, stdout[-3000:]
    return int(m.group(1))


def _changed_tasks(stdout: str, host: str) -> list[str]:
    """The TASK headers under which ``host`` reported ``changed`` (what a non-idempotent run changed)."""
    out, task = [], ""
    for line in stdout.splitlines():
        if line.startswith("TASK ["):
            task = line
        elif line.startswith(f"changed: [{host}"):
            out.append(task)
    return out


def test_bringup_from_a_deployed_lab_reaches_async_then_deploy_changes_nothing(deployed_lab):
    # the window needs a candidate: without one the bring-up stops before it, naming it
    r = play("bringup.yml", "-e", "bringup_restart=true", timeout=3600)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "bring-up stopped before stage window on localhost: no candidate" in out, out[-6000:]

    entries = _bringup_entries()
    passed = [e["stage"] for e in entries if e["step"] == "stage_passed"]
    assert passed == list(STAGES), passed
    stock = next(e for e in entries if e["step"] == "stage_passed" and e["stage"] == "stock")
    baseline = json.loads((ROOT / "bringup" / stock["bringup"] / "baseline.json").read_text())
    assert baseline["components"] == {
        "engram_overlay_remote": False,
        "spec_decode_async": False,
        "spec_decode_capacity_mode": False,
        "spec_decode_remote": False,
    }
    assert baseline["greedy_refs"]["total"] == 6 and baseline["kv_cache_tokens"] > 0
    # references recorded before any offload: the stock stage passed before remote_engram began
    order = [(e["step"], e.get("stage")) for e in entries if e["step"] in ("begin", "stage_passed")]
    assert order.index(("stage_passed", "stock")) < order.index(("begin", "remote_engram"))
    # each change stage ran under a HOLD and finished (verified, done) before its gate was journaled
    for stage in ("remote_engram", "remote_drafter", "async"):
        op = next(e["op"] for e in entries if e["step"] == "begin" and e.get("stage") == stage)
        steps = [e["step"] for e in entries if e["op"] == op]
        assert steps[:2] == ["begin", "held"] and steps[-2:] == ["done", "stage_passed"], (stage, steps)
        assert "verified" in steps

    # final production is deploy.yml's: the env files carry every component again
    assert "DSV41_ENGRAM_REMOTE=tcp://" in inside("sparkhead", "cat", "/etc/dsv41/engram-overlay.env").stdout
    drafter_env = inside("sparkhead", "cat", "/etc/dsv41/drafter.env").stdout
    assert "DSV41_DRAFTER_REMOTE=tcp://" in drafter_env and "DSV41_DRAFTER_ASYNC=1" in drafter_env

    # resuming: only the window is left
    r2 = play("bringup.yml", timeout=600)
    assert "running window" in r2.stdout and r2.returncode != 0, r2.stdout[-3000:]

    d = play("deploy.yml", "--tags", "engram_overlay,spec_decode,serve", timeout=1800)
    assert d.returncode == 0, d.stdout[-6000:]
    for host in ("sparkhead", "sparkworker"):
        assert _changed(d.stdout, host) == 0, (host, _changed_tasks(d.stdout, host))
