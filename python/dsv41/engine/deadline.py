"""Deadlines the engine enforces itself on the remote calls of its step path.

A remote peer (the drafter behind ``Speculator.propose``, the Engram table server behind
``RowSource.lookup``) has its own timeouts, but a bug, a wedged peer or a lock held elsewhere can
still block the call; the engine thread would then stall every request. So the engine runs each
such call on a helper thread and waits at most a deadline:

- ``DeadlineCaller.call(fn, ...)``: the result, or ``CallTimeout`` once the deadline passes, or
  ``CallBusy`` at once while an earlier call that overran is still running (a peer that hung
  once gets no second call until the first one returns: calls are never stacked up, and the
  callee never runs two calls at a time).
- ``DeadlineRowSource``: a ``RowSource`` wrapper for remote Engram rows; a lookup that misses
  the deadline (or finds the remote still busy) returns the exact rows from the local reader
  (counted as ``deadline_exceeded`` and ``fallbacks``); with ``required`` it raises instead.

The variables (rows of ``dsv41.envs``; see docs/engine.md, "Liveness and deadlines"):
``DSV41_TP_PEER_TIMEOUT_S`` (default 5 s), ``DSV41_DRAFTER_PROPOSE_DEADLINE_MS`` (default 1000
ms) and ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS`` (default 1000 ms).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from dsv41.errors import Dsv41Error


class CallTimeout(Dsv41Error):
    """A guarded call did not return within its deadline (it keeps running on its thread)."""


class CallBusy(Dsv41Error):
    """A guarded call was refused because an earlier call that overran has not returned yet."""


class DeadlineCaller:
    """Runs one call at a time on a daemon thread named ``name`` and waits at most a deadline.

    ``call(fn, *args, timeout_s=...)`` returns ``fn(*args)`` or re-raises its exception; raises
    ``CallTimeout`` after ``timeout_s`` seconds (the call is abandoned, not interrupted: Python
    cannot stop a thread) and ``CallBusy`` while an abandoned call is still running. Thread-safe
    for one caller thread (the engine thread); ``busy`` tells whether an abandoned call runs.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running = threading.Event()  # set while a call is on the worker thread
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """True while a call (normally an abandoned one) is still running."""
        return self._running.is_set()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, box, done = job
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
                box["error"] = exc
            finally:
                self._running.clear()
                done.set()

    def call(self, fn: Callable, *args, timeout_s: float):
        """``fn(*args)`` within ``timeout_s`` seconds; see class doc for the errors."""
        if self._running.is_set():
            raise CallBusy(f"{self.name}: the previous call has not returned yet (over its deadline)")
        box: dict[str, Any] = {}
        done = threading.Event()
        self._running.set()
        self._jobs.put((fn, args, box, done))
        if not done.wait(timeout_s):
            raise CallTimeout(f"{self.name}: no answer within the {timeout_s * 1000:.0f} ms deadline")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """Let the worker thread end after its current call (never blocks)."""
        self._jobs.put(None)


