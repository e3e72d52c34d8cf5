"""One change operation at a time: the controller-side inter-process lock that window.yml,
promote.yml and rollback.yml hold for their whole run (``dsv41 oplock``).

The lock is ``fcntl.flock`` on ``STATE_DIR/change.lock`` (mode 0600); the kernel is the authority,
so a holder that dies, however it dies, frees it. Because an Ansible task is a short-lived
process, :func:`acquire` hands the locked file to a *keeper* process (its own session) that holds
it while the *owner*, the outermost ``ansible-playbook`` above the caller, lives; it then exits
and the lock is free. :func:`release` ends the keeper at the end of a run. Who holds it is kept
beside it (``change.lock.json``: operation, id, since, owner and keeper as pid + kernel start ticks
+ boot id, ``harness.procident``), so a refusal names the holder and since when; a record whose
lock is free is a dead holder's, and is taken over (the record says whose it was).

Errors are :class:`LockError` (one line): :class:`LockHeld` when another operation holds it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error
from dsv41.harness.procident import ProcessIdentity
from dsv41.names import check_name

LOCK_NAME = "change.lock"
RECORD_NAME = "change.lock.json"
#: The operations that take the lock.
OPERATIONS = ("window", "promote", "rollback", "deploy")
#: How often the keeper checks its owner (seconds).
KEEPER_POLL_S = 0.5
#: How long a refused acquire waits for a dead owner's keeper to notice (seconds).
STALE_GRACE_S = 3 * KEEPER_POLL_S


class LockError(Dsv41Error):
    """The change lock cannot be taken, read or released."""


class LockHeld(LockError):
    """Another change operation holds the lock (the message names it and since when)."""


def _open(state_dir: Path) -> int:
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise LockError(f"cannot open the change lock {state_dir / LOCK_NAME}: {exc.strerror or exc}") from None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def read_record(state_dir: str | os.PathLike) -> dict | None:
    """The holder record (a dict) or None when there is none or it cannot be read."""
    p = Path(state_dir) / RECORD_NAME
    try:
        doc = fileio.read_json(p, "change lock record", max_bytes=1 << 16, error=LockError)
    except (LockError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def describe(rec: dict | None) -> str:
    """One phrase naming a holder record: ``window 20261207-aa (pid 4242, ansible-playbook) since
    2026-12-07T05:00:00Z``."""
    if not rec:
        return "an unknown operation (no readable holder record)"
    owner = rec.get("owner") or {}
    return (
        f"{rec.get('op', '?')} {rec.get('id', '?')} (pid {owner.get('pid', '?')}, {rec.get('owner_cmd', '?')}) "
        f"since {rec.get('since', '?')}"
    )


def find_owner(start_pid: int | None = None) -> int:
    """The pid whose life the lock follows: the outermost ``ansible-playbook`` among the ancestors
    of ``start_pid`` (default: this process), else ``start_pid``'s parent."""
    import psutil

    proc = psutil.Process(start_pid or os.getpid())
    owner = None
    for anc in proc.parents():
        try:
            cmd = anc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(os.path.basename(c) == "ansible-playbook" for c in cmd[:2]):
            owner = anc.pid
    return owner if owner is not None else proc.ppid()


def _cmd_name(pid: int) -> str:
    import psutil

    try:
        cmd = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    names = [os.path.basename(c) for c in cmd[:2]]
    return "ansible-playbook" if "ansible-playbook" in names else (names[0] if names else "?")


