"""The kill matrix (``make promotion-kill``; not part of ``make test``): SIGKILL ansible-playbook at
each journal step of promote.yml and of playbooks/rollback.yml, then a plain re-run must converge
to a verified package (every host points at it, it verifies, every managed file's sha256 equals
its record) with nothing left in the journal to finish, and admission open.

One test per pair of kill points: a promote killed at ``promote_step`` and re-run (production p1),
then a rollback killed at ``rollback_step`` (or a plain rollback) and re-run (production p0 again,
sha256 listing identical to before). About 6-10 minutes per pair on the shared 2-core machine, so
``-k`` picks pairs to fit a lab hold (docs/records.md records which ran).

The window's steps (``-k window_killed``): window.yml (candidate slow-rows, whose arm switch
re-applies roles) SIGKILLed after its snapshot (journal ``begin``), after the HOLD (``held``), in an
arm switch (playbooks/window_switch.yml running) and in its restore (``applied``); the next run of
window.yml, promote.yml or rollback.yml replays the window first (production restored to the
window's package, which is production's own) and ends with production exact and admission open."""

from __future__ import annotations

import json

import pytest

from labutil import needs_lab
from promotionutil import (
    API,
    CANDIDATE,
    JOURNAL,
    ROOT,
    alive,
    assert_none_outlived,
    assert_verified_production,
    dsv41,
    listing,
    production,
    recap_changed,
    run_until_step,
    timed_play,
)

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab]

# every step a promote journals before `done`, and every step a rollback does
PAIRS = [
    ("verified", "verified"),
    ("held", "held"),
    ("begin", "begin"),
    ("applied", None),
    ("recorded", None),
    ("pointer", None),
]


def _converged(expect: str | None = None) -> str:
    """Production verified, the journal idle, admission open; returns the package id."""
    import httpx

    pid = assert_verified_production()
    d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
    assert d["action"] == "none", d
    assert httpx.get(API + "/is_paused", timeout=10, trust_env=False).json()["is_paused"] is False
    if expect is not None:
        assert pid == expect
    return pid


@pytest.mark.parametrize(
    "promote_step,rollback_step", PAIRS, ids=[f"promote_{a}-rollback_{b or 'none'}" for a, b in PAIRS]
)
def test_kill_then_rerun_converges(deployed_lab, promote_step, rollback_step):
    p0 = _converged()
    before = listing()
    e, left = run_until_step(["promote.yml", *CANDIDATE], promote_step)
    d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
    print(
        f"\n[promotion] journal after the kill: {d['kind']} stopped after {d['last_step']}: "
        f"re-run will {d['action']} to {d['package']}",
        flush=True,
    )
    assert d["op"] == e["op"] and d["action"] in ("finish", "revert")
    at_start = alive(left)
    r = timed_play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    assert_none_outlived(left, r, "promote.yml", at_start)
    p1 = _converged()
    assert p1 != p0
    if rollback_step is not None:
        e, left = run_until_step(["playbooks/rollback.yml", "-e", "rollback_confirmation=yes"], rollback_step)
        d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
        print(
            f"\n[promotion] journal after the kill: {d['kind']} stopped after {d['last_step']}: "
            f"re-run will {d['action']} to {d['package']}",
            flush=True,
        )
        assert d["action"] == "finish" and d["package"] == p0, d
    else:
        left = []
    at_start = alive(left)
    r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes")
    assert r.returncode == 0, r.stdout[-5000:]
    assert_none_outlived(left, r, "rollback.yml", at_start)
    _converged(p0)
    assert listing() == before


def test_check_mode_and_idempotent_promote(deployed_lab):
    p0 = _converged()
    before = listing()
    r = timed_play("promote.yml", *CANDIDATE, "--check", "--diff")
    assert r.returncode == 0, r.stdout[-5000:]
    assert production() == p0 and listing() == before
    r = timed_play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    r = timed_play("promote.yml", *CANDIDATE)
    assert r.returncode == 0 and set(recap_changed(r.stdout).values()) == {0}, recap_changed(r.stdout)
    r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes", "-e", "to=" + p0)
    assert r.returncode == 0, r.stdout[-5000:]
    _converged(p0)
    assert listing() == before


DRILL = ROOT / "candidates" / "specs" / "drill.json"
WINDOW = ["window.yml", "-e", "candidate=slow-rows", "-e", f"window_spec={DRILL}", "-e", "windows_dir={wdir}"]
ROLLBACK_TO = ["playbooks/rollback.yml", "-e", "rollback_confirmation=yes", "-e", "to={p0}"]
# kill point -> the next run (window.yml replays on its own; promote.yml and rollback.yml replay
# first, finding the killed window's run.pid through the windows_dir its journal `begin` names)
WINDOW_KILLS = [
    ("begin", ["window.yml", "-e", "restore_only=true", "-e", "windows_dir={wdir}"]),
    ("held", ROLLBACK_TO),
    ("switch", ["promote.yml", *CANDIDATE]),
    ("applied", ["window.yml", "-e", "candidate=aa", "-e", f"window_spec={DRILL}", "-e", "windows_dir={wdir}"]),
]


@pytest.mark.parametrize(
    "kill_step,next_run", WINDOW_KILLS, ids=[f"window_killed_{k}-then_{n[0].split('/')[-1]}" for k, n in WINDOW_KILLS]
)
def test_window_killed_then_next_run_restores(deployed_lab, tmp_path, kill_step, next_run):
    p0 = _converged()
    before = listing()
    fill = {"p0": p0, "wdir": tmp_path / "windows"}  # a fresh windows dir: the two-window cap is per dir
    # window.yml's run and its worker: run.pid and stop-run (harness/window_pid.py), not asserted here
    e, _ = run_until_step([a.format(**fill) for a in WINDOW], kill_step, timeout=900)
    d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
    print(
        f"\n[promotion] journal after the kill: {d['kind']} stopped after {d['last_step']}: "
        f"re-run will {d['action']} to {d['package']}",
        flush=True,
    )
    # the window's package is production's own (undrifted): every kill point restores to it
    assert d["op"] == e["op"] and d["kind"] == "window" and (d["action"], d["package"]) == ("finish", p0), d
    assert d["windows_dir"] == str(fill["wdir"])
    r = timed_play(*[a.format(**fill) for a in next_run], timeout=900)
    assert r.returncode == 0, r.stdout[-5000:]
    assert f"window {e['op']} stopped after" in " ".join(r.stdout.split()), r.stdout[-5000:]  # replayed first
    if next_run[0] == "promote.yml":
        assert _converged() != p0
        r = timed_play(*[a.format(**fill) for a in ROLLBACK_TO], timeout=900)
        assert r.returncode == 0, r.stdout[-5000:]
    _converged(p0)
    assert listing() == before
