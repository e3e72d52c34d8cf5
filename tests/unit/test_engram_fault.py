"""The fault-injection knob of window drills: DSV41_ENGRAM_FAULT_DELAY_MS."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dsv41 import envs
from dsv41.engram import fault
from dsv41.engram.rowsource import RowSource


class Rows(RowSource):
    def __init__(self):
        self.calls = 0
        self.closed = False

    def lookup(self, layer_id, rows, out=None):
        self.calls += 1
        return np.asarray(rows) * 2

    def counters(self):
        return {"lookups": self.calls}

    def close(self):
        self.closed = True


def test_off_by_default_and_delay_applied():
    inner = Rows()
    assert envs.parse({}).engram_fault_delay_ms == 0.0
    assert fault.wrap(inner, envs.parse({}).engram_fault_delay_ms) is inner
    w = fault.wrap(inner, envs.parse({"DSV41_ENGRAM_FAULT_DELAY_MS": "30"}).engram_fault_delay_ms)
    t = time.perf_counter()
    out = w.lookup(1, [1, 2])
    assert time.perf_counter() - t >= 0.029
    assert out.tolist() == [2, 4]  # rows unchanged: only time is added
    assert w.counters() == {"lookups": 1, "fault_delay_ms": 30.0}
    assert w.lookup_layers([1, 2], [[1], [3]])[1].tolist() == [6]  # the delay is per layer
    assert time.perf_counter() - t >= 0.089
    w.close()
    assert inner.closed


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "inf", "20000"])
def test_bad_values_name_the_variable(raw):
    with pytest.raises(envs.ConfigError, match="^DSV41_ENGRAM_FAULT_DELAY_MS"):
        envs.parse({"DSV41_ENGRAM_FAULT_DELAY_MS": raw})


def test_row_source_from_env_is_wrapped(tmp_path):
    from dsv41.engram import rowsource
    from dsv41.engram.synthetic import write_synthetic_tables

    cfg = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python" / "dsv41" / "data" / "lab_model.json")
    write_synthetic_tables(cfg, tmp_path, 5)
    s = envs.parse({"DSV41_ENGRAM_FAULT_DELAY_MS": "1"})
    src = rowsource.from_env(str(tmp_path / "manifest.json"), tmp_path, 0, 1, settings=s)
    assert isinstance(src, fault.DelayedRowSource)
    assert not isinstance(rowsource.from_env(str(tmp_path / "manifest.json"), tmp_path, 0, 1, settings=envs.parse({})),
                          fault.DelayedRowSource)


def test_delay_applies_per_layer_to_lookup_layers():
    # the engine fetches both Engram layers of a step with lookup_layers: the drill's delay must
    # not be bypassed there (2 x delay per step, as for two single lookups)
    inner = Rows()
    w = fault.wrap(inner, 25.0)
    t = time.perf_counter()
    got = w.lookup_layers([1, 2], [[1, 2], [3]])
    assert time.perf_counter() - t >= 0.049
    assert [g.tolist() for g in got] == [[2, 4], [6]] and inner.calls == 2
