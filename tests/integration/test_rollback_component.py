"""Per-component rollback on the deployed three-host lab (playbooks/rollback_component.yml), then
production restored by deploy.yml.

``make test`` runs :func:`test_rollback_remote_engram_then_deploy_restores` (about 4 min on the
2-core box): ``--check --diff`` shows the env file change and changes nothing; the rollback takes
``DSV41_ENGRAM_REMOTE*`` out, restarts the ranks under a HOLD and checks the behaviour the seed's
rollback table names (table server requests still, local lookups on both ranks with 0 fallbacks,
greedy references 6/6, zero failed requests) before admission reopens; deploy.yml, limited to the
Spark roles and its verify (``--tags engram_overlay,spec_decode,serve,verify``), puts it back.

``make rollback-components`` (``DSV41_ROLLBACK_COMPONENTS=all``, about 13 min) runs
:func:`test_rollback_every_component_then_plain_deploy_restores`: all three components in turn,
each with ``--check --diff``, the rollback and a second run that changes nothing, then a plain
``ansible-playbook deploy.yml`` (docs/promotion.md, "Per-component rollback").
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from labutil import API, HOSTS, inside, needs_lab, play

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]

ALL = os.environ.get("DSV41_ROLLBACK_COMPONENTS", "") == "all"
PLAYBOOK = "playbooks/rollback_component.yml"

# What each rollback must take out of the env files (and deploy.yml must put back).
ENV_FILE = {
    "async_handoff": "/etc/dsv41/drafter.env",
    "remote_drafter": "/etc/dsv41/drafter.env",
    "remote_engram": "/etc/dsv41/engram-overlay.env",
}
PRODUCTION_LINE = {
    "async_handoff": "DSV41_DRAFTER_ASYNC=1",
    "remote_drafter": "DSV41_DRAFTER_REMOTE=tcp://",
    "remote_engram": "DSV41_ENGRAM_REMOTE=tcp://",
}
ROLLED_BACK_LINE = {
    "async_handoff": "DSV41_DRAFTER_ASYNC=0",
    "remote_drafter": "DSV41_DRAFTER_LOCAL=/opt/dsv41/drafter",
    "remote_engram": "# Remote Engram off",
}
HOLD = re.compile(r"TASK \[admission : Set admission to held \(before the TP restart\)\].*\n(changed|ok): \[spark")


def _recap_changed(stdout: str) -> dict[str, int]:
    recap = stdout.split("PLAY RECAP")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", recap, re.M)}


def _report(path) -> dict:
    doc = json.loads(path.read_text())
    path.unlink()
    return doc


def _paused() -> bool:
    import httpx

    return httpx.get(API + "/is_paused", timeout=10, trust_env=False).json()["is_paused"]


def _env(path: str) -> str:
    return inside("sparkhead", "cat", path).stdout


def _pointer(host: str) -> str:
    """The host's promotion pointer (/opt/dsv41/packages/current: the production package id)."""
    return inside(host, "cat", "/opt/dsv41/packages/current").stdout.strip()


def _check_mode_shows_and_changes_nothing(component: str) -> None:
    before = _env(ENV_FILE[component])
    chk = play(PLAYBOOK, "-e", "rollback_confirmation=yes", "-e", f"component={component}", "--check", "--diff")
    assert chk.returncode == 0, chk.stdout[-6000:]
    assert f"+{ROLLED_BACK_LINE[component]}" in chk.stdout and f"-{PRODUCTION_LINE[component]}" in chk.stdout
    assert _env(ENV_FILE[component]) == before and not _paused()


