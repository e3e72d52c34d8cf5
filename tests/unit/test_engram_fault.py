"""The fault-injection knob of window drills: DSV41_ENGRAM_FAULT_DELAY_MS."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dsv41.engram import fault
from dsv41.errors import ConfigError


class Rows:
    def __init__(self):
        self.calls = 0

    def lookup(self, layer_id, rows):
        self.calls += 1
        return np.asarray(rows) * 2

    def counters(self):
        return {"lookups": self.calls}

    def close(self):
        return "closed"


def test_off_by_default_and_delay_applied():
    inner = Rows()
    assert fault.wrap_from_env(inner, {}) is inner
    assert fault.wrap_from_env(inner, {"DSV41_ENGRAM_FAULT_DELAY_MS": "0"}) is inner
    w = fault.wrap_from_env(inner, {"DSV41_ENGRAM_FAULT_DELAY_MS": "30"})
    t = time.perf_counter()
    out = w.lookup(1, [1, 2])
    assert time.perf_counter() - t >= 0.029
    assert out.tolist() == [2, 4]  # rows unchanged: only time is added
    assert w.counters() == {"lookups": 1, "fault_delay_ms": 30.0}
    assert w.close() == "closed"


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "inf", "20000"])
def test_bad_values_name_the_variable(raw):
    with pytest.raises(ConfigError, match="^DSV41_ENGRAM_FAULT_DELAY_MS"):
        fault.delay_ms_from_env({"DSV41_ENGRAM_FAULT_DELAY_MS": raw})
