"""The overlay's per-rank Prometheus endpoint inside ``vllm serve``.

Under vLLM nothing of the overlay reaches rank 0's API ``/metrics`` (the counters live in each
rank's worker process, and rank 1 runs headless on the other Spark), so each rank's worker
serves its own ``GET /metrics`` and ``GET /health`` on ``DSV41_OVERLAY_METRICS_ADDR``
(``HOST:PORT``, the Spark's management address; roles/serve passes
``dsv41_overlay_metrics_port``).  Read-only: any other method is 405, any other path 404; a
query string is ignored.

Names are the stand-in engine's (:mod:`dsv41.engine.metrics`, the same collector classes), so
a reader never branches on the runtime:

* ``dsv41_engram_<key>_total{rank}`` for ``ENGRAM_KEYS`` (lookups, rows, fallbacks,
  transport_errors, refusals, reconnects, deadline_exceeded), the latency summary
  ``dsv41_engram_lookup_latency_seconds{rank}`` and the scale-byte / non-finite counters;
* ``dsv41_drafter_<key>_total`` (rank 0's speculator counters; no rank label, as on the engine);

and the overlay's own:

* ``dsv41_overlay_state{rank, state}``: 1 for the state this rank is in, 0 for the others
  (:data:`STATES`: ``active``, ``inert``, ``refused``);
* ``dsv41_overlay_transport_info{rank, implementation}``: 1, ``implementation`` ``c++`` or
  ``python`` (:func:`dsv41.transport.native.implementation`);
* ``dsv41_overlay_layer_events_total{rank, layer, event}``: each Engram layer's pipeline
  counters (``RemoteRows.counters``: starts, handoffs, worker_refusals, handoff_timeouts, ...).

:func:`start` binds once per process; the plugin calls it from the worker only (the process that
imports vLLM's GPU model runner), so one host runs one endpoint per rank.  A port in use is
logged, not raised: serving never stops because its metrics cannot listen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dsv41 import httpd
from dsv41.engine.metrics import _DrafterCollector, _EngramCollector

log = logging.getLogger("dsv41.overlay")

#: The values of ``dsv41_overlay_state``'s ``state`` label.
STATES = ("active", "inert", "refused")
#: The plugin's internal states (``plugin.STATE``) -> :data:`STATES`.
PLUGIN_STATES = {
    "active": "active",
    "inert": "inert",
    "contract-mismatch": "refused",
    "unregistered": "inert",
    "refused": "refused",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_lock = threading.Lock()
_engram: dict[int, Any] = {}  # rank -> RowSource (counters())
_layers: dict[tuple[int, int], Any] = {}  # (rank, layer id) -> RemoteRows (counters dict)
_drafter: list[Callable[[], dict]] = []
_state: dict[str, Any] = {"rank": 0, "state": "inert", "why": ""}
_server: list[Any] = []


def set_state(state: str, rank: int | None = None, why: str = "") -> None:
    """Record this rank's overlay state (``state``: a key of :data:`PLUGIN_STATES`); ``why``:
    the first problem of a refusal (logged by the plugin, exported nowhere else)."""
    with _lock:
        _state["state"] = PLUGIN_STATES.get(state, "refused")
        _state["why"] = why
        if rank is not None:
            _state["rank"] = int(rank)


def add_engram_source(rank: int, source: Any) -> None:
    """Export ``source.counters()`` (a ``RowSource``) as rank ``rank``'s Engram counters."""
    with _lock:
        _engram[int(rank)] = source
        _state["rank"] = int(rank)


def add_layer(rank: int, layer_id: int, rows: Any) -> None:
    """Export ``rows.counters`` (an ``engram_rows.RemoteRows``) as ``layer_id``'s pipeline events."""
    with _lock:
        _layers[(int(rank), int(layer_id))] = rows


def add_drafter(counters: Callable[[], dict]) -> None:
    """Export ``counters()`` (the overlay speculator's, rank 0) as ``dsv41_drafter_*``."""
    with _lock:
        _drafter.append(counters)


def reset() -> None:
    """Forget every source and stop the endpoint (tests; a process serves one model)."""
    with _lock:
        _engram.clear()
        _layers.clear()
        _drafter.clear()
        _state.update(rank=0, state="inert", why="")
        servers = list(_server)
        _server.clear()
    for srv in servers:
        srv.shutdown()
        srv.server_close()


