"""The Ansible workers of a promote.yml / rollback.yml run, named by identity, and the next run's
ender of those a SIGKILL orphaned (docs/promotion.md, "A SIGKILLed run's Ansible workers").

ansible-core's ``WorkerProcess`` calls ``setsid()`` (ansible/executor/process/worker.py,
``_detach``), so when ``ansible-playbook promote.yml`` (or ``rollback.yml``) is SIGKILLed, its
process group goes but the worker running each in-flight task does not: it finishes the task (a
restart, a file written on a host) while the next run converges the same hosts, then hands its
result to the dead parent (window.yml's, waiting on a long command, was alive 30 min after). Seen
on the lab (tests/integration, 2026-12): 2 workers outlived a promote.yml killed at its
``applied`` step, 1 a rollback.yml killed at ``held``; those ended 1-2 s after the kill.

The record, per ``ansible-playbook`` run, is a directory ``<root>/<pid>-<start ticks>/`` holding
``playbook.json`` (``{"playbook": identity, "name": "promote.yml"}``) and one
``worker-<pid>.json`` (an identity) per process forked from it. An identity is pid + kernel start
ticks + boot id (``dsv41.harness.procident``), so a reused pid never matches. Each worker writes
its own record in the child right after the fork (``os.register_at_fork``), before it calls
``setsid()``: a SIGKILL of the playbook's process group either kills it (still in the group) or
finds it recorded. The callback plugin ``dsv41_workers`` (plugins/callback) drives this module in
``ansible-playbook``: :func:`end_leftovers` first, then :func:`start`; :func:`Recorder.prune` at
each task, :func:`stop` at the end. Nothing is ever looked up or signalled by name.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error
from dsv41.harness import orphans
from dsv41.harness.procident import ProcessGone, ProcessIdentity, start_ticks

#: The record of the ``ansible-playbook`` process itself, in its run directory.
PLAYBOOK_NAME = "playbook.json"
#: Prefix of each worker's record (``worker-<pid>.json``).
WORKER_PREFIX = "worker-"
#: A record is one short JSON object; anything longer is not one.
RECORD_MAX_BYTES = 4096


class WorkersError(Dsv41Error):
    """A worker record cannot be read or written (one line: the path and why)."""


def run_dir(root: str | os.PathLike, playbook: ProcessIdentity) -> Path:
    """The record directory of the ``ansible-playbook`` process ``playbook`` under ``root``."""
    return Path(root) / f"{playbook.pid}-{playbook.start_ticks}"


def _write(path: Path, doc: dict) -> None:
    """``doc`` as one JSON line in ``path``, atomically (a reader never sees a torn record)."""
    fileio.atomic_write(path, fileio.dumps_json(doc) + "\n", "worker record", error=WorkersError)


class Recorder:
    """The record of this process (``ansible-playbook``) and of every process forked from it.

    ``root``: the directory holding every run's record (created, mode 0700); ``name``: the
    playbook's file name, for the report. Raises ``WorkersError`` when the record cannot be
    written, ``ProcessGone`` never (this process lives)."""

    def __init__(self, root: str | os.PathLike, name: str):
        self.me = ProcessIdentity.of()
        self.name = name
        self.dir = run_dir(root, self.me)
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise WorkersError(f"{self.dir}: cannot record the playbook's workers ({exc.strerror or exc})") from None
        _write(self.dir / PLAYBOOK_NAME, {"playbook": self.me.as_record(), "name": name})

    def record_child(self) -> None:
        """In a child just forked from the recorded process: write its identity (its start ticks
        and this boot's id). A process forked by anything else (a worker's own children) is not
        recorded. Raises ``WorkersError`` / ``ProcessGone`` (the fork hook swallows them)."""
        if os.getppid() != self.me.pid:
            return
        pid = os.getpid()
        ident = ProcessIdentity(pid, start_ticks(pid), self.me.boot_id)
        _write(self.dir / f"{WORKER_PREFIX}{pid}.json", ident.as_record())

    def prune(self) -> int:
        """Remove the records of workers that have ended (their task is done: nothing to end);
        returns how many. A record that cannot be read is left for :func:`end_leftovers`."""
        n = 0
        for path in self.dir.glob(f"{WORKER_PREFIX}*.json"):
            try:
                ident = _identity(path)[0]
            except WorkersError:
                continue
            if ident is not None and not ident.alive():
                path.unlink(missing_ok=True)
                n += 1
        return n

    def close(self) -> None:
        """The playbook ended by itself: its record goes (its workers have all returned)."""
        shutil.rmtree(self.dir, ignore_errors=True)


_ACTIVE: Recorder | None = None
_HOOKED = False


def _after_fork_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: the new worker records itself; the recorder is
    then dropped in the child, so that the worker's own forks are not recorded. Never raises (an
    exception here would be printed by the interpreter and the worker would go on unrecorded)."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    if rec is None:
        return
    try:
        rec.record_child()
    except (WorkersError, ProcessGone, OSError, ValueError):
        pass


def start(root: str | os.PathLike, name: str) -> Recorder:
    """Record this process (``ansible-playbook`` running playbook ``name``) under ``root`` and,
    from now on, every process forked from it. Returns the recorder; raises ``WorkersError``."""
    global _ACTIVE, _HOOKED
    _ACTIVE = Recorder(root, name)
    if not _HOOKED:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _HOOKED = True
    return _ACTIVE


def stop() -> None:
    """The recorded playbook ended by itself: stop recording and remove its record."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    if rec is not None:
        rec.close()


