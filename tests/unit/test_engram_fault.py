"""The fault-injection knob of window drills: DSV41_ENGRAM_FAULT_DELAY_MS on the local row source
(``LocalRowSource(fault_delay_ms=)``; the remote source's own delay: test_remote_client.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from dsv41 import envs
from dsv41.engram.rowsource import LocalRowSource


class Reader:
    """A LocalRowReader double: rows are the ids times two."""

    def __init__(self):
        self.calls = 0
        self.closed = False

    def read(self, layer_id, rows, out=None):
        self.calls += 1
        return np.asarray(rows) * 2

    def close(self):
        self.closed = True


def test_off_by_default_and_delay_applied():
    assert envs.parse({}).engram_fault_delay_ms == 0.0
    off = LocalRowSource(Reader(), envs.parse({}).engram_fault_delay_ms)
    assert "fault_delay_ms" not in off.counters()
    inner = Reader()
    w = LocalRowSource(inner, envs.parse({"DSV41_ENGRAM_FAULT_DELAY_MS": "30"}).engram_fault_delay_ms)
    t = time.perf_counter()
    out = w.lookup(1, [1, 2])
    assert time.perf_counter() - t >= 0.029
    assert out.tolist() == [2, 4]  # rows unchanged: only time is added
    c = w.counters()
    assert (c["lookups"], c["rows"], c["fault_delay_ms"]) == (1, 2, 30.0)
    assert c["latency_sum_s"] < 0.029  # the delay is not the reader's latency
    w.close()
    assert inner.closed


@pytest.mark.parametrize("delay", [-1.0, float("nan"), float("inf")])
def test_local_source_refuses_a_bad_delay(delay):
    from dsv41.errors import Dsv41Error

    with pytest.raises(Dsv41Error, match="fault_delay_ms must be a finite number >= 0"):
        LocalRowSource(Reader(), delay)


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "inf", "20000"])
def test_bad_values_name_the_variable(raw):
    with pytest.raises(envs.ConfigError, match="^DSV41_ENGRAM_FAULT_DELAY_MS"):
        envs.parse({"DSV41_ENGRAM_FAULT_DELAY_MS": raw})


def test_row_source_from_env_carries_the_delay(tmp_path):
    from dsv41.engram import sources
    from dsv41.engram.synthetic import write_synthetic_tables

    cfg = str(Path(__file__).resolve().parents[2] / "python" / "dsv41" / "data" / "lab_model.json")
    write_synthetic_tables(cfg, tmp_path, 5)
    s = envs.parse({"DSV41_ENGRAM_FAULT_DELAY_MS": "1"})
    src = sources.from_env(str(tmp_path / "manifest.json"), tmp_path, 0, 1, settings=s)
    assert isinstance(src, LocalRowSource) and src.counters()["fault_delay_ms"] == 1.0
    src.close()
    src = sources.from_env(str(tmp_path / "manifest.json"), tmp_path, 0, 1, settings=envs.parse({}))
    assert src.fault_delay_s == 0 and "fault_delay_ms" not in src.counters()
    src.close()


def test_delay_applies_per_layer_to_lookup_layers():
    # the engine fetches both Engram layers of a step with lookup_layers: the drill's delay must
    # not be bypassed there (2 x delay per step, as for two single lookups)
    inner = Reader()
    w = LocalRowSource(inner, 25.0)
    t = time.perf_counter()
    got = w.lookup_layers([1, 2], [[1, 2], [3]])
    assert time.perf_counter() - t >= 0.049
    assert [g.tolist() for g in got] == [[2, 4], [6]] and inner.calls == 2
