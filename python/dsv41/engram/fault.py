"""Fault injection for fenced-window drills: a fixed delay added to every Engram row lookup.

``DSV41_ENGRAM_FAULT_DELAY_MS`` (milliseconds, float >= 0; unset or 0 = off) wraps the engine's
local row source so that each layer's ``lookup`` sleeps that long before answering (a remote row
source applies the same delay itself, inside its lookup deadline, as a slow server would:
``dsv41.engram.client.RemoteRowSource(fault_delay_ms=...)``). Rows stay exact (the wrapped
source still reads them); only time is added, about ``2 x delay`` per engine step on the lab model
(two Engram layers, whether fetched one by one or together by ``lookup_layers``). The shipped
candidate ``slow-rows`` uses it as the window's known LOSS (docs/windows.md). Never set in
production.
"""

from __future__ import annotations

import time


class DelayedRowSource:
    """A RowSource that sleeps ``delay_ms`` before each lookup of ``inner`` (same rows, same
    counters, plus ``fault_delay_ms``)."""

    def __init__(self, inner, delay_ms: float) -> None:
        self.inner, self.delay_s = inner, delay_ms / 1e3

    def lookup(self, layer_id, rows, out=None):
        """``inner.lookup`` (uint8 ``[N, 264]``) after ``delay_ms``; ``out`` passed on when given."""
        time.sleep(self.delay_s)
        return self.inner.lookup(layer_id, rows) if out is None else self.inner.lookup(layer_id, rows, out)

    def lookup_layers(self, layer_ids, rows, outs=None):
        """Every layer through ``lookup`` (``delay_ms`` each: the delay is per layer, as when
        the engine looks each layer up on its own); one uint8 ``[N_i, 264]`` array per layer."""
        outs = [None] * len(layer_ids) if outs is None else outs
        return [self.lookup(lid, r, o) for lid, r, o in zip(layer_ids, rows, outs)]

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