def _rollback(component: str, report) -> dict:
    """Run the rollback; assert it took the HOLD, passed every check, left the files rolled back and
    admission open; return the checks by name (and print them: docs/records.md records them)."""
    t0 = time.monotonic()
    r = play(
        PLAYBOOK,
        "-e",
        "rollback_confirmation=yes",
        "-e",
        f"component={component}",
        "-e",
        f"rollback_component_report={report}",
        timeout=900,
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    assert HOLD.search(r.stdout), r.stdout[-6000:]
    rep = _report(report)
    checks = {c["name"]: c for c in rep["checks"]}
    assert rep["ok"] and all(c["ok"] for c in checks.values()), checks
    assert checks["greedy references"]["detail"] == "6/6 identical"
    assert rep["failed_requests"] == 0 and checks["failed requests"]["detail"].startswith("0 failed of ")
    after = _env(ENV_FILE[component])
    assert PRODUCTION_LINE[component] not in after and ROLLED_BACK_LINE[component] in after
    assert not _paused()
    print(
        f"\n{component}: rollback {took:.1f} s (checks {rep['seconds']} s): "
        + "; ".join(f"{c['name']}: {c['detail']}" for c in checks.values())
    )
    return checks


@pytest.mark.skipif(ALL, reason="make rollback-components runs the full chain instead")
def test_rollback_remote_engram_then_deploy_restores(deployed_lab, tmp_path):
    before = _env(ENV_FILE["remote_engram"])
    assert PRODUCTION_LINE["remote_engram"] in before
    pointer = {h: _pointer(h) for h in HOSTS}
    _check_mode_shows_and_changes_nothing("remote_engram")
    checks = _rollback("remote_engram", tmp_path / "report.json")
    assert re.fullmatch(r"table server requests \+0, rows \+0", checks["remote lookups still"]["detail"])

    t0 = time.monotonic()
    dep = play("deploy.yml", "--tags", "engram_overlay,spec_decode,serve,verify", timeout=1800)
    assert dep.returncode == 0, dep.stdout[-6000:]
    assert "greedy references: 6/6 identical" in dep.stdout
    assert _env(ENV_FILE["remote_engram"]) == before
    # the tagged deploy records what now runs (promotion_record.yml under --tags): production's
    # package again, so every pointer is back where it was before the rollback
    assert re.search(r"package [0-9a-f]{64}\s+\(already\s+recorded\)", dep.stdout), dep.stdout[-6000:]
    assert {h: _pointer(h) for h in HOSTS} == pointer
    print(f"deploy.yml --tags engram_overlay,spec_decode,serve,verify: {time.monotonic() - t0:.1f} s")


@pytest.mark.skipif(not ALL, reason="make rollback-components (DSV41_ROLLBACK_COMPONENTS=all)")
def test_rollback_every_component_then_plain_deploy_restores(deployed_lab, tmp_path):
    production = {c: _env(ENV_FILE[c]) for c in ENV_FILE}
    previous = None
    for component in ("async_handoff", "remote_drafter", "remote_engram"):
        _check_mode_shows_and_changes_nothing(component)
        _rollback(component, tmp_path / "report.json")
        if previous is not None and ENV_FILE[previous] != ENV_FILE[component]:
            # one component at a time: the one rolled back before is production again
            assert PRODUCTION_LINE[previous] in _env(ENV_FILE[previous])
        t0 = time.monotonic()
        again = play(
            PLAYBOOK,
            "-e",
            "rollback_confirmation=yes",
            "-e",
            f"component={component}",
            "-e",
            f"rollback_component_report={tmp_path / 'r.json'}",
            timeout=900,
        )
        assert again.returncode == 0, again.stdout[-6000:]
        assert set(_recap_changed(again.stdout).values()) == {0}, again.stdout.split("PLAY RECAP")[-1]
        assert not HOLD.search(again.stdout)  # nothing to restart, nothing held
        assert _report(tmp_path / "r.json")["ok"]
        print(f"{component}: second run {time.monotonic() - t0:.1f} s, changed=0")
        previous = component

    t0 = time.monotonic()
    dep = play("deploy.yml", timeout=1800)
    assert dep.returncode == 0, dep.stdout[-6000:]
    assert "greedy references: 6/6 identical" in dep.stdout
    assert {c: _env(ENV_FILE[c]) for c in ENV_FILE} == production
    print(f"plain deploy.yml: {time.monotonic() - t0:.1f} s, every env file as before the rollbacks")
