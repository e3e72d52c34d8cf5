"""Admission state of the lab engine's API (rank 0) and its shutdown drain.

:class:`ServerState` is what the route handlers (``dsv41.engine.api_router``) admit requests by:
paused / draining, the fenced window token still admitted while paused, and the HOLD record that
outlives a restart (``DSV41_ADMISSION_HOLD_FILE``, engine/hold.py); its ``book`` is the drain
book of the requests in flight (engine/drain.py). :func:`shutdown_drain` is the SIGTERM path
(``dsv41.entrypoints.engine_serve``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from dsv41.engine import drain as dr
from dsv41.engine.drain import DrainBook
from dsv41.engine.hold import HoldFileError, HoldRecord, read_hold, remove_hold, write_hold

# The API's one logger (its journal lines read "dsv41.engine.server" whichever module logs).
log = logging.getLogger("dsv41.engine.server")

# Seconds a pause (or the shutdown) waits for the aborts it issued to land (the engine applies
# them at its next step, milliseconds; more only when the step thread hangs).
ABORT_SETTLE_S = 5.0


# A fenced window's requests carry WINDOW_HEADER; a HOLD taken with ``/pause?window=TOKEN`` still
# admits requests whose header equals TOKEN (the window's cells and its restore checks). The
# record format is shared with the vLLM admission fence (engine/hold.py).


class ServerState:
    """Admission state shared by the handlers: ``paused``, ``draining``, ``paused_since``
    (Unix time in seconds when admission was last closed; None while open) and ``window_token``
    (the fenced window admitted while paused; None when none).

    ``hold_file`` (``DSV41_ADMISSION_HOLD_FILE``; None: memory only, as vLLM) keeps a *fenced*
    HOLD (one taken with ``/pause?window=TOKEN``: window.yml, promote.yml, rollback.yml) across
    engine restarts: :meth:`hold` writes ``{"since": s, "window": TOKEN}`` there (atomic rename),
    :meth:`open` removes it, and a state built while the file holds a valid record starts held,
    admitting only that token's requests. So a rank 0 restarted under such a HOLD comes up held
    until its owner's checks pass and it reopens. A plain ``/pause`` is not kept (vLLM's
    behaviour), and an unreadable or malformed file is ignored with a warning, never a crash.
    Raises OSError from :meth:`hold`/:meth:`open` only when the file cannot be written/removed."""

    def __init__(self, hold_file: str | os.PathLike | None = None) -> None:
        self.paused = False
        self.draining = False
        self.paused_since: float | None = None
        self.window_token: str | None = None
        self.hold_file = Path(hold_file) if hold_file else None
        self.book = DrainBook()  # admitted requests and pending pause drains (engine/drain.py)
        self.shutdown_report: dict | None = None
        if self.hold_file is not None:
            self._load()

    def _load(self) -> None:
        try:
            rec = read_hold(self.hold_file)
        except HoldFileError as exc:
            log.warning("%s: starting open", exc)
            return
        if rec is None:
            return
        self.paused, self.paused_since, self.window_token = True, rec.since, rec.window
        # the token is a secret (it admits requests past the HOLD): never logged
        log.info("starting held: a fenced HOLD (since %.0f) outlived the restart", rec.since)

    def hold(self, window: str | None) -> None:
        """Close admission (``window``: the fenced token still admitted, or None); a fenced HOLD
        is written to ``hold_file``, a plain one removes a stale record."""
        if not self.paused:
            self.paused_since = time.time()
        self.paused = True
        self.window_token = window or None
        if self.hold_file is None:
            return
        if self.window_token is None:
            remove_hold(self.hold_file)
            return
        write_hold(self.hold_file, HoldRecord(self.paused_since, self.window_token))

    def open(self) -> None:
        """Admit requests again; the kept HOLD record (if any) is removed."""
        self.paused = False
        self.window_token = None
        self.paused_since = None
        if self.hold_file is not None:
            remove_hold(self.hold_file)


async def shutdown_drain(engine, st: ServerState, timeout_s: float) -> dict:
    """The shutdown drain (SIGTERM, a draining TP peer): stop admitting (``st.draining``; new
    requests and ``/pause`` get 503), end every pending ``wait`` drain (``drain``: ``shutdown``),
    then give the requests in flight ``timeout_s`` seconds (``DSV41_ENGINE_DRAIN_TIMEOUT_S``) to
    finish and abort the rest. A frozen engine (the latest pause was ``keep``) cannot finish
    anything, so its requests are aborted at once. Returns (and keeps in ``st.shutdown_report``)
    ``{"in_flight": n, "aborted": n, "still_running": n, "seconds": s}``; ``still_running`` is
    non-zero only when aborts did not land within ``ABORT_SETTLE_S`` (a hung step thread). Ends
    within ``timeout_s + ABORT_SETTLE_S`` seconds in every state."""
    t0 = time.monotonic()
    st.draining = True
    st.book.shutdown()
    in_flight = len(st.book.entries)
    if not getattr(engine, "frozen", False):
        await st.book.idle(timeout_s)
    keys = list(st.book.entries)
    for key in keys:
        rid = st.book.ask_abort(key, dr.BY_SHUTDOWN)
        if rid is not None:
            engine.abort(rid)
    if keys:
        log.warning(
            "shutdown: aborting %d requests still in flight after the %g s drain%s",
            len(keys),
            timeout_s,
            " (the engine is frozen by a keep pause)" if getattr(engine, "frozen", False) else "",
        )
        await st.book.idle(ABORT_SETTLE_S)
    st.shutdown_report = {
        "in_flight": in_flight,
        "aborted": st.book.shutdown_aborted,
        "still_running": len(st.book.entries),
        "seconds": round(time.monotonic() - t0, 3),
    }
    return st.shutdown_report
