"""Pause drains scoped by admission epoch: which in-flight requests a ``/pause`` waits for or
aborts, and who ended each one. One definition for both servers that hold admission, the lab
engine (``engine/server.py``) and the vLLM admission fence (``overlay/fence.py``). Standard
library only (the fence runs inside vLLM's API server process); every method runs on the
server's event loop thread.

The rules (docs/engine.md, "Pause, resume and drains"):

- Every admitted request is entered (:meth:`DrainBook.admit`) with the admission epoch and its
  ``X-DSV41-Window`` token, and leaves when it ends (:meth:`DrainBook.finished`).
- A pause starts a new epoch (:meth:`DrainBook.begin`). Its *scope* is fixed then: the requests
  in flight at that moment that the new HOLD would refuse (a fenced HOLD's own token stays
  admitted, so its requests are not drained). A request admitted later, after a ``/resume`` or
  under the HOLD with the token, is never in that pause's scope, so that pause can never abort it.
- A pending ``wait`` drain ends early, without aborting anything, when a ``/resume`` arrives
  (outcome ``resumed``), when a later pause supersedes it (``superseded``: the later pause's
  scope and mode decide from then on) or at shutdown (``shutdown``: the shutdown drain decides).
  Otherwise it ends ``drained`` (its scope finished) or ``timed_out`` (its deadline passed).
- An abort is attributed to the first party that asked for it (a pause, the shutdown, or the
  client going away), and a request counts as aborted by that party only when it really ended
  ``abort``; a request that finished normally before the abort landed is not counted. So the
  counts in a pause reply are exact.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

#: Outcomes of a pause's drain (the ``drain`` field of a ``/pause`` reply).
DRAINED, TIMED_OUT, RESUMED, SUPERSEDED, SHUTDOWN, FROZEN = (
    "drained",
    "timed_out",
    "resumed",
    "superseded",
    "shutdown",
    "frozen",
)
#: The parties an abort is attributed to besides a pause.
BY_SHUTDOWN, BY_CLIENT = "shutdown", "client"


@dataclass
class Entry:
    """One admitted request: ``epoch`` at admission, ``window`` (its token or None), ``rid`` (the
    engine's request id once known), ``abort_by`` (the :class:`Drain` or party that first asked
    to abort it, else None)."""

    epoch: int
    window: str | None
    rid: str | None = None
    abort_by: object = None


@dataclass(eq=False)
class Drain:
    """One pause: ``seq`` (its epoch), ``mode`` (``abort``/``wait``/``keep``), ``scope`` (keys of
    its requests still in flight), ``in_flight_at_pause`` (the scope's size at the pause),
    ``outcome`` (one of the outcomes above once ended, else None), ``aborted`` (requests of its
    scope it aborted and that ended ``abort``), ``asked`` (keys it asked to abort that are still
    in flight), ``ended_with`` (the scope's size when a resume, a later pause or the shutdown
    ended it early). :attr:`still_running` is what a reply reports."""

    seq: int
    mode: str
    scope: set = field(default_factory=set)
    in_flight_at_pause: int = 0
    outcome: str | None = None
    aborted: int = 0
    asked: set = field(default_factory=set)
    ended_with: int | None = None  # scope size when a resume, later pause or shutdown ended it
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _poke(self) -> None:
        self._changed.set()

    @property
    def still_running(self) -> int:
        """Requests of the scope in flight: when ended early, as they were at that moment (what
        happens to them next is the later pause's or the shutdown's to report); else now."""
        return len(self.scope) if self.ended_with is None else self.ended_with


class DrainBook:
    """The admitted requests and the pending drains of one server (module docstring).

    Counters: :attr:`shutdown_aborted` (requests the shutdown drain aborted that ended
    ``abort``), :attr:`client_aborted`.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.entries: dict[int, Entry] = {}
        self.pending: list[Drain] = []
        self.shutdown_aborted = 0
        self.client_aborted = 0
        self._keys = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()

    # ---------------------------------------------------------------- requests
    def admit(self, window: str | None = None) -> int:
        """Enter a request admitted now; returns its key."""
        key = next(self._keys)
        self.entries[key] = Entry(self.epoch, window)
        self._idle.clear()
        return key

    def bind(self, key: int, rid: str) -> None:
        """Record the engine's request id of ``key`` (what an abort needs)."""
        e = self.entries.get(key)
        if e is not None:
            e.rid = rid

    def finished(self, key: int, reason: str) -> None:
        """``key`` ended with finish ``reason`` (``length``, ``stop``, ``abort``, ``error``...);
        credits an ``abort`` to whoever asked for it and wakes the drains that covered it.
        Unknown keys are ignored (a request ends once)."""
        e = self.entries.pop(key, None)
        if e is None:
            return
        if reason == "abort":
            if isinstance(e.abort_by, Drain):
                e.abort_by.aborted += 1
            elif e.abort_by == BY_SHUTDOWN:
                self.shutdown_aborted += 1
            elif e.abort_by == BY_CLIENT:
                self.client_aborted += 1
        for d in self.pending:
            if key in d.scope or key in d.asked:
                d.scope.discard(key)
                d.asked.discard(key)
                d._poke()
        if not self.entries:
            self._idle.set()

    def forget(self, key: int) -> None:
        """``key`` was never submitted (the engine refused it): drop it, counted nowhere."""
        self.finished(key, "refused")

    def ask_abort(self, key: int, by) -> str | None:
        """Attribute an abort of ``key`` to ``by`` (a :class:`Drain`, ``BY_SHUTDOWN`` or
        ``BY_CLIENT``) unless someone asked first; returns its engine request id (None when it
        has none yet or has ended). The caller then aborts that id."""
        e = self.entries.get(key)
        if e is None:
            return None
        if e.abort_by is None:
            e.abort_by = by
            if isinstance(by, Drain):
                by.asked.add(key)
        return e.rid

    # ---------------------------------------------------------------- pauses
    def begin(self, mode: str, window: str | None = None) -> Drain:
        """Start a pause in ``mode``; ``window``: the token its HOLD still admits. A pending
        ``wait`` drain is superseded. Returns the new :class:`Drain` (pending until :meth:`end`)."""
        self._end_waits(SUPERSEDED)
        self.epoch += 1
        d = Drain(self.epoch, mode)
        d.scope = {k for k, e in self.entries.items() if not (window is not None and e.window == window)}
        d.in_flight_at_pause = len(d.scope)
        self.pending.append(d)
        return d

    def resume(self) -> None:
        """A ``/resume``: every pending ``wait`` drain ends ``resumed`` (its scope keeps running)."""
        self._end_waits(RESUMED)

    def shutdown(self) -> None:
        """Shutdown began: every pending ``wait`` drain ends ``shutdown``."""
        self._end_waits(SHUTDOWN)

    def end_waits(self, outcome: str) -> None:
        """End every pending ``wait`` drain with ``outcome`` (e.g. ``superseded`` when a HOLD the
        book does not see, such as vLLM's own ``/pause``, replaces it)."""
        self._end_waits(outcome)

    def _end_waits(self, outcome: str) -> None:
        for d in self.pending:
            if d.mode == "wait" and d.outcome is None:
                d.outcome, d.ended_with = outcome, len(d.scope)
                d._poke()

    async def wait(self, d: Drain, timeout_s: float) -> str:
        """Wait until ``d``'s scope has finished (``drained``), its outcome was set by a resume,
        a later pause or the shutdown, or ``timeout_s`` seconds passed (``timed_out``). Returns
        the outcome (also kept in ``d.outcome``)."""
        deadline = time.monotonic() + timeout_s
        while d.outcome is None:
            if not d.scope:
                d.outcome = DRAINED
                break
            left = deadline - time.monotonic()
            if left <= 0:
                d.outcome = TIMED_OUT
                break
            d._changed.clear()
            try:
                await asyncio.wait_for(d._changed.wait(), left)
            except TimeoutError:
                pass
        return d.outcome

    async def settle(self, d: Drain, timeout_s: float) -> bool:
        """Wait until every request ``d`` asked to abort has ended, at most ``timeout_s`` seconds;
        True when they all did."""
        deadline = time.monotonic() + timeout_s
        while d.asked:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            d._changed.clear()
            try:
                await asyncio.wait_for(d._changed.wait(), left)
            except TimeoutError:
                pass
        return True

    def end(self, d: Drain) -> None:
        """The pause's reply is being sent: stop tracking ``d``."""
        if d in self.pending:
            self.pending.remove(d)

    async def idle(self, timeout_s: float) -> bool:
        """Wait until no admitted request is in flight, at most ``timeout_s`` seconds; True when
        none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return not self.entries
        return True
