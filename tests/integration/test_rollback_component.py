"""Per-component rollback on the deployed three-host lab (playbooks/rollback_component.yml), then
production restored by a plain deploy.yml.

For each component under test: ``--check --diff`` shows the env file change and changes nothing;
the rollback removes the component from the env files, restarts the ranks under a HOLD and checks
the behaviour the seed's rollback table names (counters before/after, greedy references 6/6, zero
failed requests) before admission reopens; a second run changes nothing; deploy.yml puts the
component back. ``make test`` runs one component (remote_engram, about 4 min on the idle 2-core
box); ``make rollback-components`` (DSV41_ROLLBACK_COMPONENTS=all) runs all three
(docs/promotion.md, "Per-component rollback").
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from labutil import inside, needs_lab, play

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]

ALL = ("async_handoff", "remote_drafter", "remote_engram")
SELECTED = ALL if os.environ.get("DSV41_ROLLBACK_COMPONENTS", "") == "all" else ("remote_engram",)
API = "http://198.18.0.11:8000"

# What each rollback must take out of the env files (and deploy.yml must put back).
ENV_FILE = {"async_handoff": "/etc/dsv41/drafter.env", "remote_drafter": "/etc/dsv41/drafter.env",
            "remote_engram": "/etc/dsv41/engram-overlay.env"}
PRODUCTION_LINE = {"async_handoff": "DSV41_DRAFTER_ASYNC=1", "remote_drafter": "DSV41_DRAFTER_REMOTE=tcp://",
                   "remote_engram": "DSV41_ENGRAM_REMOTE=tcp://"}
ROLLED_BACK_LINE = {"async_handoff": "DSV41_DRAFTER_ASYNC=0", "remote_drafter": "DSV41_DRAFTER_LOCAL=/opt/dsv41/drafter",
                    "remote_engram": "# Remote Engram off"}


def _recap_changed(stdout: str) -> dict[str, int]:
    recap = stdout.split("PLAY RECAP")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", recap, re.M)}


def _report(path) -> dict:
    doc = json.loads(path.read_text())
    path.unlink()
    return doc


def _admission() -> bool:
    import httpx

    return httpx.get(API + "/is_paused", timeout=10, trust_env=False).json()["is_paused"]


def _env(path: str) -> str:
    return inside("sparkhead", "cat", path).stdout


@pytest.mark.parametrize("component", SELECTED)
def test_rollback_component_then_deploy_restores(deployed_lab, component, tmp_path):
    path = ENV_FILE[component]
    report = tmp_path / "report.json"
    before = _env(path)
    assert PRODUCTION_LINE[component] in before

    # --check --diff: shows the change, makes none
    t0 = time.monotonic()
    chk = play("playbooks/rollback_component.yml", "-e", f"component={component}", "--check", "--diff")
    assert chk.returncode == 0, chk.stdout[-6000:]
    assert f"+{ROLLED_BACK_LINE[component]}" in chk.stdout and f"-{PRODUCTION_LINE[component]}" in chk.stdout
    assert _env(path) == before and not _admission()

    # the rollback: HOLD, restart, checks, admission reopened
    t1 = time.monotonic()
    r = play("playbooks/rollback_component.yml", "-e", f"component={component}",
             "-e", f"rollback_component_report={report}", timeout=900)
    t2 = time.monotonic()
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert re.search(r"RUNNING HANDLER \[serve : HOLD admission before the restart.*\n(changed|ok): \[spark", r.stdout), \
        r.stdout[-6000:]
    rep = _report(report)
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"] and all(c["ok"] for c in checks.values()), checks
    assert checks["greedy references"]["detail"] == "6/6 identical"
    assert rep["failed_requests"] == 0 and checks["failed requests"]["detail"].startswith("0 failed of ")
    after = _env(path)
    assert PRODUCTION_LINE[component] not in after and ROLLED_BACK_LINE[component] in after
    assert not _admission()

    # idempotent: nothing changes, the checks still pass
    again = play("playbooks/rollback_component.yml", "-e", f"component={component}",
                 "-e", f"rollback_component_report={report}", timeout=900)
    t3 = time.monotonic()
    assert again.returncode == 0, again.stdout[-6000:]
    assert set(_recap_changed(again.stdout).values()) == {0}, again.stdout.split("PLAY RECAP")[-1]
    assert "HOLD admission before the restart" not in again.stdout  # no restart, no HOLD
    assert _report(report)["ok"]

    # a plain deploy.yml puts the component back (and verifies 6/6 with remote counters)
    dep = play("deploy.yml", timeout=1800)
    t4 = time.monotonic()
    assert dep.returncode == 0, dep.stdout[-6000:]
    assert _env(path) == before
    # what the docs record (run with -s to see it)
    print(f"\n{component}: " + "; ".join(f"{c['name']}: {c['detail']}" for c in checks.values())
          + f"\n  check run {rep['seconds']} s; timings: --check {t1 - t0:.1f} s, rollback {t2 - t1:.1f} s, "
          f"second run {t3 - t2:.1f} s, deploy {t4 - t3:.1f} s")
