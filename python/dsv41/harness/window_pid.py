"""The ``run.pid`` record of a window's ``dsv41 window run`` and the restore's ``stop_runs``.

A window.yml that is killed leaves its ``dsv41 window run`` (and, after a SIGKILL, the Ansible
worker that waited on it) running; the next window.yml's restore stops them by this record,
signalling only the processes it names by identity (pid, kernel start ticks, boot id:
``dsv41.harness.procident``). docs/windows.md describes the drills that exercise it.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsv41 import fileio
from dsv41.harness import orphans
from dsv41.harness.window import WindowError

#: Name of the file in ``windows/<id>/`` that names the ``dsv41 window run`` process measuring it.
RUN_PID_NAME = "run.pid"


def write_run_pid(wdir: str | os.PathLike) -> Path:
    """Record this process as the run of window directory ``wdir``: ``run.pid`` holds
    ``{"pid", "start_ticks", "boot_id", "create_time"}``: the kernel's start time in clock ticks
    after boot and this boot's id (``dsv41.harness.procident``), which no clock step moves, so
    that a later ``stop_runs`` signals this process and never another that reused the pid.
    ``create_time`` (psutil, seconds since the epoch) is informational and for older readers.
    ``session`` (only under Ansible, ``_worker_session``) names the Ansible worker that runs this
    command and that worker's parent, the ``ansible-playbook`` process, by the same identities.
    Returns the file's path; the run removes it when it ends (``clear_run_pid``)."""
    import psutil

    from dsv41.harness.procident import ProcessIdentity

    rec = ProcessIdentity.of().as_record()
    rec["create_time"] = psutil.Process().create_time()
    session = _worker_session()
    if session is not None:
        rec["session"] = session
    path = Path(wdir) / RUN_PID_NAME
    # atomic: a window.yml restore may read it at any moment (stop_runs); a torn record would
    # keep admission held for nothing
    fileio.atomic_write(path, fileio.dumps_json(rec) + "\n", "window run pid file", error=WindowError)
    return path


def _is_ansible_playbook(cmdline: list[str]) -> bool:
    """True when ``cmdline`` (``/proc/<pid>/cmdline`` as a list) runs ``ansible-playbook``: the
    script as argv[0] or, started by its interpreter (``python3 .../ansible-playbook``), argv[1]."""
    return any(os.path.basename(a) == "ansible-playbook" for a in cmdline[:2])


def _worker_session() -> dict | None:
    """``{"leader", "parent"}``: identity records (``ProcessIdentity.as_record``) of this process's
    session leader and of that leader's parent, when the leader is an Ansible worker process; else
    None.

    ansible-core's ``WorkerProcess`` calls ``setsid()`` (ansible/executor/process/worker.py,
    ``_detach``), so the worker that runs window.yml's ``dsv41 window run`` task leads a session
    of its own, outside ``ansible-playbook``'s process group. When ``ansible-playbook`` is
    SIGKILLed it cannot pass the signal on (it does for SIGINT and SIGTERM), and the worker
    survives: it waits on this run and then blocks for ever handing its result to the dead
    parent (seen on the lab, 2026-12-04: alive 30 min after the kill). ``stop_runs`` ends it by
    this record. Only a leader that is an ancestor of this process and runs ``ansible-playbook``
    (a worker is a fork of it) is recorded, with a parent other than init: a run started from an
    operator's shell records nothing."""
    import psutil

    from dsv41.harness.procident import ProcessGone, ProcessIdentity

    sid = os.getsid(0)
    if sid == os.getpid():
        return None
    try:
        me = psutil.Process()
        if sid not in {p.pid for p in me.parents()}:
            return None
        leader = psutil.Process(sid)
        if not _is_ansible_playbook(leader.cmdline()):
            return None
        ppid = leader.ppid()
        if ppid <= 1:
            return None
        return {"leader": ProcessIdentity.of(sid).as_record(), "parent": ProcessIdentity.of(ppid).as_record()}
    except (psutil.Error, ProcessGone, OSError):
        return None


def orphaned_worker(record: dict):
    """The live Ansible worker a ``run.pid`` record's ``session`` names, as a ``psutil.Process``,
    when its ``ansible-playbook`` has ended (the parent recorded at the run's start no longer
    lives: the worker was orphaned by a SIGKILL); None when the record has no session, the worker
    has ended (its pid reused or not) or its playbook still runs (never signalled then). Raises
    KeyError/TypeError/ValueError on a malformed ``session``."""
    from dsv41.harness.procident import ProcessIdentity

    session = record.get("session")
    if session is None:
        return None
    if not isinstance(session, dict):
        raise TypeError(f"session is a JSON {type(session).__name__}, not an object")
    leader = ProcessIdentity.from_record(session["leader"])
    parent = ProcessIdentity.from_record(session["parent"])
    return orphans.orphan(leader, parent)


#: Seconds an orphaned Ansible worker gets after SIGTERM before SIGKILL (``harness.orphans``).
WORKER_TERM_TIMEOUT_S = orphans.WORKER_TERM_TIMEOUT_S


#: A run.pid record is one short JSON object; anything longer is not one.
RUN_PID_MAX_BYTES = 4096


def read_run_pid(path: str | os.PathLike) -> dict | None:
    """The record of a ``run.pid`` file (``write_run_pid``), read by the strict reader
    (:func:`dsv41.fileio.read_json`: a regular file not changing while read, UTF-8, strict JSON,
    at most ``RUN_PID_MAX_BYTES``); None when there is no such file (the run ended and removed
    it). Raises ``WindowError`` (one line, ``<path>: not a run pid file (<why>)``) for an empty,
    torn, undecodable or non-object file; its fields are checked by ``run_process``."""
    return orphans.read_record(path, "run pid file", WindowError, RUN_PID_MAX_BYTES)