class OverlayCollector:
    """The collector behind the endpoint (see the module docstring for the series)."""

    def collect(self):
        from dsv41.transport import native

        with _lock:
            rank, state = _state["rank"], _state["state"]
            engram, layers, drafter = dict(_engram), dict(_layers), list(_drafter)
        st = GaugeMetricFamily(
            "dsv41_overlay_state", "The overlay's state on this rank (1 = current)", labels=["rank", "state"]
        )
        for s in STATES:
            st.add_metric([str(rank), s], 1.0 if s == state else 0.0)
        yield st
        try:
            impl = native.implementation()
        except Exception as exc:  # noqa: BLE001 - a bad DSV41_TRANSPORT_PURE must not break /metrics
            impl = f"error: {exc}"[:80]
        yield _info(rank, impl)
        yield from _EngramCollector(lambda: {r: s.counters() for r, s in engram.items()}).collect()
        ev = CounterMetricFamily(
            "dsv41_overlay_layer_events",
            "Engram layer pipeline events per rank and layer",
            labels=["rank", "layer", "event"],
        )
        for (r, layer), rows in sorted(layers.items()):
            for k, v in sorted(dict(getattr(rows, "counters", {}) or {}).items()):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    ev.add_metric([str(r), str(layer), str(k)], float(v))
        yield ev
        if drafter:
            yield from _DrafterCollector(lambda: _merged(drafter)).collect()


def _info(rank: int, impl: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(
        "dsv41_overlay_transport_info",
        "The transport implementation this rank imported",
        labels=["rank", "implementation"],
    )
    g.add_metric([str(rank), impl], 1.0)
    return g


def _merged(sources: list[Callable[[], dict]]) -> dict:
    out: dict = {}
    for fn in sources:
        out.update(fn() or {})
    return out


def registry() -> CollectorRegistry:
    """A registry holding one :class:`OverlayCollector`."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(OverlayCollector())
    return reg


def _handler(reg: CollectorRegistry) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "dsv41-overlay"
        #: the GET endpoints (tests enumerate them)
        GET_PATHS = ("/metrics", "/health")

        def _reply(self, code: int, body: bytes, ctype: str = CONTENT_TYPE, head: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _get(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(reg), head=head)
            elif path == "/health":
                with _lock:
                    body = f"{_state['state']}\n".encode()
                self._reply(200, body, "text/plain; charset=utf-8", head)
            else:  # OpenAI's error shape (dsv41.httpd.bounded_handler's send_error)
                self.send_error(404, "not found: GET /metrics or /health")

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._get(False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._get(True)

        def _refuse(self) -> None:
            self.send_response(405)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815 - read-only

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("overlay metrics: " + fmt, *args)

    return Handler


def start(addr: str, settings: Any = None) -> Any:
    """Serve the endpoint on ``addr`` (``HOST:PORT``; port 0 picks one) from a daemon thread,
    once per process: a second call returns the running server.  Bounded like every dsv41
    ``/metrics`` (:class:`dsv41.httpd.BoundedHTTPServer`, ``settings``: a
    :class:`dsv41.envs.Settings`).  Returns the server (``server_address`` has the port), or None
    when it cannot listen (logged once: serving goes on).  Raises ``Dsv41Error`` for an ``addr``
    that is not ``HOST:PORT``."""
    from dsv41 import envs
    from dsv41.engram.server import parse_hostport

    host, port = parse_hostport(addr, "DSV41_OVERLAY_METRICS_ADDR")
    with _lock:
        if _server:
            return _server[0]
        s = settings if settings is not None else envs.parse()
        try:
            srv = httpd.BoundedHTTPServer(
                (host, port),
                httpd.bounded_handler(_handler(registry())),
                s.http_header_timeout_s,
                s.metrics_max_connections,
            )
        except OSError as exc:
            log.error(
                "dsv41 overlay: cannot serve metrics on %s: %s (the checks will report this rank's "
                "endpoint unreachable)",
                addr,
                exc.strerror or exc,
            )
            return None
        _server.append(srv)
    threading.Thread(target=srv.serve_forever, name="dsv41-overlay-metrics", daemon=True).start()
    log.info("dsv41 overlay rank %d metrics on http://%s:%d/metrics", _state["rank"], host, srv.server_address[1])
    return srv
