"""The heavy kill matrix (``make promotion-kill``; not part of ``make test``, whose lab module
tests/integration/test_promotion_lab.py kills at two points): SIGKILL ansible-playbook at every
journal step of promote.yml and of playbooks/rollback.yml, then a plain re-run must converge to a
verified package (every host points at it, it verifies, every managed file equals its record) and
the journal must have nothing left to finish. About 3-4 minutes per point on the idle 2-core machine.
"""

from __future__ import annotations

import json

import pytest
from labutil import needs_lab, play
from test_promotion_lab import (CANDIDATE, JOURNAL, PACKAGES, assert_verified_production, dsv41, listing, production,
                                recap_changed, run_until_step)

pytestmark = [pytest.mark.lab, pytest.mark.slow, needs_lab]


def _journal_idle() -> None:
    d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
    assert d["action"] == "none", d


@pytest.mark.parametrize("step", ["begin", "held", "applied", "recorded", "verified", "pointer"])
def test_kill_promote_then_rerun(deployed_lab, step):
    p0 = assert_verified_production()
    run_until_step(["promote.yml", *CANDIDATE], step)
    r = play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    p1 = assert_verified_production()
    assert p1 != p0 and (PACKAGES / p1 / "package.json").is_file()
    _journal_idle()
    r = play("playbooks/rollback.yml", "-e", "to=" + p0)
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p0


def test_check_mode_and_idempotent_promote(deployed_lab):
    p0 = assert_verified_production()
    before = listing()
    r = play("promote.yml", *CANDIDATE, "--check", "--diff")
    assert r.returncode == 0, r.stdout[-5000:]
    assert production() == p0 and listing() == before
    r = play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    r = play("promote.yml", *CANDIDATE)
    assert r.returncode == 0 and set(recap_changed(r.stdout).values()) == {0}, recap_changed(r.stdout)
    r = play("playbooks/rollback.yml", "-e", "to=" + p0)
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p0 and listing() == before


@pytest.mark.parametrize("step", ["begin", "held", "verified"])
def test_kill_rollback_then_rerun(deployed_lab, step):
    p0 = assert_verified_production()
    r = play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    run_until_step(["playbooks/rollback.yml"], step)
    r = play("playbooks/rollback.yml")
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p0
    _journal_idle()
