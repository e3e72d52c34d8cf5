"""Clock-independent identity of a Linux process: pid + kernel start time + boot id.

A pid alone is reused; a pid plus a wall-clock creation time (psutil's ``create_time()``, which
is ``boot_time() + start ticks``, and ``boot_time()`` is derived from the realtime clock) moves
whenever the clock is stepped (NTP, a VM resume, an operator's ``date -s``), so a tolerance on it
either misses the live process or accepts a reused pid. The kernel's own record does not move:

- ``start_ticks``: field 22 of ``/proc/<pid>/stat`` (``starttime``, clock ticks after boot;
  proc(5)). Field 2 is the command name in parentheses and may itself contain spaces and
  parentheses, so the fields are split after the *last* ``)``.
- ``boot_id``: ``/proc/sys/kernel/random/boot_id`` (random(4)), so a record from an earlier boot,
  where the same pid and tick count can recur, never matches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class ProcessGone(Exception):
    """The pid names no process (or its ``/proc`` entry cannot be parsed: it is exiting)."""


def parse_start_ticks(stat: str) -> int:
    """``starttime`` (field 22, clock ticks after boot) of a ``/proc/<pid>/stat`` line.

    Splits after the last ``)`` because field 2 (``(comm)``) may hold spaces and parentheses.
    Raises ValueError when the line has no ``)`` or too few fields."""
    head, sep, rest = stat.rpartition(")")
    if not sep or "(" not in head:
        raise ValueError("no (comm) field in /proc/<pid>/stat")
    fields = rest.split()
    # rest starts at field 3 (state): field 22 is index 22 - 3.
    if len(fields) < 20:
        raise ValueError(f"/proc/<pid>/stat has {len(fields) + 2} fields, expected at least 22")
    return int(fields[19])


def start_ticks(pid: int) -> int:
    """The kernel start time of ``pid`` in clock ticks after boot; ``ProcessGone`` when there is
    no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            return parse_start_ticks(f.read())
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(pid) from None
    except ValueError:
        raise ProcessGone(pid) from None


def boot_id() -> str:
    """This boot's random id (``/proc/sys/kernel/random/boot_id``, 36 characters)."""
    with open(BOOT_ID_PATH, encoding="ascii") as f:
        return f.read().strip()


def is_zombie(pid: int) -> bool:
    """True when ``pid`` has exited but is not reaped (state ``Z``) or is dead (``X``)."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            state = f.read().rpartition(")")[2].split()[:1]
    except OSError:
        return True
    return state[:1] in (["Z"], ["X"])


@dataclass(frozen=True)
class ProcessIdentity:
    """``pid`` (int), ``start_ticks`` (int, clock ticks after boot), ``boot_id`` (str)."""

    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessIdentity:
        """The identity of ``pid`` (default: this process); ``ProcessGone`` if it has ended."""
        pid = os.getpid() if pid is None else int(pid)
        return cls(pid, start_ticks(pid), boot_id())

    def as_record(self) -> dict:
        """JSON-ready ``{"pid", "start_ticks", "boot_id"}``."""
        return {"pid": self.pid, "start_ticks": self.start_ticks, "boot_id": self.boot_id}

    @classmethod
    def from_record(cls, record: dict) -> ProcessIdentity:
        """Inverse of ``as_record``; KeyError/TypeError/ValueError on a malformed record."""
        pid, ticks, bid = record["pid"], record["start_ticks"], record["boot_id"]
        if isinstance(pid, bool) or isinstance(ticks, bool) or not isinstance(bid, str):
            raise TypeError("pid/start_ticks must be integers and boot_id a string")
        pid, ticks = int(pid), int(ticks)
        if pid <= 0 or ticks < 0:
            raise ValueError(f"pid {pid} / start_ticks {ticks} out of range")
        return cls(pid, ticks, bid)

    def alive(self) -> bool:
        """True when the pid still names this very process (same boot, same start ticks) and it
        has not exited (a zombie is not alive)."""
        try:
            if boot_id() != self.boot_id or start_ticks(self.pid) != self.start_ticks:
                return False
        except ProcessGone:
            return False
        return not is_zombie(self.pid)