def _identity(path: Path, key: str | None = None) -> tuple[ProcessIdentity | None, dict]:
    """The identity in record ``path`` (under ``key`` when given) and the whole record; ``(None,
    {})`` when the file is gone. Raises ``WorkersError`` (one line) for a file that is not a record."""
    rec = orphans.read_record(path, "worker record", WorkersError, RECORD_MAX_BYTES)
    if rec is None:
        return None, {}
    try:
        return ProcessIdentity.from_record(rec[key] if key else rec), rec
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkersError(f"{path}: not a worker record ({type(exc).__name__}: {exc})") from None


@dataclass
class Ended:
    """What :func:`end_leftovers` ended of one SIGKILLed ``ansible-playbook``: ``playbook`` (its
    pid), ``name`` (its playbook file), ``workers`` (pids of its orphaned Ansible workers) and
    ``descendants`` (pids of the processes those workers were running, e.g. a module)."""

    playbook: int
    name: str
    workers: list[int] = field(default_factory=list)
    descendants: list[int] = field(default_factory=list)

    def line(self) -> str:
        """One line for the playbook's output."""
        more = (
            f" and {len(self.descendants)} process(es) they ran ({', '.join(map(str, self.descendants))})"
            if self.descendants
            else ""
        )
        return (
            f"ended {len(self.workers)} Ansible worker(s) of the SIGKILLed ansible-playbook {self.playbook} "
            f"({self.name}) still running: {', '.join(map(str, self.workers))}{more}"
        )


def end_leftovers(
    root: str | os.PathLike, timeout_s: float = orphans.WORKER_TERM_TIMEOUT_S
) -> tuple[list[Ended], list[str]]:
    """End the workers of every recorded ``ansible-playbook`` that no longer lives.

    For each run directory under ``root`` whose playbook identity is not alive (a playbook that
    runs, this one included, is never touched), each worker record is matched by identity
    (``orphans.orphan``: pid + start ticks + boot id; a reused pid is never signalled); the
    matched workers get SIGTERM (ansible's handler ends the worker's process group), SIGKILL after
    ``timeout_s`` seconds, and the processes they were running (their descendants, captured while
    the worker lived) SIGKILL if still there. The directory is then removed.

    Returns ``(ended, problems)``: an :class:`Ended` per playbook that left live workers, and one
    line per record that could not be read. An unreadable ``playbook.json`` leaves its directory
    alone (whose workers they are is unknown); an unreadable worker record names no process, so
    nothing is signalled for it and it goes with its directory. Never raises for a record."""
    import psutil

    ended: list[Ended] = []
    problems: list[str] = []
    try:
        dirs = sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return ended, problems  # no record yet
    for d in dirs:
        try:
            playbook, rec = _identity(d / PLAYBOOK_NAME, "playbook")
        except WorkersError as exc:
            problems.append(f"{exc}; left alone")
            continue
        if playbook is None or playbook.alive():
            continue  # being written by a playbook starting now, or a playbook that runs
        procs = []
        for path in sorted(d.glob(f"{WORKER_PREFIX}*.json")):
            try:
                ident = _identity(path)[0]
            except WorkersError as exc:
                problems.append(f"{exc}; no process signalled for it")
                continue
            proc = orphans.orphan(ident, playbook) if ident is not None else None
            if proc is not None:
                procs.append(proc)
        kids = []
        for proc in procs:
            try:
                kids += proc.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        orphans.end_processes(procs, timeout_s)
        left = [k for k in kids if k.is_running()]
        if left:
            orphans.end_processes(left, 0)
        shutil.rmtree(d, ignore_errors=True)
        if procs:
            ended.append(Ended(playbook.pid, str(rec.get("name", "?")), [p.pid for p in procs], [k.pid for k in kids]))
    return ended, problems
