"""Helpers for tests that read a row server's counters."""

from __future__ import annotations

import time


def settled_snapshot(srv, quiet_s: float = 0.05, limit_s: float = 3.0) -> dict:
    """The server's counters once they stop moving: the server counts a request after its reply
    is sent (the latency it records includes the send), so a client can read its answer a moment
    before the count moves."""
    end = time.monotonic() + limit_s
    last = srv.snapshot()
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = srv.snapshot()
        if now == last:
            return now
        last = now
    return last