class DeadlineRowSource:
    """A ``RowSource`` whose ``lookup`` on ``inner`` (a remote row source) ends within a deadline.

    ``inner``: ``dsv41.engram.client.RemoteRowSource`` (uses its ``local`` reader and
    ``required`` flag); ``deadline_s``: seconds per lookup. On a deadline miss (or while a
    missed lookup still runs) the rows come from ``inner.local`` (``lookup`` or ``read``),
    bit-exact, counted in ``counters()`` as ``deadline_exceeded`` and ``fallbacks``; when
    ``inner.required`` is true or there is no local reader, raises ``CallTimeout``/``CallBusy``
    instead (the engine then fails the step, as for any required-remote failure). The inner call
    fills a private buffer, so an abandoned lookup can never write into a caller's array.
    """

    def __init__(self, inner, deadline_s: float) -> None:
        self.inner, self.deadline_s = inner, deadline_s
        self._caller = DeadlineCaller("dsv41-engram-lookup")
        self._missed = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def lookup(self, layer_id: int, rows, out: np.ndarray | None = None) -> np.ndarray:
        """Packed rows uint8 ``[N, 264]`` (see ``RemoteRowSource.lookup``), within the deadline."""
        try:
            got = self._caller.call(self.inner.lookup, layer_id, rows, timeout_s=self.deadline_s)
        except (CallTimeout, CallBusy) as exc:
            with self._lock:
                self._missed += 1
            local = getattr(self.inner, "local", None)
            if getattr(self.inner, "required", False) or local is None:
                raise
            r = np.asarray(rows)
            got = local.lookup(layer_id, r) if hasattr(local, "lookup") else local.read(layer_id, r)
            del exc
        if out is None:
            return got
        out[...] = got
        return out

    def lookup_layers(self, layer_ids, rows, outs=None) -> list[np.ndarray]:
        """Rows of several layers in one remote request (``RemoteRowSource.lookup_layers``'
        contract: one uint8 ``[N_i, 264]`` array per layer), within one deadline for the whole
        request; on a miss each layer is answered from ``inner.local`` as ``lookup`` does."""
        if not hasattr(self.inner, "lookup_layers"):  # a source without the multi-layer request
            if outs is None:
                return [self.lookup(lid, r) for lid, r in zip(layer_ids, rows)]
            return [self.lookup(lid, r, o) for lid, r, o in zip(layer_ids, rows, outs)]
        try:
            got = self._caller.call(self.inner.lookup_layers, layer_ids, rows, timeout_s=self.deadline_s)
        except (CallTimeout, CallBusy):
            with self._lock:
                self._missed += 1
            local = getattr(self.inner, "local", None)
            if getattr(self.inner, "required", False) or local is None:
                raise
            got = [local.lookup(lid, np.asarray(r)) if hasattr(local, "lookup") else local.read(lid, np.asarray(r))
                   for lid, r in zip(layer_ids, rows)]
        if outs is None:
            return list(got)
        for o, g in zip(outs, got):
            o[...] = g
        return list(outs)

    def counters(self) -> dict:
        """``inner.counters()`` plus ``deadline_exceeded`` (also added to ``fallbacks``)."""
        c = dict(self.inner.counters())
        with self._lock:
            missed = self._missed
        c["deadline_exceeded"] = missed
        c["fallbacks"] = c.get("fallbacks", 0) + missed
        return c

    def close(self) -> None:
        """Close ``inner`` and let the helper thread end."""
        self._caller.close()
        self.inner.close()


@dataclass(frozen=True)
class Deadlines:
    """``tp_peer_timeout_s``: how long a TP collective waits for the other rank after the first
    command; ``propose_s``: deadline of one ``Speculator.propose``; ``engram_lookup_s``: deadline
    of one remote Engram ``lookup``. All seconds."""

    tp_peer_timeout_s: float = 5.0
    propose_s: float = 1.0
    engram_lookup_s: float = 1.0


def deadlines_from_settings(settings) -> Deadlines:
    """The step-path deadlines of a parsed environment (``dsv41.envs.Settings``:
    ``DSV41_TP_PEER_TIMEOUT_S``, ``DSV41_DRAFTER_PROPOSE_DEADLINE_MS``,
    ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``; ranges and the rule that the TP peer timeout exceeds the
    propose deadline are checked by ``dsv41.envs.parse``)."""
    return Deadlines(tp_peer_timeout_s=settings.tp_peer_timeout_s, propose_s=settings.drafter_propose_deadline_ms / 1000,
                     engram_lookup_s=settings.engram_lookup_deadline_ms / 1000)


def deadlines_from_env(env: Mapping[str, str] | None = None) -> Deadlines:
    """``deadlines_from_settings(dsv41.envs.parse(env))``; ``ConfigError`` naming the variable."""
    from dsv41 import envs

    return deadlines_from_settings(envs.parse(env))


def guard_row_source(rows, deadline_s: float):
    """``rows`` wrapped in ``DeadlineRowSource`` when it reads remotely (has a ``local`` reader
    attribute, i.e. ``RemoteRowSource``); a purely local row source is returned as is."""
    if hasattr(rows, "local") and hasattr(rows, "url"):
        return DeadlineRowSource(rows, deadline_s)
    return rows
