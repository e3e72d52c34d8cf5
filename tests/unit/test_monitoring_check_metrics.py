"""`promtool check metrics` on every dsv41 service's /metrics text (built in process, as each
service builds it): no lint problems except vLLM's own names on rank 0's API, which contain ':'
(``vllm:...``; kept so that vLLM's dashboards and rules work unchanged)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest


def promtool() -> str:
    p = shutil.which("promtool")
    if p is None:
        pytest.fail("promtool not found: install Debian's prometheus package (tools/install_prometheus.sh)")
    return p


def _engine() -> bytes:
    from dsv41.engine.metrics import ENGRAM_KEYS, EngineMetrics

    per_rank = {r: {**{k: 3 for k in ENGRAM_KEYS}, "latency_count": 3, "latency_sum_s": 0.01} for r in (0, 1)}
    drafter = {
        "rounds": 5,
        "fail_closed_rounds": 1,
        "proxy_respawns": 0,
        "watchdog_fires": 0,
        "proxy_gave_up": 0,
        "identity_refusals": 0,
        "latency_sum_s": 0.1,
        "latency_count": 5,
        "parity_max_prob_diff": 0.0,
    }
    m = EngineMetrics("dsv41-lab", lambda: per_rank, lambda: drafter)
    m.ttft.observe(0.05)
    m.itl.observe(0.01)
    m.finished("length")
    return generate_latest(m.registry)


def _table_server(tmp_path) -> bytes:
    from dsv41.engram.server import EngramServer, _Collector

    es = EngramServer(None, tmp_path, ["tcp://127.0.0.1:0"])
    reg = CollectorRegistry()
    reg.register(_Collector(es))
    return generate_latest(reg)


def _drafter_worker() -> bytes:
    from dsv41.drafter.worker import WorkerMetrics

    m = WorkerMetrics()
    m.info.labels("d" * 64, "m" * 64, "t" * 64, "torch").set(1)
    m.refusals.labels("identity_mismatch").inc()
    m.latency.observe(0.002)
    return generate_latest(m.registry)


def _ops(tmp_path) -> bytes:
    from dsv41.monitoring.exporter import OpsCollector

    reg = CollectorRegistry()
    reg.register(OpsCollector("http://127.0.0.1:9", tmp_path / "journal.jsonl", timeout_s=0.3))
    return generate_latest(reg)


def _overlay() -> bytes:
    """A vLLM rank's overlay endpoint (dsv41.overlay.metrics): Engram, layer, drafter and state."""
    from dsv41.engine.metrics import ENGRAM_KEYS
    from dsv41.overlay import metrics as M

    class Source:
        def counters(self):
            return {**{k: 3 for k in ENGRAM_KEYS}, "latency_count": 3, "latency_sum_s": 0.01, "url": "tcp://x:1"}

    class Rows:
        counters = {"starts": 4, "handoffs": 4}

    M.reset()
    try:
        M.set_state("active", rank=0)
        M.add_engram_source(0, Source())
        M.add_layer(0, 3, Rows())
        M.add_drafter(lambda: {"rounds": 5, "fail_closed_rounds": 1, "latency_sum_s": 0.1, "latency_count": 5})
        return generate_latest(M.registry())
    finally:
        M.reset()


@pytest.mark.parametrize("service", ["engine", "table_server", "drafter_worker", "ops_exporter", "overlay"])
def test_promtool_check_metrics(service, tmp_path):
    text = {"engine": _engine, "drafter_worker": _drafter_worker, "overlay": _overlay}.get(service)
    text = text() if text else {"table_server": _table_server, "ops_exporter": _ops}[service](tmp_path)
    r = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, timeout=60)
    problems = [ln for ln in (r.stdout + r.stderr).decode().splitlines() if ln.strip()]
    allowed = [p for p in problems if p.startswith("vllm:") and p.endswith("metric names should not contain ':'")]
    assert [p for p in problems if p not in allowed] == [], problems
    if service == "engine":
        assert allowed, "rank 0's API should export vLLM's vllm:* names"
    else:
        assert r.returncode == 0 and problems == []
