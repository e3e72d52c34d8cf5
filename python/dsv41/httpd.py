"""Limits on slow and idle clients for every HTTP server dsv41 runs (docs/operations.md, "HTTP
servers and slow clients").

Field report uvicorn#1192: uvicorn arms its keep-alive timer only after a response, so a
connection that sends nothing, or trickles its request head a byte at a time, is held forever
(350 such connections held 350 file descriptors on the lab engine). The library settings cover
the rest and are used as they are: uvicorn's ``timeout_keep_alive`` (idle between requests) and
h11's incomplete-event size bound; what they lack is a deadline on the request head (and, on the
engine API, on its body, which h11 bounds only in size) and on a client that stops reading its
answer, which :func:`uvicorn_protocol` adds to uvicorn's own h11 protocol. The standard library's
``http.server`` (the table server's and drafter worker's ``/metrics``, the operations exporter)
gets the same head deadline and a connection cap from :class:`BoundedHTTPServer`. uvicorn's
``limit_concurrency`` is not used (it answered 503 to ``/health`` once idle connections filled it).

Connection caps never let idle clients starve health (:class:`ConnectionBook`, shared by both
kinds of server): a connection waiting for its next request is *idle* and is closed to make room
for a new one when the server is full, oldest first, and one client (one address) may hold at most
its share of the connections. A connection refused because every open one is busy answering is
told so in one HTTP 503 (OpenAI's error shape, ``Retry-After``), never closed unanswered. On the
engine API, requests other than health and metrics are shed by :class:`ShedRequests` (429 over a
client's share, 503 over the total) below the connection cap, so ``/health`` and ``/metrics``
always find room.
"""

from __future__ import annotations

import collections
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from dsv41 import fileio

log = logging.getLogger(__name__)

#: Per-request bound on h11's buffered incomplete head (bytes): uvicorn's default, stated.
H11_MAX_INCOMPLETE_EVENT_SIZE = 16 * 1024

#: Seconds a client refused for load is told to wait (``Retry-After``).
RETRY_AFTER_S = 1
#: Paths answered whatever the load: liveness, readiness, metrics, admission state, model list.
#: Query strings do not matter (they are not part of the path).
ALWAYS_ANSWERED = frozenset({"/health", "/ready", "/metrics", "/is_paused", "/v1/models", "/ping", "/version"})

