"""Fault injection for fenced-window drills: a fixed delay added to every Engram row lookup.

``DSV41_ENGRAM_FAULT_DELAY_MS`` (milliseconds, float >= 0; unset or 0 = off) wraps the engine's
row source so that each ``lookup`` sleeps that long before answering. Rows stay exact (the wrapped
source still reads them); only time is added, about ``2 x delay`` per engine step on the lab model
(two Engram layers). The shipped candidate ``slow-rows`` uses it as the window's known LOSS
(docs/windows.md). Never set in production.
"""

from __future__ import annotations

import math
import os
import time
from typing import Mapping

from dsv41.errors import ConfigError


# envs: DSV41_ENGRAM_FAULT_DELAY_MS
def delay_ms_from_env(env: Mapping[str, str] | None = None) -> float:
    """The injected delay in ms (0.0 when unset or empty); ConfigError naming the variable when
    it is not a finite number >= 0 or is above 10,000 ms."""
    raw = (os.environ if env is None else env).get("DSV41_ENGRAM_FAULT_DELAY_MS", "").strip()
    if not raw:
        return 0.0
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"DSV41_ENGRAM_FAULT_DELAY_MS must be a number of milliseconds, got {raw!r}") from None
    if not math.isfinite(v) or not 0 <= v <= 10_000:
        raise ConfigError(f"DSV41_ENGRAM_FAULT_DELAY_MS must be in [0, 10000] ms, got {raw!r}")
    return v


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


def wrap_from_env(source, env: Mapping[str, str] | None = None):
    """``source`` itself, or a DelayedRowSource when ``DSV41_ENGRAM_FAULT_DELAY_MS`` > 0."""
    d = delay_ms_from_env(env)
    return DelayedRowSource(source, d) if d > 0 else source
