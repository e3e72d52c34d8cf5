"""Fault injection for fenced-window drills: a fixed delay added to every Engram row lookup.

``DSV41_ENGRAM_FAULT_DELAY_MS`` (milliseconds, float >= 0; unset or 0 = off) wraps the engine's
row source so that each ``lookup`` sleeps that long before answering. Rows stay exact (the wrapped
source still reads them); only time is added, about ``2 x delay`` per engine step on the lab model
(two Engram layers). The shipped candidate ``slow-rows`` uses it as the window's known LOSS
(docs/windows.md). Never set in production.
"""

from __future__ import annotations

import time


class DelayedRowSource:
    """A RowSource that sleeps ``delay_ms`` before each lookup of ``inner`` (same rows, same
    counters, plus ``fault_delay_ms``)."""

    def __init__(self, inner, delay_ms: float) -> None:
        self.inner, self.delay_s = inner, delay_ms / 1e3

    def lookup(self, layer_id, rows):
        time.sleep(self.delay_s)
        return self.inner.lookup(layer_id, rows)

    def counters(self) -> dict:
        c = dict(self.inner.counters())
        c["fault_delay_ms"] = self.delay_s * 1e3
        return c

    def __getattr__(self, name):  # close(), layouts and the rest: the inner source's
        return getattr(self.inner, name)


def wrap(source, delay_ms: float):
    """``source`` itself, or a DelayedRowSource when ``delay_ms`` (``Settings.engram_fault_delay_ms``,
    range-checked by ``dsv41.envs``) is > 0."""
    return DelayedRowSource(source, delay_ms) if delay_ms > 0 else source
