"""Memory locking for the async drafting proxy (torch-free).

The proxy answers the engine through a shared-memory ring polled every few tens of microseconds;
a page of its working set or of the ring paged out turns one round into a major fault on the
engine's critical path. The published system's step 5 requires "successful memory locking"
(docs/seed-requirements.md, DEP-memlock: stack-overview "Deploy" 5), so the proxy locks everything it has mapped and
will map (``mlockall(MCL_CURRENT | MCL_FUTURE)``: its interpreter, its heap and the ring's mapping)
and publishes the result in the ring's host flags, where the engine exports it as the gauge
``dsv41_drafter_proxy_memlock``; ``dsv41 proxy self-test`` probes the same lock where the proxy
runs, and the bring-up's async gate reads that report.

Locking needs ``CAP_IPC_LOCK`` or an ``RLIMIT_MEMLOCK`` at least the process's mapped size: the
serving container gets ``--cap-add IPC_LOCK`` (roles/serve ``serve_proxy_memlock``) wherever the
proxy locks.
A refusal is reported with the limit that refused it; the proxy keeps serving (unlocked rounds
are slower, never wrong), and the checks that require locking fail on the report.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import os
import resource
from dataclasses import asdict, dataclass

# <sys/mman.h> on Linux (every architecture the project targets: x86_64 and aarch64)
MCL_CURRENT = 1
MCL_FUTURE = 2


class MemlockState(enum.IntEnum):
    """The proxy's memory-locking result as published in the ring (host flags offset 44)."""

    UNKNOWN = 0  # not reported yet (a proxy still starting, or one older than the field)
    LOCKED = 1
    REFUSED = 2
    OFF = 3  # not asked for (DSV41_DRAFTER_PROXY_MEMLOCK=0)


@dataclass(frozen=True)
class MemlockReport:
    """One attempt's result.

    ``state``: :class:`MemlockState`; ``detail``: "" when locked, else the exact refusal
    (errno name, the ``RLIMIT_MEMLOCK`` soft/hard limits in bytes or ``unlimited``);
    ``locked_kib``: the process's ``VmLck`` after the attempt (KiB, from /proc/self/status;
    -1 where unreadable); ``limit_soft``/``limit_hard``: ``RLIMIT_MEMLOCK`` in bytes (-1 unlimited).
    """

    state: MemlockState
    detail: str
    locked_kib: int
    limit_soft: int
    limit_hard: int

    def as_dict(self) -> dict:
        """JSON-ready: ``state`` as its lower-case name."""
        d = asdict(self)
        d["state"] = self.state.name.lower()
        return d


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _limit(v: int) -> int:
    return -1 if v == resource.RLIM_INFINITY else int(v)


def _fmt(v: int) -> str:
    return "unlimited" if v < 0 else f"{v} B"


def locked_kib() -> int:
    """``VmLck`` of this process in KiB, -1 when /proc/self/status has none (not Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def lock_all() -> MemlockReport:
    """``mlockall(MCL_CURRENT | MCL_FUTURE)`` for this process; never raises.

    Returns LOCKED, or REFUSED with the errno and the limits (ENOMEM: the mapped size exceeds
    ``RLIMIT_MEMLOCK`` without ``CAP_IPC_LOCK``; EPERM: the limit is 0 without the capability;
    EAGAIN: the kernel could not lock some pages), or REFUSED when libc has no ``mlockall``.
    """
    soft, hard = (_limit(v) for v in resource.getrlimit(resource.RLIMIT_MEMLOCK))
    try:
        fn = _libc().mlockall
    except (OSError, AttributeError) as exc:
        return MemlockReport(MemlockState.REFUSED, f"mlockall unavailable: {exc}", locked_kib(), soft, hard)
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    if fn(MCL_CURRENT | MCL_FUTURE) == 0:
        return MemlockReport(MemlockState.LOCKED, "", locked_kib(), soft, hard)
    e = ctypes.get_errno()
    name = errno.errorcode.get(e, str(e))
    detail = (
        f"mlockall(MCL_CURRENT|MCL_FUTURE) failed: {name} ({os.strerror(e)}); "
        f"RLIMIT_MEMLOCK soft {_fmt(soft)}, hard {_fmt(hard)}"
    )
    return MemlockReport(MemlockState.REFUSED, detail, locked_kib(), soft, hard)


def unlock_all() -> None:
    """``munlockall()``: undo :func:`lock_all` (the self-test's probe); errors ignored."""
    try:
        _libc().munlockall()
    except (OSError, AttributeError):
        pass
