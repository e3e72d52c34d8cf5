"""Promotion packages on the lab: promote (forced), verify, roll back exactly (sha256 listing before ==
after), promote again (same id), bad input refused before anything changes, and a SIGKILL of
ansible-playbook at journal points followed by a re-run that converges to a verified package.

Uses the shared ``deployed_lab`` (deploy.yml recorded the initial package). Leaves the lab on the
initial package (production). Heavier kill matrices: tests/perf/test_promotion_kill.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from labutil import ROOT, inside, needs_lab
from promotionutil import (
    API,
    CANDIDATE,
    JOURNAL,
    PACKAGES,
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

# About 9.5 min after the deploy on the 2-core CI box: over make test's budget, so `make lab-long`.
pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.lab_long, needs_lab]


def test_promote_verify_rollback_exact_promote_again(deployed_lab):
    p0 = assert_verified_production()
    before = listing()
    history0 = inside("sparkhead", "cat", "/opt/dsv41/packages/history").stdout
    # deploy.yml's record step again: same id, nothing changed
    r = timed_play("playbooks/promotion_record.yml")
    assert r.returncode == 0 and set(recap_changed(r.stdout).values()) == {0}, r.stdout[-3000:]
    assert production() == p0

    # bad input: one clear error, nothing changed
    r = timed_play("promote.yml", "-e", "candidate=sync-drafter")
    assert r.returncode != 0 and "promotion needs window=ID" in r.stdout
    wdir = ROOT / "windows" / "promotion-test-nochange"
    wdir.mkdir(parents=True, exist_ok=True)
    (wdir / "decision.json").write_text(json.dumps({"verdict": "NO-CHANGE"}))
    try:
        r = timed_play("promote.yml", "-e", "candidate=sync-drafter", "-e", "window=promotion-test-nochange")
        assert r.returncode != 0 and "decided 'NO-CHANGE', not WIN" in r.stdout
    finally:
        (wdir / "decision.json").unlink()
        wdir.rmdir()
    r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes", "-e", "to=" + "f" * 64)
    assert r.returncode != 0 and "unknown package" in r.stdout
    assert production() == p0 and listing() == before

    # promote (forced), verified
    r = timed_play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    p1 = assert_verified_production()
    assert p1 != p0
    d = json.loads(dsv41("package", "diff", p0, p1, "--root", str(PACKAGES), "--json").stdout)
    assert set(d["hosts"]) <= {"sparkhead", "sparkworker"} and d["hosts"], d
    assert d["provenance"]["reason"] == [None, "lab-promotion-test"]
    assert "promote sync-drafter" in inside("sparkhead", "cat", "/opt/dsv41/packages/history").stdout

    # a tampered package is refused before anything changes
    blob = next((PACKAGES / p0 / "files" / "sparkhead").rglob("*.env"))
    good = blob.read_bytes()
    blob.write_bytes(good + b"# tampered\n")
    try:
        r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes")
        assert r.returncode != 0 and "tampered" in r.stdout
        assert production() == p1
    finally:
        blob.write_bytes(good)

    # exact rollback: sha256 listing identical to before the promotion
    r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes")
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p0
    assert listing() == before
    assert "MISMATCH" not in r.stdout
    # idempotent: a second rollback changes nothing
    r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes")
    assert r.returncode == 0, r.stdout[-5000:]
    assert production() == p0 and set(recap_changed(r.stdout).values()) == {0}, recap_changed(r.stdout)

    # promote again: the same production gets the same id
    r = timed_play("promote.yml", *CANDIDATE)
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p1

    # leave the lab as deploy.yml made it
    r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes", "-e", "to=" + p0[:12])
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p0 and listing() == before
    assert inside("sparkhead", "cat", "/opt/dsv41/packages/history").stdout.startswith(history0)


def window_win(wdir: Path, candidate: str) -> tuple[str, dict]:
    """``(window id, decision)`` of the window in ``wdir`` that measured ``candidate``."""
    (p,) = wdir.glob(f"*-{candidate}/decision.json")
    return p.parent.name, json.loads(p.read_text())["decision"]


def test_promote_a_window_win_rollback_exact_promote_again(deployed_lab, tmp_path):
    """Promotion from a real WIN (issue 12): production made synchronous by ``rollback.yml -e
    component=async_handoff`` (recorded as a package); a window of ``async-drafter`` against
    ``sync-drafter`` (production's own state, step_ms p50, candidates/specs/lab-window.json); if it
    decided WIN, ``promote.yml -e window=ID`` (no force), verify, ``rollback.yml`` exactly (sha256
    listing identical to before the promotion), promote again (same id). Leaves the lab on the
    deploy's package. ``DSV41_PROMOTE_WINDOWS_DIR`` names a windows directory that already holds
    such a window (e.g. ``make window-drills``' async window), which is then used instead of
    running one here (about 14 min on the 2-core box); without it the window is run into a fresh
    directory, so a window left by an earlier run is never taken for this run's measurement."""
    p0 = production()
    r = timed_play("rollback.yml", "-e", "rollback_confirmation=yes", "-e", "component=async_handoff")
    assert r.returncode == 0, r.stdout[-5000:]
    p_sync = assert_verified_production()
    assert p_sync != p0
    assert "DSV41_DRAFTER_ASYNC=0" in inside("sparkhead", "cat", "/etc/dsv41/drafter.env").stdout
    before = listing()

    wdir = Path(os.environ.get("DSV41_PROMOTE_WINDOWS_DIR") or tmp_path / "windows")
    if not list(wdir.glob("*-async-drafter/decision.json")):
        # 8 restarting blocks: 6-14 min on the 2-core boxes (10 min on the Intel one, 2026-12-01,
        # where play()'s 600 s default killed ansible-playbook after the 32nd cell and left its
        # setsid worker running the window)
        r = timed_play(
            "window.yml",
            "-e",
            "candidate=async-drafter",
            "-e",
            "control=sync-drafter",
            "-e",
            f"window_spec={ROOT / 'candidates' / 'specs' / 'lab-window.json'}",
            "-e",
            f"windows_dir={wdir}",
            timeout=1800,
        )
        assert r.returncode == 0, r.stdout[-5000:]
        assert production() == p_sync and listing() == before  # the window restored production exactly
    wid, d = window_win(wdir, "async-drafter")
    print(
        f"\n[promotion] window {wid}: {d['verdict']} effect {d['effect']:+.4f} CI {d['ci']} "
        f"({d['n_pairs']} pairs, {d['metric']})",
        flush=True,
    )
    assert d["verdict"] == "WIN", f"the window decided {d['verdict']}: nothing to promote"

    r = timed_play(
        "promote.yml", "-e", "candidate=async-drafter", "-e", f"window={wid}", "-e", f"promotion_windows_dir={wdir}"
    )
    assert r.returncode == 0, r.stdout[-5000:]
    p1 = assert_verified_production()
    assert p1 != p_sync
    assert "DSV41_DRAFTER_ASYNC=1" in inside("sparkhead", "cat", "/etc/dsv41/drafter.env").stdout
    prov = json.loads((PACKAGES / p1 / "package.json").read_text())["provenance"]
    assert (prov["op"], prov["candidate"], prov["window"], prov["verdict"], prov["parent"]) == (
        "promote",
        "async-drafter",
        wid,
        "WIN",
        p_sync,
    ), prov
    assert not prov.get("force")

    r = timed_play("rollback.yml", "-e", "rollback_confirmation=yes")
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p_sync
    assert listing() == before  # byte-identical to before the promotion
    print("[promotion] rollback: sha256 listing identical to before the promotion", flush=True)

    r = timed_play(
        "promote.yml", "-e", "candidate=async-drafter", "-e", f"window={wid}", "-e", f"promotion_windows_dir={wdir}"
    )
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p1

    r = timed_play("rollback.yml", "-e", "rollback_confirmation=yes", "-e", "to=" + p0[:12])
    assert r.returncode == 0, r.stdout[-5000:]
    assert assert_verified_production() == p0


def test_sigkill_then_rerun_converges(deployed_lab):
    """SIGKILL ansible-playbook in a promote and in a rollback; each re-run converges to a verified
    package, and no process of the killed playbook outlives the re-run (its Ansible workers, which
    escape the kill of its process group, are ended first by identity: plugins/callback/dsv41_workers.py).
    The re-runs also show admission held from their HOLD, across rank 0's restart, until their
    checks passed (an outside client probes all along)."""
    p0 = assert_verified_production()
    before = listing()
    # killed after the candidate was applied to x86host and while the Sparks change: a re-run
    # reverts to p0 (nothing verified yet), then promotes
    _, left = run_until_step(["promote.yml", *CANDIDATE], "applied")
    d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
    assert d["action"] == "revert" and d["package"] == p0, d
    n0 = len(JOURNAL.read_text().splitlines())
    with AdmissionProbe() as probe:
        at_start = alive(left)
        r = timed_play("promote.yml", *CANDIDATE)
        time.sleep(2)
    assert r.returncode == 0, r.stdout[-5000:]
    assert "reverting to" in r.stdout
    assert_none_outlived(left, r, "promote.yml", at_start)
    p1 = assert_verified_production()
    assert p1 != p0
    assert_held_throughout(probe, op_steps(n0), "pointer", "promote re-run")
    # killed after the HOLD of a rollback: the re-run finishes the rollback (as the recovery of
    # the killed operation, under the re-run's HOLD)
    e, left = run_until_step(["playbooks/rollback.yml", "-e", "rollback_confirmation=yes"], "held")
    d = json.loads(dsv41("package", "journal", "--path", str(JOURNAL), "--json").stdout)
    assert d["action"] == "finish" and d["package"] == p0, d
    n0 = len(JOURNAL.read_text().splitlines())
    with AdmissionProbe() as probe:
        at_start = alive(left)
        r = timed_play("playbooks/rollback.yml", "-e", "rollback_confirmation=yes")
        time.sleep(2)
    assert r.returncode == 0, r.stdout[-5000:]
    assert_none_outlived(left, r, "rollback.yml", at_start)
    assert assert_verified_production() == p0 and listing() == before
    assert_held_throughout(probe, op_steps(n0, e["op"]), "recovered", "rollback re-run (recovery)")


class AdmissionProbe:
    """A client that is not part of the operation: from a thread, one greedy 1-token completion
    to rank 0 every ``period_s`` seconds, without the operation's token. ``samples``: list of
    ``(sent, answered, outcome)``, Unix seconds and the HTTP status (int) or ``"down"`` (no
    connection: the engine is restarting)."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30, trust_env=False) as c:
            while not self._stop.is_set():
                t0 = time.time()
                try:
                    out = c.post(
                        API + "/v1/completions", json={"prompt": "probe", "max_tokens": 1, "temperature": 0}
                    ).status_code
                except httpx.HTTPError:
                    out = "down"
                self.samples.append((t0, time.time(), out))
                self._stop.wait(self.period_s)

    def __enter__(self) -> AdmissionProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def between(self, t0: float, t1: float) -> list:
        """The samples sent after ``t0`` and answered before ``t1``."""
        return [s for s in self.samples if s[0] > t0 and s[1] < t1]


def op_steps(n0: int, op: str | None = None) -> dict[str, float]:
    """``{step: ts}`` (first occurrence of each step) of operation ``op`` among the journal lines
    after line ``n0``; ``op`` None: the first operation that began there."""
    entries = [json.loads(x) for x in JOURNAL.read_text().splitlines()[n0:] if x.strip()]
    op = op or next(e["op"] for e in entries if e["step"] == "begin")
    out: dict[str, float] = {}
    for e in entries:
        if e["op"] == op:
            out.setdefault(e["step"], e["ts"])
    return out


def assert_held_throughout(probe: AdmissionProbe, steps: dict[str, float], reopen_after: str, what: str) -> None:
    """No outside request was admitted from the HOLD (journal ``held``) until the checks passed
    (journal ``reopen_after``), although rank 0 restarted in between; admitted again after ``done``."""
    during = probe.between(steps["held"], steps[reopen_after])
    outcomes = [o for _, _, o in during]
    admitted = [s for s in during if s[2] == 200]
    down = [s for s in during if s[2] == "down"]
    assert during and not admitted, f"{what}: {len(admitted)} outside requests admitted during the HOLD: {admitted[:3]}"
    assert down, f"{what}: rank 0 did not restart during the HOLD ({sorted(set(outcomes))})"
    after_restart = [o for t0, _, o in during if t0 > down[-1][1]]
    assert after_restart and set(after_restart) == {503}, f"{what}: after the restart {after_restart[:10]}"
    after = [o for t0, _, o in probe.samples if t0 > steps["done"]]
    print(
        f"\n[promotion] {what}: {len(during)} outside requests during the HOLD "
        f"({outcomes.count(503)} x 503, {len(down)} refused while rank 0 restarted, 0 admitted; "
        f"{len(after_restart)} x 503 from the restarted rank 0 until the checks passed); "
        f"after the reopen: {after}",
        flush=True,
    )
    assert after and set(after) == {200}, f"{what}: not admitted after the reopen: {after}"


def test_admission_stays_held_through_restart_and_checks(deployed_lab):
    """promote.yml and rollback.yml keep outside requests out from the HOLD until every check
    passed, across the engine restart (the lab engine starts held: DSV41_ADMISSION_HOLD_FILE), and
    admit them again afterwards."""
    p0 = assert_verified_production()
    for args, reopen_after, what in (
        (["promote.yml", *CANDIDATE], "pointer", "promote"),
        (["playbooks/rollback.yml", "-e", "rollback_confirmation=yes", "-e", "to=" + p0], "verified", "rollback"),
    ):
        n0 = len(JOURNAL.read_text().splitlines()) if JOURNAL.exists() else 0
        with AdmissionProbe() as probe:
            r = timed_play(*args)
            time.sleep(2)  # a few samples after the reopen
        assert r.returncode == 0, r.stdout[-5000:]
        assert_held_throughout(probe, op_steps(n0), reopen_after, what)
    assert assert_verified_production() == p0
