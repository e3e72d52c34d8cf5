"""Every HTTP server dsv41 runs, started on loopback with small limits: the starters and limits shared by
tests/unit/test_http_servers_every_endpoint.py and the slow-client fuzz campaign (tests/fuzz)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from dsv41 import envs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CAP = 6  # connection cap of every server under test
LIMITS = {
    "DSV41_HTTP_HEADER_TIMEOUT_S": "5",
    "DSV41_HTTP_KEEPALIVE_TIMEOUT_S": "5",
    "DSV41_HTTP_MAX_CONNECTIONS": str(CAP),
    "DSV41_METRICS_MAX_CONNECTIONS": str(CAP),
}


class Engine:
    """The engine API's engine, doing nothing (health and metrics do not reach it)."""

    fatal = None
    frozen = False
    peer_draining = False

    def submit(self, ids, params, sink):
        raise AssertionError("not used")

    def abort(self, rid=None):
        pass

    def freeze(self, frozen):
        pass

    def idle(self):
        return True


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_engine(tmp_path):
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.server import create_app
    from dsv41.httpd import request_limit, uvicorn_limits

    settings = envs.parse(LIMITS)
    app = create_app(Engine(), "m", 64, metrics=EngineMetrics("m", dict), request_limit=request_limit(settings))
    port = _port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off", **uvicorn_limits(settings))
    )
    t = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    t.start()
    end = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < end, "uvicorn did not start"
        time.sleep(0.02)
    from dsv41.engine.api_router import router  # what create_app includes: every route of the API

    paths = sorted(r.path for r in router.routes if "GET" in getattr(r, "methods", ()))

    def stop():
        server.should_exit = True
        t.join(10)

    return ("127.0.0.1", port), paths, stop


def _start_table_server(tmp_path, monkeypatch):
    from dsv41.engram.server import EngramServer

    es = EngramServer(None, tmp_path, ["tcp://127.0.0.1:0"], metrics="127.0.0.1:0")
    es.start_metrics()
    return es.metrics_bound, list(es._http.RequestHandlerClass.GET_PATHS), es.stop


def _start_drafter_metrics(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry

    from dsv41.httpd import serve_metrics

    srv = serve_metrics("127.0.0.1", 0, CollectorRegistry())

    def stop():
        srv.shutdown()
        srv.server_close()

    return srv.server_address[:2], list(srv.RequestHandlerClass.GET_PATHS), stop


def _start_exporter(tmp_path, monkeypatch):
    from dsv41.monitoring.exporter import OpsCollector, serve

    srv, _t = serve("127.0.0.1:0", OpsCollector("", tmp_path / "journal.jsonl"))

    def stop():
        srv.shutdown()
        srv.server_close()

    return srv.server_address[:2], list(srv.RequestHandlerClass.GET_PATHS), stop


#: module of python/dsv41 that builds an HTTP server -> how the test starts it
def _start_overlay_metrics(tmp_path, monkeypatch):
    from dsv41 import envs
    from dsv41.overlay import metrics as OM

    OM.reset()
    srv = OM.start("127.0.0.1:0", envs.parse())

    def stop():
        OM.reset()  # stops it: one endpoint per process, the next test starts its own

    return srv.server_address[:2], list(srv.RequestHandlerClass.GET_PATHS), stop


STARTERS = {
    "dsv41/entrypoints/engine_serve.py": lambda tmp, mp: _start_engine(tmp),
    "dsv41/engram/server.py": _start_table_server,
    "dsv41/drafter/worker.py": _start_drafter_metrics,
    "dsv41/monitoring/exporter.py": _start_exporter,
    "dsv41/overlay/metrics.py": _start_overlay_metrics,
}
