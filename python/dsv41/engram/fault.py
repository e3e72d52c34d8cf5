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

import numpy as np

from dsv41.engram.rowsource import RowSource


class DelayedRowSource(RowSource):
    """A RowSource that sleeps ``delay_ms`` (milliseconds) before each lookup of ``inner`` (a
    RowSource: same rows, same counters, plus ``fault_delay_ms``). Other attributes (a
    layout, ``wait_connected``...) are the inner source's."""

    def __init__(self, inner: RowSource, delay_ms: float) -> None:
        self.inner, self.delay_s = inner, delay_ms / 1e3

    def lookup(self, layer_id: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``inner.lookup`` (uint8 ``[N, 264]``, ``out`` passed on) after ``delay_ms``."""
        time.sleep(self.delay_s)
        return self.inner.lookup(layer_id, rows, out=out)

    # lookup_layers: the protocol's default, one delayed lookup per layer (``delay_ms`` each, as
    # when the engine looks each layer up on its own).

    def counters(self) -> dict:
        """The inner source's counters plus ``fault_delay_ms``."""
        c = dict(self.inner.counters())
        c["fault_delay_ms"] = self.delay_s * 1e3
        return c

    def close(self) -> None:
        """Close the inner source."""
        self.inner.close()

    def __getattr__(self, name):  # layouts and the rest: the inner source's
        return getattr(self.inner, name)


def wrap(source, delay_ms: float):
    """``source`` itself, or a DelayedRowSource when ``delay_ms`` (``Settings.engram_fault_delay_ms``,
    range-checked by ``dsv41.envs``) is > 0."""
    return DelayedRowSource(source, delay_ms) if delay_ms > 0 else source
