"""Deadlines the engine enforces itself on the remote calls of its step path.

The drafter behind ``Speculator.propose`` has its own timeouts, but a bug, a wedged peer or a
lock held elsewhere can still block the call; the engine thread would then stall every request.
So the engine runs each propose on a helper thread and waits at most a deadline:

- ``DeadlineCaller.call(fn, ...)``: the result, or ``CallTimeout`` once the deadline passes, or
  ``CallBusy`` at once while an earlier call that overran is still running (a peer that hung
  once gets no second call until the first one returns: calls are never stacked up, and the
  callee never runs two calls at a time).

The remote Engram lookup needs no helper thread: its deadline
(``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``) lives in ``dsv41.engram.client.RemoteRowSource``
(``deadline_ms``), which bounds its lock wait and every request on the calling thread and
answers from the exact local reader past it (built by ``dsv41.engram.sources.from_env``).

The variables (rows of ``dsv41.envs``; see docs/engine.md, "Liveness and deadlines"):
``DSV41_TP_PEER_TIMEOUT_S`` (default 5 s) and ``DSV41_DRAFTER_PROPOSE_DEADLINE_MS`` (default
1000 ms).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Deadlines:
    """``tp_peer_timeout_s``: how long a rank waits for the other once the TP group has formed;
    ``propose_s``: deadline of one ``Speculator.propose``. Both seconds. (The remote
    Engram lookup's deadline is ``RemoteRowSource``'s own ``deadline_ms``.)"""

    tp_peer_timeout_s: float = 5.0
    propose_s: float = 1.0


def deadlines_from_settings(settings) -> Deadlines:
    """The step-path deadlines of a parsed environment (``dsv41.envs.Settings``:
    ``DSV41_TP_PEER_TIMEOUT_S``, ``DSV41_DRAFTER_PROPOSE_DEADLINE_MS``; ranges and the rule that
    the TP peer timeout exceeds the propose deadline are checked by ``dsv41.envs.parse``)."""
    return Deadlines(
        tp_peer_timeout_s=settings.tp_peer_timeout_s, propose_s=settings.drafter_propose_deadline_ms / 1000
    )


def deadlines_from_env(env: Mapping[str, str] | None = None) -> Deadlines:
    """``deadlines_from_settings(dsv41.envs.parse(env))``; ``ConfigError`` naming the variable."""
    from dsv41 import envs

    return deadlines_from_settings(envs.parse(env))
