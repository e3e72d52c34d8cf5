"""One change operation at a time (dsv41.promotion.oplock, `dsv41 oplock`): a second operation is
refused at once naming the holder and since when; the lock follows its owner's life (a dead
owner's lock is taken over, by identity, never a bare pid); only the holder releases it; and every
playbook run that changes production (enumerated from the playbooks: any that writes the journal)
takes it before its first journal entry or journal replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dsv41.promotion import oplock
from yamltree import with_imports

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _sleeper(seconds: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_second_operation_refused_naming_the_holder(tmp_path):
    owner = _sleeper()
    try:
        rec = oplock.acquire(tmp_path, "window", "w1", owner_pid=owner.pid)
        assert rec["owner"]["pid"] == owner.pid and rec["op"] == "window"
        t0 = time.monotonic()
        with pytest.raises(oplock.LockHeld) as err:
            oplock.acquire(tmp_path, "promote", "p1", owner_pid=os.getpid())
        assert time.monotonic() - t0 < 1.0  # at once
        msg = str(err.value)
        assert "window w1" in msg and f"pid {owner.pid}" in msg and rec["since"] in msg and "\n" not in msg
        assert oplock.acquire(tmp_path, "window", "w1", owner_pid=owner.pid)["since"] == rec["since"]  # idempotent
        with pytest.raises(oplock.LockHeld):
            oplock.release(tmp_path, owner_pid=os.getpid())  # not the holder
        assert oplock.status(tmp_path)["held"]
        assert oplock.release(tmp_path, owner_pid=owner.pid)["id"] == "w1"
        assert not oplock.status(tmp_path)["held"] and not (tmp_path / oplock.RECORD_NAME).exists()
    finally:
        owner.kill()
        owner.wait()


def test_a_dead_owners_lock_is_taken_over(tmp_path):
    owner = _sleeper()
    oplock.acquire(tmp_path, "rollback", "r1", owner_pid=owner.pid)
    keeper = oplock.read_record(tmp_path)["keeper"]["pid"]
    owner.kill()
    owner.wait()
    rec = oplock.acquire(tmp_path, "window", "w2", owner_pid=os.getpid())  # within STALE_GRACE_S
    assert rec["taken_over"]["id"] == "r1" and rec["id"] == "w2"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(keeper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the dead owner's keeper outlived it")
    oplock.release(tmp_path, owner_pid=os.getpid())


def test_a_killed_keeper_frees_the_lock(tmp_path):
    """SIGKILL of everything (the keeper included): the kernel drops the flock; the record left
    is reported stale and taken over."""
    import signal

    owner = _sleeper()
    try:
        oplock.acquire(tmp_path, "promote", "p2", owner_pid=owner.pid)
        os.kill(oplock.read_record(tmp_path)["keeper"]["pid"], signal.SIGKILL)
        time.sleep(0.3)
        st = oplock.status(tmp_path)
        assert not st["held"] and st["stale"]["id"] == "p2"
        assert oplock.acquire(tmp_path, "window", "w3", owner_pid=os.getpid())["taken_over"]["id"] == "p2"
        oplock.release(tmp_path, owner_pid=os.getpid())
    finally:
        owner.kill()
        owner.wait()


@pytest.mark.parametrize("bad", ["*", "../x", "a/b", "", "..", "a b"])
def test_ids_are_names_and_ops_are_known(tmp_path, bad):
    with pytest.raises(oplock.LockError):
        oplock.acquire(tmp_path, "window", bad, owner_pid=os.getpid())
    with pytest.raises(oplock.LockError):
        oplock.acquire(tmp_path, bad or "x", "ok", owner_pid=os.getpid())


def test_the_command_refuses_a_second_operation_in_one_line(tmp_path):
    owner = _sleeper()
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    try:
        a = subprocess.run(
            [
                str(BIN / "dsv41"),
                "oplock",
                "acquire",
                "--op",
                "window",
                "--id",
                "w9",
                "--state-dir",
                str(tmp_path),
                "--owner-pid",
                str(owner.pid),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert a.returncode == 0, a.stderr
        b = subprocess.run(
            [str(BIN / "dsv41"), "oplock", "acquire", "--op", "promote", "--id", "p9", "--state-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert b.returncode == 1 and len(b.stderr.strip().splitlines()) == 1 and "window w9" in b.stderr
        s = subprocess.run(
            [str(BIN / "dsv41"), "oplock", "status", "--state-dir", str(tmp_path), "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert json.loads(s.stdout)["holder"]["id"] == "w9"
    finally:
        owner.kill()
        owner.wait()


# ---- every change operation takes it --------------------------------------------------------------


def _tasks(tasks):
    """Every task, blocks opened (the plays come through yamltree.with_imports: imports expanded)."""
    for t in tasks or []:
        yield t
        for key in ("block", "rescue", "always"):
            yield from _tasks(t.get(key))


def _plays(path: Path, when: str | None = None):
    """(play, when) of a playbook in order, imports expanded (each import's `when` kept)."""
    doc = yaml.safe_load(path.read_text())
    for item in doc if isinstance(doc, list) else []:  # galaxy.yml and friends are not playbooks
        imp = item.get("ansible.builtin.import_playbook")
        if imp:
            yield from _plays((path.parent / imp).resolve(), item.get("when", when))
        else:
            yield with_imports(item), when


def _includes(play, tasks_from: str) -> list[dict]:
    out = []
    for key in ("pre_tasks", "tasks", "post_tasks"):
        for t in _tasks(play.get(key)):
            inc = t.get("ansible.builtin.include_role") or {}
            if inc.get("name") == "promotion" and inc.get("tasks_from") == tasks_from:
                out.append(t)
    return out


def _takes_lock(play) -> bool:
    return any(
        (t.get("vars") or {}).get("promotion_lock_state", "acquired") == "acquired" for t in _includes(play, "lock")
    )


def _writes_journal(play) -> bool:
    return bool(_includes(play, "journal")) or any(
        "promotion_journal" in t for key in ("tasks", "pre_tasks") for t in _tasks(play.get(key))
    )


def test_every_run_that_changes_production_takes_the_lock_first():
    """For each top-level playbook and each `when` branch of its imports: the first play that
    writes (or replays) the promotion journal comes after a play that takes the change lock."""
    checked = []
    for root in sorted(REPO.glob("*.yml")):
        plays = list(_plays(root))
        for branch in {w for _, w in plays}:
            seq = [p for p, w in plays if w in (None, branch)]
            first_journal = next((i for i, p in enumerate(seq) if _writes_journal(p)), None)
            if first_journal is None:
                continue
            first_lock = next((i for i, p in enumerate(seq) if _takes_lock(p)), None)
            assert first_lock is not None and first_lock <= first_journal, (
                f"{root.name} ({branch or 'always'}): journal written before the change lock is taken"
            )
            checked.append(root.name)
    assert {"window.yml", "promote.yml", "rollback.yml", "deploy.yml"} <= set(checked)
