"""Limits on slow and idle clients for every HTTP server dsv41 runs (docs/operations.md, "HTTP
servers and slow clients").

Field report uvicorn#1192: uvicorn arms its keep-alive timer only after a response, so a
connection that sends nothing, or trickles its request head a byte at a time, is held forever
(350 such connections held 350 file descriptors on the lab engine). The library settings cover
the rest and are used as they are: uvicorn's ``timeout_keep_alive`` (idle between requests),
``limit_concurrency`` (503 over the limit) and h11's incomplete-event size bound; what they lack
is a deadline on the request head (and, on the engine API, on its body, which h11 bounds only in
size), which :func:`uvicorn_protocol` adds to uvicorn's own h11 protocol. The standard library's ``http.server`` (the table server's and drafter worker's
``/metrics``) gets the same head deadline and a connection cap from :class:`BoundedHTTPServer`.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from http.server import ThreadingHTTPServer

log = logging.getLogger(__name__)

#: Per-request bound on h11's buffered incomplete head (bytes): uvicorn's default, stated.
H11_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024


def uvicorn_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol class with a request deadline: the head and the body of each
    request must arrive complete within ``header_timeout_s`` seconds of the connection opening or
    of the previous response ending, else the connection is closed (a body that trickles in is
    bounded in time, not only in size; the application sees the client disconnect). Once the
    whole request is in, its handling and response (a long SSE stream too) are not timed. Pass
    the class as ``uvicorn.Config(http=...)``. Raises ValueError for a non-positive timeout."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # the client is still sending its request: nothing yet (IDLE) or the body (SEND_BODY)
    _INCOMPLETE = (h11.IDLE, h11.SEND_BODY)

    class HeadDeadlineH11Protocol(H11Protocol):
        """uvicorn's H11Protocol plus the head deadline (module docstring, uvicorn#1192)."""

        head_timeout_s = header_timeout_s
        _head_timer = None

        def _arm_head(self) -> None:
            self._cancel_head()
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

        def _cancel_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing() and self.conn.their_state in _INCOMPLETE:
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state not in _INCOMPLETE:  # the whole request (head and body) is in
                self._cancel_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head()

        def connection_lost(self, exc) -> None:
            self._cancel_head()
            super().connection_lost(exc)

    return HeadDeadlineH11Protocol


def uvicorn_limits(settings) -> dict:
    """The ``uvicorn.Config`` keyword arguments of the HTTP limits in ``settings`` (a
    ``dsv41.envs.Settings``): ``http`` (:func:`uvicorn_protocol`), ``timeout_keep_alive``,
    ``limit_concurrency``, ``h11_max_incomplete_event_size``."""
    return {"http": uvicorn_protocol(settings.http_header_timeout_s),
            "timeout_keep_alive": settings.http_keepalive_timeout_s,
            "limit_concurrency": settings.http_max_connections,
            "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_EVENT_SIZE}


class BoundedHTTPServer(ThreadingHTTPServer):
    """``http.server.ThreadingHTTPServer`` (daemon threads) for small endpoints like
    ``/metrics``, with two bounds:

    - ``header_timeout_s``: each request's head (request line and headers) must arrive within it
      of the connection's start, else the socket is shut down and the handler thread ends; the
      same value is the socket timeout of every later read and write (a client that stops
      reading the answer).
    - ``max_connections``: a connection arriving while this many are open is closed at once,
      unanswered (one thread per connection, so this bounds threads and descriptors too).

    The handler class must come from :func:`bounded_handler`. ``address`` is ``(host, port)``;
    an IPv6 host (with ``:``) listens on AF_INET6. Raises OSError when it cannot listen.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler, header_timeout_s: float, max_connections: int) -> None:
        if not header_timeout_s > 0 or max_connections < 1:
            raise ValueError("header_timeout_s must be > 0 and max_connections >= 1")
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.open_connections = 0
        self.refused_total = 0
        self._count = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._count:
            full = self.open_connections >= self.max_connections
            if not full:
                self.open_connections += 1
        if full:
            self.refused_total += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def handle_error(self, request, client_address) -> None:
        """One log line instead of socketserver's traceback on stderr (the service's journal): a
        client that went away mid-answer (EPIPE, ECONNRESET) or was cut by the socket timeout is
        routine and logged at debug level; anything else is a warning naming the client and error."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("http client %s went away: %s", client_address, exc)
        else:
            log.warning("http request from %s failed: %s: %s", client_address, type(exc).__name__, exc)

    def _done(self) -> None:
        with self._count:
            self.open_connections -= 1


def bounded_handler(base):
    """A subclass of ``base`` (a ``BaseHTTPRequestHandler`` class) that enforces its
    :class:`BoundedHTTPServer`'s head deadline: a timer shuts the socket down when the request
    head is not complete in time (a total deadline, not per read, so trickled bytes do not
    extend it)."""

    class Bounded(base):
        def setup(self):
            self.timeout = self.server.header_timeout_s  # socket timeout of every read and write
            super().setup()

        def handle_one_request(self):
            timer = threading.Timer(self.server.header_timeout_s, self._cut)
            timer.daemon = True
            self._head_timer = timer
            timer.start()
            try:
                super().handle_one_request()
            finally:
                timer.cancel()

        def parse_request(self):
            ok = super().parse_request()  # reads the header lines too
            self._head_timer.cancel()  # the head is in
            return ok

        def _cut(self):
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


def serve_metrics(host: str, port: int, registry, settings=None) -> BoundedHTTPServer:
    """Serve prometheus_client's ``MetricsHandler`` for ``registry`` on ``host:port`` from a
    daemon thread, bounded as :class:`BoundedHTTPServer` by ``settings`` (a
    ``dsv41.envs.Settings``; default :func:`dsv41.envs.parse`): ``DSV41_HTTP_HEADER_TIMEOUT_S``,
    ``DSV41_METRICS_MAX_CONNECTIONS``. Returns the server (``shutdown()`` then
    ``server_close()`` to stop). Raises OSError when it cannot listen."""
    from prometheus_client.exposition import MetricsHandler

    from dsv41 import envs

    s = settings if settings is not None else envs.parse()
    srv = BoundedHTTPServer((host, port), bounded_handler(MetricsHandler.factory(registry)), s.http_header_timeout_s,
                            s.metrics_max_connections)
    threading.Thread(target=srv.serve_forever, name="metrics-http", daemon=True).start()
    return srv