def clear_run_pid(wdir: str | os.PathLike) -> None:
    """Remove ``wdir``'s ``run.pid`` if it names this process (a run that ends normally), unless
    the Ansible worker it names is orphaned (``orphaned_worker``: window.yml was SIGKILLed while
    this run went on): then the record stays, so that the next window.yml's ``stop_runs`` ends
    that worker (this run is gone by then and is not signalled)."""
    path = Path(wdir) / RUN_PID_NAME
    try:
        rec = read_run_pid(path) or {}
        if rec.get("pid") == os.getpid() and orphaned_worker(rec) is None:
            path.unlink()
    except (OSError, WindowError, KeyError, TypeError, ValueError):
        pass


#: Tolerance of the legacy rule (records with only ``create_time``, written before start ticks).
LEGACY_CREATE_TIME_TOLERANCE_S = 0.01


def run_process(record: dict):
    """The live process a ``run.pid`` record names, as a ``psutil.Process``; None when it has
    ended (or is a zombie) or the pid now names another process.

    A record with ``start_ticks`` and ``boot_id`` (``write_run_pid``) matches by the kernel's
    start time, independent of the wall clock. A legacy record (``{"pid", "create_time"}`` only,
    written by an older ``dsv41 window run``) matches by psutil's creation time within
    ``LEGACY_CREATE_TIME_TOLERANCE_S``: it cannot be re-anchored without the clock it was read by,
    and a wider tolerance would accept a reused pid. Signals sent through the returned process
    are guarded again by psutil, whose identity on Linux is its monotonic (tick) start time.
    Raises KeyError/TypeError/ValueError on a malformed record."""
    import psutil

    from dsv41.harness.procident import ProcessIdentity

    if "start_ticks" in record or "boot_id" in record:
        ident = ProcessIdentity.from_record(record)
        try:
            proc = psutil.Process(ident.pid)
        except psutil.NoSuchProcess:
            return None
        # Checked after psutil captured the process: a pid reused in between fails the check.
        return proc if ident.alive() else None
    pid, created = int(record["pid"]), float(record["create_time"])
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < LEGACY_CREATE_TIME_TOLERANCE_S and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.NoSuchProcess:
        pass
    return None


class StoppedRuns(list):
    """The pids ``stop_runs`` stopped: the list holds the runs' pids; ``workers`` (list of int)
    the orphaned Ansible workers (``orphaned_worker``) stopped after them."""

    def __init__(self, runs=(), workers=()):
        super().__init__(runs)
        self.workers = list(workers)


def stop_runs(windows_dir: str | os.PathLike, window_id: str, timeout_s: float = 30.0) -> StoppedRuns:
    """Stop every ``dsv41 window run`` of window ``window_id`` that is still running.

    window.yml runs one ``dsv41 window run`` per candidate (``windows/<window_id>-<candidate>/``).
    When ``ansible-playbook`` is killed, that run is not in its process group and keeps going: it
    would switch arms (re-templating production's files) and send requests while the next
    window.yml restores. The restore therefore stops it first: SIGTERM (the run stops its cells,
    writes an INVALID decision and exits), SIGKILL after ``timeout_s`` seconds, then SIGKILL to any
    of its descendants still alive (a switch or fault playbook it had started). Only the process
    that ``run.pid`` names (``run_process``: pid + kernel start ticks + boot id) is signalled.
    Then the killed playbook's Ansible worker that ran the run's task, if it is still alive and
    orphaned (``orphaned_worker``: named by the record's ``session``, its ``ansible-playbook``
    gone), gets SIGTERM, SIGKILL after ``WORKER_TERM_TIMEOUT_S``: it would otherwise stay for ever.

    Returns a ``StoppedRuns`` (the runs' pids; ``.workers`` the workers' pids; empty when nothing
    was running). Raises ``WindowError`` when a ``run.pid`` cannot be read (the caller keeps
    admission held)."""
    import psutil

    from dsv41.names import check_name

    check_name(window_id, "window id", WindowError)  # a glob or a path would reach other windows' runs
    stopped = StoppedRuns()
    prefix = f"{window_id}-"
    for path in sorted(p for p in Path(windows_dir).glob(f"*/{RUN_PID_NAME}") if p.parent.name.startswith(prefix)):
        rec = read_run_pid(path)
        if rec is None:
            continue  # it ended (and removed its record) since the glob
        try:
            proc = run_process(rec)
            orphaned_worker(rec)  # a malformed session fails here, before anything is signalled
        except (ValueError, KeyError, TypeError) as exc:
            raise WindowError(f"{path}: not a run pid file ({exc})") from None
        if proc is not None:
            try:
                kids = proc.children(recursive=True)
                proc.terminate()
                if psutil.wait_procs([proc], timeout=timeout_s)[1]:
                    kids += proc.children(recursive=True)
                    proc.kill()
                    psutil.wait_procs([proc], timeout=10)
            except psutil.NoSuchProcess:
                pass
            for kid in kids:
                try:
                    kid.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(kids, timeout=10)
            stopped.append(proc.pid)
        # after the run: the worker waited on it, and a worker of a live playbook is never touched
        worker = orphaned_worker(rec)
        if worker is not None:
            orphans.end_processes([worker], WORKER_TERM_TIMEOUT_S)
            stopped.workers.append(worker.pid)
        path.unlink(missing_ok=True)
    return stopped