def acquire(state_dir: str | os.PathLike, op: str, op_id: str, owner_pid: int | None = None) -> dict:
    """Take the change lock for operation ``op`` (:data:`OPERATIONS`) named ``op_id`` (a plain
    name) on behalf of ``owner_pid`` (default :func:`find_owner`); returns the holder record
    written (``taken_over``: the dead holder's record, when there was one), or the record in force
    when this owner already holds it for the same operation (idempotent).

    Raises LockHeld at once, naming the holder and since when, while another operation holds it
    (after up to :data:`STALE_GRACE_S` when that holder's owner is already dead), LockError for a
    bad op or id or when the lock cannot be opened or its keeper started."""
    if op not in OPERATIONS:
        raise LockError(f"operation must be one of {', '.join(OPERATIONS)}, got {op!r}")
    check_name(op_id, "operation id", LockError)
    sd = Path(state_dir)
    owner = ProcessIdentity.of(owner_pid if owner_pid is not None else find_owner())
    fd = _open(sd)
    try:
        deadline = time.monotonic() + STALE_GRACE_S
        while not _try_lock(fd):
            rec = read_record(sd)
            if (
                rec is not None
                and rec.get("owner") == owner.as_record()
                and rec.get("op") == op
                and rec.get("id") == op_id
            ):
                return rec  # this very run holds it already (a retried task)
            owner_dead = rec is not None and not _alive(rec.get("owner"))
            if not owner_dead or time.monotonic() > deadline:
                raise LockHeld(
                    f"refused: another change operation holds the lock {sd / LOCK_NAME}: {describe(rec)}; "
                    f"wait for it to end (dsv41 oplock status --state-dir {sd})"
                )
            time.sleep(0.1)
        previous = read_record(sd)
        keeper = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsv41.promotion.oplock",
                str(fd),
                str(owner.pid),
                str(owner.start_ticks),
                owner.boot_id,
            ],
            pass_fds=(fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        rec = {
            "op": op,
            "id": op_id,
            "since": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "owner": owner.as_record(),
            "owner_cmd": _cmd_name(owner.pid),
            "keeper": ProcessIdentity.of(keeper.pid).as_record(),
        }
        if previous:
            rec["taken_over"] = previous
        fileio.atomic_write_json(sd / RECORD_NAME, rec, "change lock record", error=LockError)
        return rec
    except OSError as exc:
        raise LockError(f"cannot take the change lock {sd / LOCK_NAME}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)  # the keeper holds its own descriptor of the locked file


def _alive(ident: object) -> bool:
    try:
        return ProcessIdentity.from_record(ident).alive()  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return False


def status(state_dir: str | os.PathLike) -> dict:
    """``{"held": bool, "holder": record or None}``; a record whose lock is free is reported as
    ``stale`` (its holder died). Never blocks. Raises LockError when the lock cannot be opened."""
    sd = Path(state_dir)
    fd = _open(sd)
    try:
        free = _try_lock(fd)
        rec = read_record(sd)
        return {"held": not free, "holder": rec if not free else None, "stale": rec if free and rec else None}
    finally:
        os.close(fd)


def release(state_dir: str | os.PathLike, owner_pid: int | None = None, timeout_s: float = 10.0) -> dict | None:
    """End this run's hold: the keeper named by the record is stopped (by identity, never a bare
    pid) when the record's owner is ``owner_pid`` (default :func:`find_owner`); returns the record
    released, None when the lock was not held. Raises LockHeld when another operation holds it,
    LockError when the keeper does not let go within ``timeout_s`` seconds."""
    sd = Path(state_dir)
    st = status(sd)
    if not st["held"]:
        return None
    rec = st["holder"] or {}
    me = ProcessIdentity.of(owner_pid if owner_pid is not None else find_owner()).as_record()
    if rec.get("owner") != me:
        raise LockHeld(f"refused: the change lock is held by {describe(rec)}, not by this run")
    try:
        keeper = ProcessIdentity.from_record(rec.get("keeper"))
    except (KeyError, TypeError, ValueError):
        raise LockError(f"the change lock record {sd / RECORD_NAME} names no keeper") from None
    if keeper.alive():
        os.kill(keeper.pid, signal.SIGTERM)
    fd = _open(sd)
    try:
        deadline = time.monotonic() + timeout_s
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                raise LockError(f"the change lock's keeper (pid {keeper.pid}) did not let go within {timeout_s:g} s")
            time.sleep(0.05)
        (sd / RECORD_NAME).unlink(missing_ok=True)
    finally:
        os.close(fd)
    return rec


def _keep(fd: int, owner: ProcessIdentity) -> None:
    """The keeper: hold ``fd`` (locked) while ``owner`` lives; SIGTERM ends it at once."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an operator's Ctrl-C reaches the playbook, not the lock
    while owner.alive():
        time.sleep(KEEPER_POLL_S)
    os._exit(0)


if __name__ == "__main__":  # the keeper process (acquire starts it)
    _keep(int(sys.argv[1]), ProcessIdentity(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
