"""The overlay's per-rank endpoint (dsv41.overlay.metrics) over real HTTP on loopback, its names
against the stand-in engine's, the plugin starting it in the process that imports vLLM's GPU
model runner (and only there), and the stderr handler the plugin gives the dsv41 logger inside
``vllm serve``."""

from __future__ import annotations

import http.client
import importlib
import logging
import socket
import sys

import pytest

from dsv41.engine.metrics import ENGRAM_KEYS, EngineMetrics
from dsv41.errors import Dsv41Error
from dsv41.harness import http as H, rank_metrics as RM
from dsv41.overlay import hooks, metrics as M, plugin


class Source:
    """A RowSource's counters() (dsv41.engram.client.RemoteRowSource's keys)."""

    def __init__(self, **c) -> None:
        self.c = {k: 0 for k in ENGRAM_KEYS} | {"latency_sum_s": 0.5, "latency_count": 4, "url": "tcp://x:1"} | c

    def counters(self) -> dict:
        return dict(self.c)


class Rows:
    """A RemoteRows' per-layer pipeline counters."""

    counters = {"starts": 5, "handoffs": 5, "worker_refusals": 0, "handoff_timeouts": 1}


@pytest.fixture(autouse=True)
def clean():
    M.reset()
    yield
    M.reset()


