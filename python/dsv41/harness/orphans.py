"""What every record of a process that may outlive a SIGKILLed playbook shares: the strict reader of
a small JSON record, the orphan test (a recorded process whose recorded parent no longer lives)
and the ender (SIGTERM, then SIGKILL after a timeout).

ansible-core's ``WorkerProcess`` calls ``setsid()`` (ansible/executor/process/worker.py,
``_detach``), so a SIGKILL of ``ansible-playbook``'s process group misses its workers: each one
finishes its task, then blocks for ever handing the result to its dead parent. Two records name
such processes by identity (pid + kernel start ticks + boot id, ``dsv41.harness.procident``):
window.yml's ``run.pid`` (``dsv41.harness.window_pid``) and promote.yml's / rollback.yml's worker
records (``dsv41.promotion.workers``). Nothing here looks a process up by name.
"""

from __future__ import annotations

import os
import stat

from dsv41 import fileio
from dsv41.harness.procident import ProcessIdentity

#: Seconds an orphaned Ansible worker gets after SIGTERM (its handler ends its process group and
#: exits at once) before SIGKILL.
WORKER_TERM_TIMEOUT_S = 10.0


def read_record(path: str | os.PathLike, what: str, error: type[Exception], max_bytes: int) -> dict | None:
    """The JSON object in ``path``, read by the strict reader (:func:`dsv41.fileio.read_json`: a
    regular file not changing while read, UTF-8, strict JSON, at most ``max_bytes`` bytes); None
    when there is no such file. Raises ``error`` with one line, ``<path>: not a <what> (<why>)``,
    for an empty, torn, undecodable, oversized or non-object file."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            raise error(f"{path}: not a {what} (it is empty)")
        rec = fileio.read_json(path, max_bytes=max_bytes)
    except FileNotFoundError:
        return None
    except fileio.FileError as exc:
        raise error(f"{path}: not a {what} ({exc})") from None
    except OSError as exc:
        raise error(f"{path}: not a {what} ({exc.strerror or exc})") from None
    if not isinstance(rec, dict):
        raise error(f"{path}: not a {what} (a JSON {type(rec).__name__}, not an object)")
    return rec


def orphan(proc: ProcessIdentity, parent: ProcessIdentity):
    """The live process ``proc`` names, as a ``psutil.Process``, when the process ``parent`` names
    (the playbook that started it) no longer lives; None when ``parent`` still lives (never
    signalled then), when ``proc`` has ended, or when its pid now names another process (other
    start ticks or another boot). ``proc`` is checked after psutil captured the pid, so a pid
    reused in between fails the check; psutil guards its own signals by the same start time."""
    import psutil

    if parent.alive():
        return None
    try:
        live = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return None
    return live if proc.alive() else None


def end_processes(procs: list, timeout_s: float) -> None:
    """SIGTERM each ``psutil.Process`` in ``procs``, SIGKILL those left after ``timeout_s`` seconds,
    then wait up to 10 s for them to be gone (reaped when they are our children)."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(procs, timeout=timeout_s)[1]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
