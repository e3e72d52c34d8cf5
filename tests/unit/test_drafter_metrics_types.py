"""Drafter metrics are real Prometheus types (issue 9): the worker's counters end in ``_total``
with a latency histogram in seconds; rank 0's speculator counters (engine ``/metrics``) are
counters ``dsv41_drafter_<key>_total`` and latency a summary in seconds, no raw ``latency_sum_s``."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsv41.engine.metrics import EngineMetrics
from dsv41.harness import refs


def _families(registry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_engine_exposes_speculator_counters_as_prometheus_types() -> None:
    counters = {
        "rounds": 7,
        "identity_refusals": 0,
        "latency_sum_s": 0.25,
        "latency_count": 5,
        "parity_max_prob_diff": 0.125,
        "source": "remote",
    }
    m = EngineMetrics("t", lambda: {}, lambda: counters)
    fams = _families(m.registry)
    assert fams["dsv41_drafter_rounds"].type == "counter"
    assert [s.name for s in fams["dsv41_drafter_rounds"].samples] == ["dsv41_drafter_rounds_total"]
    lat = fams["dsv41_drafter_propose_latency_seconds"]
    assert lat.type == "summary"
    assert {s.name: s.value for s in lat.samples} == {
        "dsv41_drafter_propose_latency_seconds_count": 5.0,
        "dsv41_drafter_propose_latency_seconds_sum": 0.25,
    }
    assert fams["dsv41_drafter_parity_max_prob_diff"].type == "gauge"
    assert not any("latency_sum_s" in n or "latency_count" in n for n in fams)
    # the reference check reads the same keys as before
    vals = refs.flat_values(generate_latest(m.registry).decode(), "dsv41_drafter_")
    assert vals["rounds"] == 7 and vals["identity_refusals"] == 0


def test_worker_metrics_types() -> None:
    from dsv41.drafter.worker import WorkerMetrics

    w = WorkerMetrics()
    w.rounds.inc()
    w.latency.observe(0.003)
    fams = _families(w.registry)
    assert fams["dsv41_drafter_rounds"].type == "counter" and fams["dsv41_drafter_drafts"].type == "counter"
    assert fams["dsv41_drafter_round_seconds"].type == "histogram"
    assert fams["dsv41_drafter_connections"].type == "gauge"


def _assigned_keys(func) -> set[str]:
    """The string keys ``func`` assigns as ``c["key"] = ...`` (read from its source)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return {
        t.slice.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str)
    }


def test_every_speculator_key_has_its_prometheus_type() -> None:
    """Levels (can go down) are gauges, every monotonic key a counter: the keys come from the
    speculators' own definitions (COUNTER_KEYS, the proxy ring's PROXY_COUNTERS, the keys
    AsyncSpeculator adds at scrape)."""
    from dsv41.drafter.async_speculator import AsyncSpeculator
    from dsv41.drafter.shm import PROXY_COUNTERS
    from dsv41.drafter.speculators import COUNTER_KEYS
    from dsv41.engine.spec_decode import LEVEL_KEYS

    added = _assigned_keys(AsyncSpeculator._counters)
    assert added, "AsyncSpeculator._counters assigns no key: the test reads the wrong function"
    unknown = added - set(COUNTER_KEYS) - LEVEL_KEYS
    assert not unknown, f"keys neither declared monotonic (COUNTER_KEYS) nor levels (LEVEL_KEYS): {unknown}"
    keys = (set(COUNTER_KEYS) - {"latency_sum_s", "latency_count"}) | {f"proxy_{k}" for k in PROXY_COUNTERS} | added
    fams = _families(EngineMetrics("t", lambda: {}, lambda: {k: 1 for k in keys}).registry)
    for k in sorted(keys):
        want = "gauge" if k in LEVEL_KEYS else "counter"
        assert fams[f"dsv41_drafter_{k}"].type == want, k
    # a level that went down reads as its value, not as a counter reset
    vals = refs.flat_values(
        generate_latest(EngineMetrics("t", lambda: {}, lambda: {"proxy_up": 0}).registry).decode(), "dsv41_drafter_"
    )
    assert vals["proxy_up"] == 0