def _get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request(method, path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def _start() -> int:
    srv = M.start("127.0.0.1:0")
    assert srv is not None
    return srv.server_address[1]


def test_metrics_and_health_over_http():
    M.set_state("active", rank=1)
    M.add_engram_source(1, Source(lookups=7, fallbacks=2, reconnects=3, transport_errors=1, refusals=4))
    M.add_layer(1, 3, Rows())
    M.add_drafter(lambda: {"rounds": 9, "identity_refusals": 0, "latency_sum_s": 0.2, "latency_count": 9})
    port = _start()
    code, text = _get(port, "/metrics?x=1")  # a query string is accepted
    assert code == 200
    samples = {(n, tuple(sorted(lb.items()))): v for n, lb, v in H.metric_samples(text)}
    assert samples[("dsv41_engram_lookups_total", (("rank", "1"),))] == 7
    assert samples[("dsv41_engram_fallbacks_total", (("rank", "1"),))] == 2
    assert samples[("dsv41_engram_reconnects_total", (("rank", "1"),))] == 3
    assert samples[("dsv41_engram_transport_errors_total", (("rank", "1"),))] == 1
    assert samples[("dsv41_engram_refusals_total", (("rank", "1"),))] == 4
    assert (
        samples[("dsv41_overlay_layer_events_total", (("event", "handoff_timeouts"), ("layer", "3"), ("rank", "1")))]
        == 1
    )
    assert samples[("dsv41_drafter_rounds_total", ())] == 9
    assert _impl(text) in ("c++", "python")
    assert RM.overlay_states(text) == {"1": {"state": "active", "transport": _impl(text)}}
    assert _get(port, "/health?probe=1") == (200, "active\n")


def _impl(text: str) -> str:
    return next(lb["implementation"] for n, lb, _ in H.metric_samples(text) if n == "dsv41_overlay_transport_info")


def test_transport_implementation_is_reported(monkeypatch):
    from dsv41.transport import native

    port = _start()
    monkeypatch.setattr(native, "_fastrow", None)  # an image without the C++ extension
    assert _impl(_get(port, "/metrics")[1]) == "python"
    monkeypatch.setenv("DSV41_TRANSPORT_PURE", "1")
    assert _impl(_get(port, "/metrics")[1]) == "python"


@pytest.mark.parametrize(
    "state, exported",
    [("active", "active"), ("inert", "inert"), ("contract-mismatch", "refused"), ("refused", "refused")],
)
def test_state_is_one_labelled_gauge(state, exported):
    M.set_state(state, rank=0)
    text = _get(_start(), "/metrics")[1]
    on = [lb["state"] for n, lb, v in H.metric_samples(text) if n == "dsv41_overlay_state" and v == 1]
    off = {lb["state"] for n, lb, v in H.metric_samples(text) if n == "dsv41_overlay_state" and v == 0}
    assert on == [exported] and off == set(M.STATES) - {exported}


def test_read_only_and_only_two_paths():
    port = _start()
    assert _get(port, "/")[0] == 404
    assert _get(port, "/metrics/../x")[0] == 404
    for method in ("POST", "PUT", "DELETE"):
        assert _get(port, "/metrics", method)[0] == 405
    assert _get(port, "/health", "HEAD")[0] == 200


def test_started_once_per_process():
    a = M.start("127.0.0.1:0")
    assert M.start("127.0.0.1:0") is a


def test_bad_address_is_one_error_and_a_taken_port_does_not_stop_serving(caplog):
    with pytest.raises(Dsv41Error, match="DSV41_OVERLAY_METRICS_ADDR must be HOST:PORT"):
        M.start("http://127.0.0.1:1/")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        with caplog.at_level(logging.ERROR, logger="dsv41.overlay"):
            assert M.start(f"127.0.0.1:{s.getsockname()[1]}") is None
        assert "cannot serve metrics" in caplog.text
    finally:
        s.close()


def test_engram_names_are_the_stand_in_engines():
    """Readers never branch on the runtime: the same Engram families, types and labels."""
    M.add_engram_source(0, Source(lookups=1))
    overlay = {
        (n, tuple(sorted(lb)))
        for n, lb, _ in H.metric_samples(_get(_start(), "/metrics")[1])
        if n.startswith("dsv41_engram_")
    }
    from prometheus_client import generate_latest

    eng = EngineMetrics("m", lambda: {0: Source(lookups=1).counters()})
    engine = {
        (n, tuple(sorted(lb)))
        for n, lb, _ in H.metric_samples(generate_latest(eng.registry).decode())
        if n.startswith("dsv41_engram_")
    }
    assert overlay == engine


# ---- the plugin: the endpoint in the worker only; the dsv41 logger's handler -----------------------


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A package tree with vLLM's GPU model runner module path (no vLLM distribution: the plugin
    stays inert), importable for this test only."""
    d = tmp_path / "vllm" / "v1" / "worker" / "gpu"
    d.mkdir(parents=True)
    for p in (tmp_path / "vllm", tmp_path / "vllm" / "v1", tmp_path / "vllm" / "v1" / "worker", d):
        (p / "__init__.py").write_text("")
    (d / "model_runner.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    hooks._pending.pop(hooks.MODEL_RUNNER_MODULE, None)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_plugin_serves_the_state_once_the_worker_imports_the_model_runner(fake_vllm, monkeypatch):
    port = _free_port()
    monkeypatch.setenv("DSV41_OVERLAY_METRICS_ADDR", f"127.0.0.1:{port}")
    monkeypatch.setenv("DSV41_OVERLAY_RANK", "1")
    for k in ("DSV41_ENGRAM_REMOTE", "DSV41_DRAFTER_REMOTE"):
        monkeypatch.delenv(k, raising=False)
    plugin.register()  # what vLLM's API and engine-core processes run too: nothing listens yet
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    importlib.import_module(hooks.MODEL_RUNNER_MODULE)  # the worker
    assert _get(port, "/health") == (200, "inert\n")
    assert RM.overlay_states(_get(port, "/metrics")[1])["1"]["state"] == "inert"


def test_plugin_refuses_a_bad_metrics_address_at_register(monkeypatch):
    monkeypatch.setenv("DSV41_OVERLAY_METRICS_ADDR", "not an address")
    with pytest.raises(Dsv41Error, match="DSV41_OVERLAY_METRICS_ADDR"):
        plugin.register()


@pytest.fixture
def bare_logging():
    """The dsv41 logger as vLLM leaves it (no handler, no level); the root logger's handlers (pytest
    adds its own for each test phase) are emptied inside each test body, as vLLM leaves them."""
    dl = logging.getLogger("dsv41")
    saved = (dl.handlers[:], dl.level)
    dl.handlers[:] = []
    dl.setLevel(logging.NOTSET)
    yield dl
    dl.handlers[:] = saved[0]
    dl.setLevel(saved[1])


def test_logger_handler_makes_info_lines_visible_inside_vllm(bare_logging, capfd):
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = []
    try:
        h = plugin.ensure_log_handler()
        assert h is not None and bare_logging.handlers == [h]
        logging.getLogger("dsv41.overlay").info("dsv41 overlay active (vLLM %s)", "0.33.0")
        assert plugin.ensure_log_handler() is None and bare_logging.handlers == [h]  # once
    finally:
        root.handlers[:] = saved
    assert "dsv41 overlay active (vLLM 0.33.0)" in capfd.readouterr().err


def test_logger_handler_leaves_a_configured_logger_alone(bare_logging):
    mine = logging.NullHandler()
    logging.getLogger().addHandler(mine)
    try:
        assert plugin.ensure_log_handler() is None and bare_logging.handlers == []
    finally:
        logging.getLogger().removeHandler(mine)