_ERROR_TYPES = {
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def http_error_body(status: int, message: str) -> bytes:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
    etype = _ERROR_TYPES.get(status, "BadRequestError")
    return fileio.dumps_json({"error": {"message": message, "type": etype, "param": None, "code": status}}).encode()


def overload_body(status: int, message: str) -> bytes:
    """OpenAI's error object for a request shed for load (429 or 503), as JSON bytes."""
    return http_error_body(status, message)


def raw_503(message: str) -> bytes:
    """A whole HTTP/1.1 503 response (OpenAI error JSON, ``Retry-After``, ``Connection: close``):
    what a connection refused before any request was read is sent."""
    body = overload_body(503, message)
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def client_share(limit: int, per_client: int = 0) -> int:
    """One client's share of ``limit``: ``per_client`` when positive, else a quarter of
    ``limit`` (at least 1), so no single client (address) can take everything."""
    return max(1, per_client if per_client > 0 else limit // 4)


#: An idle connection younger than this (seconds) is never closed to make room: a newcomer does
#: not push out one that has only just arrived (a health probe about to send its request).
MIN_IDLE_AGE_S = 0.5


class ConnectionBook:
    """The open connections of one server, by client address, oldest first (thread-safe).

    Each connection is an object with ``is_idle() -> bool`` (waiting for its next request) and
    ``evict()`` (close it; may be called from another thread). :meth:`admit` takes a new one:
    when its client already holds ``per_client`` connections, that client's oldest idle one is
    evicted (none idle: refused); when the server holds ``max_connections``, the oldest idle one
    of the client holding most is evicted (none idle: refused). Only connections open for at
    least ``min_idle_age_s`` (default :data:`MIN_IDLE_AGE_S`; servers use a quarter of their head
    deadline when that is shorter) are evicted. So idle connections never keep a
    new client out, and one client can never hold more than its share. Counters:
    ``evicted_total``, ``refused_total``.
    """

    def __init__(self, max_connections: int, per_client: int = 0, min_idle_age_s: float = MIN_IDLE_AGE_S) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.min_idle_age_s = min_idle_age_s
        self.max_connections = max_connections
        self.per_client = client_share(max_connections, per_client)
        self._open: collections.OrderedDict = collections.OrderedDict()  # connection -> client
        self._since: dict = {}  # connection -> time.monotonic() when admitted
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self.evicted_total = 0
        self.refused_total = 0

    def __len__(self) -> int:
        return len(self._open)

    def _oldest_idle(self, client: str | None):
        old_enough = time.monotonic() - self.min_idle_age_s
        for conn, who in self._open.items():
            if self._since[conn] > old_enough:
                return None  # oldest first: the rest are younger still
            if (client is None or who == client) and conn.is_idle():
                return conn
        return None

    def _drop(self, conn) -> None:
        self._since.pop(conn, None)
        who = self._open.pop(conn)
        self._counts[who] -= 1
        if self._counts[who] <= 0:
            del self._counts[who]

    def admit(self, client: str, conn) -> bool:
        """Record ``conn`` of ``client``; False when it must be refused (see the class)."""
        victims = []
        with self._lock:
            if self._counts[client] >= self.per_client:
                v = self._oldest_idle(client)
                if v is None:
                    self.refused_total += 1
                    return False
                self._drop(v)
                victims.append(v)
            if len(self._open) >= self.max_connections:
                v = None
                for who, _n in self._counts.most_common():
                    v = self._oldest_idle(who)
                    if v is not None:
                        break
                if v is None:
                    self.refused_total += 1
                    for x in victims:  # keep the evicted one of this client: nothing was gained
                        self._open[x] = client
                        self._since[x] = 0.0
                        self._counts[client] += 1
                    return False
                self._drop(v)
                victims.append(v)
            self._open[conn] = client
            self._since[conn] = time.monotonic()
            self._counts[client] += 1
            self.evicted_total += len(victims)
        for v in victims:
            v.evict()
        return True

    def release(self, conn) -> None:
        """Forget ``conn`` (closed); no-op when it was evicted or never admitted."""
        with self._lock:
            if conn in self._open:
                self._drop(conn)


class ShedRequests:
    """ASGI middleware shedding requests, not health: requests to paths outside
    :data:`ALWAYS_ANSWERED` are admitted while fewer than ``max_requests`` are in flight and
    fewer than the client's share (:func:`client_share` of ``max_requests``, ``per_client``) are
    its own; over the share 429, over the total 503, both in OpenAI's error shape with
    ``Retry-After``. A streamed response counts until it ends. Counters: ``in_flight``,
    ``shed_total``."""

    def __init__(self, app, max_requests: int, per_client: int = 0) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.app, self.max_requests = app, max_requests
        self.per_client = client_share(max_requests, per_client)
        self.in_flight = 0
        self._by_client: collections.Counter = collections.Counter()
        self.shed_total = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in ALWAYS_ANSWERED:
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("?", 0))[0]
        if self._by_client[client] >= self.per_client:
            return await self._shed(
                send, 429, f"too many requests in flight from this client ({self.per_client}); retry later"
            )
        if self.in_flight >= self.max_requests:
            return await self._shed(
                send, 503, f"the server is at its limit of {self.max_requests} requests; retry later"
            )
        self.in_flight += 1
        self._by_client[client] += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self._by_client[client] -= 1
            if self._by_client[client] <= 0:
                del self._by_client[client]

    async def _shed(self, send, status: int, message: str) -> None:
        self.shed_total += 1
        body = overload_body(status, message)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def uvicorn_protocol(header_timeout_s: float, max_connections: int = 0, per_client: int = 0):
    """uvicorn's h11 protocol class with a request deadline: the head and the body of each
    request must arrive complete within ``header_timeout_s`` seconds of the connection opening or
    of the previous response ending, else the connection is closed (a body that trickles in is
    bounded in time, not only in size; the application sees the client disconnect). Once the
    whole request is in, its handling and response (a long SSE stream too) are not timed.
    ``max_connections`` > 0: the connections are kept in one :class:`ConnectionBook` (its
    ``book`` attribute) with ``per_client``; a refused connection is answered :func:`raw_503`.
    Pass the class as ``uvicorn.Config(http=...)``. Raises ValueError for a non-positive timeout."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # the client is still sending its request: nothing yet (IDLE) or the body (SEND_BODY)
    _INCOMPLETE = (h11.IDLE, h11.SEND_BODY)

    class HeadDeadlineH11Protocol(H11Protocol):
        """uvicorn's H11Protocol plus the head deadline (module docstring, uvicorn#1192)."""

        head_timeout_s = header_timeout_s
        book = (
            ConnectionBook(max_connections, per_client, min(MIN_IDLE_AGE_S, header_timeout_s / 4))
            if max_connections > 0
            else None
        )
        _head_timer = None

        def is_idle(self) -> bool:
            """The client still owes its request: nothing of one yet, a head still trickling in,
            or a body not all sent (the request deadline would close it anyway). A connection
            whose whole request is in is busy until its answer is written."""
            return self.conn.their_state in _INCOMPLETE

        def evict(self) -> None:
            """Close the connection (idle: the ConnectionBook makes room)."""
            if not self.transport.is_closing():
                self.transport.close()

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
            if self.book is not None:
                peer = transport.get_extra_info("peername")
                client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
                if not self.book.admit(client, self):
                    transport.write(
                        raw_503(
                            f"the server has {self.book.max_connections} connections open "
                            f"(at most {self.book.per_client} per client), all busy; retry later"
                        )
                    )
                    transport.close()
                    return
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state not in _INCOMPLETE:  # the whole request (head and body) is in
                self._cancel_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head()

        _send_timer = None

        def pause_writing(self) -> None:
            # the client stopped reading its answer (the transport's buffer is full): it has
            # head_timeout_s to read some of it, else the connection is closed (a send timeout;
            # uvicorn has none, so the connection stayed busy for as long as the client liked)
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(self.head_timeout_s, self._send_expired)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_expired(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                self.transport.abort()

        def connection_lost(self, exc) -> None:
            self._cancel_head()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None
            if self.book is not None:
                self.book.release(self)
            super().connection_lost(exc)

    return HeadDeadlineH11Protocol


def uvicorn_limits(settings) -> dict:
    """The ``uvicorn.Config`` keyword arguments of the HTTP limits in ``settings`` (a
    ``dsv41.envs.Settings``): ``http`` (:func:`uvicorn_protocol` with the connection cap
    ``DSV41_HTTP_MAX_CONNECTIONS`` and ``DSV41_HTTP_MAX_CONNECTIONS_PER_CLIENT``),
    ``timeout_keep_alive``, ``h11_max_incomplete_event_size``. uvicorn's own ``limit_concurrency``
    is not used: it answers 503 to ``/health`` too once idle connections fill it."""
    return {
        "http": uvicorn_protocol(
            settings.http_header_timeout_s, settings.http_max_connections, settings.http_max_connections_per_client
        ),
        "timeout_keep_alive": settings.http_keepalive_timeout_s,
        "h11_max_incomplete_event_size": H11_MAX_INCOMPLETE_EVENT_SIZE,
    }


def request_limit(settings) -> tuple[int, int]:
    """``(max_requests, per_client)`` of :class:`ShedRequests` for ``settings``: below the
    connection cap by an eighth (at least 2), so health and metrics always find a connection."""
    cap = settings.http_max_connections
    return max(1, cap - max(2, cap // 8)), settings.http_max_connections_per_client


class _Socket:
    """One connection of a :class:`BoundedHTTPServer`, as its :class:`ConnectionBook` sees it."""

    def __init__(self, sock) -> None:
        self.sock, self.idle = sock, True

    def is_idle(self) -> bool:
        return self.idle

    def evict(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class BoundedHTTPServer(ThreadingHTTPServer):
    """``http.server.ThreadingHTTPServer`` (daemon threads) for small endpoints like
    ``/metrics``, with two bounds:

    - ``header_timeout_s``: each request's head (request line and headers) must arrive within it
      of the connection's start (or of the previous answer), else the socket is shut down and the
      handler thread ends; the same value is the socket timeout of every later read and write (a
      client that stops reading the answer).
    - ``max_connections`` (``per_client``: one client's share, default a quarter): a
      :class:`ConnectionBook`. A new connection takes the place of the oldest idle one (waiting
      for a request head) when the server or its client is full; when every open one is busy
      answering it gets :func:`raw_503` and is closed (one thread per connection, so this bounds
      threads and descriptors too).

    The handler class must come from :func:`bounded_handler`. ``address`` is ``(host, port)``;
    an IPv6 host (with ``:``) listens on AF_INET6. Raises OSError when it cannot listen,
    ValueError on a bad bound.
    """

    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 made connects wait out SYN retries)

    def __init__(
        self, address: tuple[str, int], handler, header_timeout_s: float, max_connections: int, per_client: int = 0
    ) -> None:
        if not header_timeout_s > 0 or max_connections < 1:
            raise ValueError("header_timeout_s must be > 0 and max_connections >= 1")
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.book = ConnectionBook(max_connections, per_client, min(MIN_IDLE_AGE_S, header_timeout_s / 4))
        self._conns: dict = {}  # request socket -> _Socket
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self.book)

    @property
    def refused_total(self) -> int:
        """Connections refused (every open one busy)."""
        return self.book.refused_total

    def process_request(self, request, client_address):
        conn = _Socket(request)
        if not self.book.admit(str(client_address[0]), conn):
            try:
                request.settimeout(1.0)
                request.sendall(
                    raw_503(f"this server has {self.max_connections} connections open, all busy; retry later")
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._conns[request] = conn
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def handle_error(self, request, client_address) -> None:
        """One log line instead of socketserver's traceback on stderr (the service's journal): a
        client that went away mid-answer (EPIPE, ECONNRESET) or was cut by the socket timeout is
        routine and logged at debug level; anything else is a warning naming the client and error."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("http client %s went away: %s", client_address, exc)
        else:
            log.warning("http request from %s failed: %s: %s", client_address, type(exc).__name__, exc)

    def connection_of(self, request) -> _Socket | None:
        """The book's record of ``request`` (a handler's socket)."""
        return self._conns.get(request)

    def _done(self, request) -> None:
        conn = self._conns.pop(request, None)
        if conn is not None:
            self.book.release(conn)


class _Discard:
    """A write-only file that drops what it is given (the body of an answer to HEAD)."""

    def write(self, data) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def bounded_handler(base):
    """A subclass of ``base`` (a ``BaseHTTPRequestHandler`` class) that enforces its
    :class:`BoundedHTTPServer`'s head deadline: a timer shuts the socket down when the request
    head is not complete in time (a total deadline, not per read, so trickled bytes do not
    extend it); marks the connection busy from its head to its answer (idle connections are what
    the server may close for a newcomer); answers ``HEAD`` as ``GET`` without the body when
    ``base`` has ``do_GET`` only."""

    class Bounded(base):
        #: The GET endpoints (tests enumerate them); a base without them serves ``/metrics``.
        GET_PATHS = tuple(getattr(base, "GET_PATHS", ("/metrics",)))

        def setup(self):
            self.timeout = self.server.header_timeout_s  # socket timeout of every read and write
            super().setup()

        def _mark(self, idle: bool) -> None:
            conn = self.server.connection_of(self.request)
            if conn is not None:
                conn.idle = idle

        def handle_one_request(self):
            self._mark(True)
            timer = threading.Timer(self.server.header_timeout_s, self._cut)
            timer.daemon = True
            self._head_timer = timer
            timer.start()
            try:
                super().handle_one_request()
            finally:
                timer.cancel()
                self._mark(True)
                if getattr(self, "_head_only", False):  # the next request on this connection gets its body
                    self.wfile, self._head_only = self._real_wfile, False

        def parse_request(self):
            ok = super().parse_request()  # reads the header lines too
            self._head_timer.cancel()  # the head is in
            self._mark(False)
            return ok

        def end_headers(self):
            super().end_headers()
            if getattr(self, "_head_only", False):
                self.wfile.flush()
                self._real_wfile, self.wfile = self.wfile, _Discard()

        def send_error(self, code, message=None, explain=None):
            """http.server's errors (400 malformed, 404, 501 unsupported method) in OpenAI's JSON
            error shape instead of an HTML page; the connection is closed after it."""
            short = message or self.responses.get(code, ("error",))[0]
            body = http_error_body(
                code, f"{getattr(self, 'command', None) or '?'} {getattr(self, 'path', '')}: {short}"
            )
            self.log_error("code %d, message %s", code, short)
            self.send_response(code, short)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)

        def _cut(self):
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    if hasattr(base, "do_GET") and not hasattr(base, "do_HEAD"):

        def do_HEAD(self):  # noqa: N802 - http.server API
            self._head_only = True
            self.do_GET()

        Bounded.do_HEAD = do_HEAD

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
    srv = BoundedHTTPServer(
        (host, port),
        bounded_handler(MetricsHandler.factory(registry)),
        s.http_header_timeout_s,
        s.metrics_max_connections,
    )
    threading.Thread(target=srv.serve_forever, name="metrics-http", daemon=True).start()
    return srv
