"""Issue 25 item 6 (field report uvicorn#1192): slow and idle clients on every HTTP server dsv41
runs, with short limits. For each server (the engine API on uvicorn with ``httpd.uvicorn_limits``,
the table server's ``/metrics`` and the drafter worker's ``/metrics`` on ``BoundedHTTPServer``):
a connection that sends nothing is closed after the head timeout, a trickled request head (and,
on the engine, a trickled body) is closed at the request deadline (not per byte), connections over the limit are refused as
documented (the oldest idle one makes room; see test_http_health_under_load.py), while keep-alive requests and, on the
engine, a stream longer than every timeout are unaffected. Servers listen on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from dsv41 import envs  # noqa: E402
from dsv41.engine.server import create_app  # noqa: E402
from dsv41.httpd import serve_metrics, uvicorn_limits  # noqa: E402

HEAD_S, KEEPALIVE_S = 0.6, 0.4
LIMITS = {
    "DSV41_HTTP_HEADER_TIMEOUT_S": str(HEAD_S),
    "DSV41_HTTP_KEEPALIVE_TIMEOUT_S": str(KEEPALIVE_S),
    "DSV41_HTTP_MAX_CONNECTIONS": "4",
    "DSV41_METRICS_MAX_CONNECTIONS": "8",
}
SLACK_S = 3.0  # scheduling slack on a loaded 2-core runner; the trickles below last far longer


class SlowEngine:
    """Streams ``n`` tokens ``gap_s`` apart from its own thread (a long generation)."""

    fatal = None
    frozen = False

    def __init__(self, n: int = 12, gap_s: float = 0.15) -> None:
        self.n, self.gap_s = n, gap_s

    def submit(self, ids, params, sink):
        def run():
            for i in range(self.n):
                time.sleep(self.gap_s)
                sink({"type": "tokens", "ids": [65], "prompt_tokens": len(ids), "completion_tokens": i + 1})
            sink({"type": "finish", "reason": "length", "prompt_tokens": len(ids), "completion_tokens": self.n})

        threading.Thread(target=run, daemon=True).start()

        class R:
            request_id = "req-slow"

        return R()

    def abort(self, rid=None):
        pass

    def freeze(self, frozen):
        pass

    def idle(self):
        return True


@pytest.fixture()
def engine_url():
    settings = envs.parse(LIMITS)
    app = create_app(SlowEngine(), "m", 64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off", **uvicorn_limits(settings))
    )
    t = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    t.start()
    end = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < end, "uvicorn did not start"
        time.sleep(0.02)
    yield "127.0.0.1", port
    server.should_exit = True
    t.join(10)


@pytest.fixture(params=["table-server", "drafter-worker"])
def metrics_url(request, monkeypatch, tmp_path):
    """The two /metrics servers as their processes start them."""
    if request.param == "table-server":
        from dsv41.engram.server import EngramServer

        for k, v in LIMITS.items():
            monkeypatch.setenv(k, v)
        es = EngramServer(None, tmp_path, ["tcp://127.0.0.1:0"], metrics="127.0.0.1:0")
        es.start_metrics()
        yield es.metrics_bound, es._http
        es.stop()
    else:
        from prometheus_client import CollectorRegistry, Counter

        reg = CollectorRegistry()
        Counter("dsv41_test_total", "a counter", registry=reg).inc()
        srv = serve_metrics("127.0.0.1", 0, reg, envs.parse(LIMITS))
        yield srv.server_address[:2], srv
        srv.shutdown()
        srv.server_close()


def _closed_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the peer closes ``sock`` (reads until EOF; fails past ``limit_s``)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return time.monotonic() - t0
        except TimeoutError:
            pytest.fail(f"connection still open after {limit_s} s")
        if not data:
            return time.monotonic() - t0


def _trickle(addr, head: bytes, gap_s: float = 0.1) -> tuple[float, int]:
    """Send ``head`` a byte every ``gap_s`` until the server closes; (seconds, bytes sent)."""
    with socket.create_connection(addr, timeout=5) as s:
        t0 = time.monotonic()
        for i, b in enumerate(head):
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0, i
            s.settimeout(gap_s)
            try:
                if s.recv(65536) == b"":
                    return time.monotonic() - t0, i + 1
            except TimeoutError:
                pass
            except ConnectionResetError:
                return time.monotonic() - t0, i + 1
        pytest.fail("the whole trickled head was accepted")


SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"p" * 60 + b"\r\n\r\n"  # ~10 s at 0.1 s/byte


# ---------------------------------------------------------------- engine API (uvicorn)


def test_engine_closes_an_idle_connection(engine_url):
    with socket.create_connection(engine_url, timeout=5) as s:
        took = _closed_within(s, HEAD_S + SLACK_S)
    assert HEAD_S * 0.8 <= took <= HEAD_S + SLACK_S


def test_engine_closes_a_trickled_head_and_after_a_response_too(engine_url):
    took, sent = _trickle(engine_url, SLOW_HEAD)
    assert took <= HEAD_S + SLACK_S and sent < len(SLOW_HEAD)
    # after a complete response, the next head is timed again (keep-alive does not reset per byte)
    with socket.create_connection(engine_url, timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in s.recv(65536)
        t0 = time.monotonic()
        closed = False
        for b in SLOW_HEAD:
            try:
                s.sendall(bytes([b]))
                s.settimeout(0.1)
                if s.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed and time.monotonic() - t0 <= HEAD_S + SLACK_S


def test_engine_closes_a_trickled_body_at_the_deadline_without_a_traceback(engine_url, caplog):
    """A complete head, then a body a byte every 0.1 s: the request deadline closes it (the body
    is bounded in time, not only in size) and the API logs no traceback for the disconnect."""
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 4}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    caplog.set_level("ERROR")
    with socket.create_connection(engine_url, timeout=5) as s:
        s.sendall(head)
        t0 = time.monotonic()
        closed, answer = False, b""
        for b in body:
            try:
                s.sendall(bytes([b]))
                s.settimeout(0.1)
                got = s.recv(65536)
                answer += got
                if got == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        took = time.monotonic() - t0
    assert closed, "the whole trickled body was accepted"
    assert took <= HEAD_S + SLACK_S
    assert b"200 OK" not in answer
    time.sleep(0.3)  # the application's view of the disconnect is logged from uvicorn's thread
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_engine_keep_alive_and_a_stream_longer_than_every_timeout(engine_url):
    host, port = engine_url
    with httpx.Client(base_url=f"http://{host}:{port}", timeout=30) as c:
        for _ in range(3):  # one pooled connection, requests closer together than the keep-alive timeout
            assert c.get("/health").status_code == 200
            time.sleep(KEEPALIVE_S / 4)
        t0 = time.monotonic()
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 12, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        took = time.monotonic() - t0
    assert took > HEAD_S + KEEPALIVE_S  # outlived both timeouts
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_engine_closes_keep_alive_connections_idle_past_the_timeout(engine_url):
    with socket.create_connection(engine_url, timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in s.recv(65536)
        took = _closed_within(s, KEEPALIVE_S + SLACK_S)
    assert took <= KEEPALIVE_S + SLACK_S


def test_engine_idle_connections_over_the_limit_make_room_for_health(engine_url):
    """Idle connections filling the cap are closed oldest first for a newcomer: /health answers."""
    idle = [socket.create_connection(engine_url, timeout=5) for _ in range(4)]
    try:
        time.sleep(0.3)  # past the minimum idle age (a quarter of HEAD_S), before HEAD_S closes them
        with socket.create_connection(engine_url, timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(idle[0], SLACK_S) < HEAD_S  # the oldest idle one made room at once
    finally:
        for s in idle:
            s.close()
    assert httpx.get("http://{}:{}/health".format(*engine_url), timeout=5).status_code == 200


# ---------------------------------------------------------------- table server and drafter /metrics


def test_metrics_closes_idle_and_trickled_connections(metrics_url):
    addr, _ = metrics_url
    with socket.create_connection(addr, timeout=5) as s:
        assert _closed_within(s, HEAD_S + SLACK_S) <= HEAD_S + SLACK_S
    took, sent = _trickle(addr, SLOW_HEAD)
    assert took <= HEAD_S + SLACK_S and sent < len(SLOW_HEAD)


def test_metrics_idle_connections_over_the_limit_make_room_and_it_still_serves(metrics_url):
    addr, srv = metrics_url
    url = "http://{}:{}/metrics".format(*addr)
    assert httpx.get(url, timeout=5).status_code == 200
    idle = [socket.create_connection(addr, timeout=5) for _ in range(2)]  # this client's quarter of 8
    try:
        time.sleep(0.3)  # past the minimum idle age (a quarter of HEAD_S), before HEAD_S closes them
        assert httpx.get(url + "?x=1", timeout=5).status_code == 200  # the 4th takes an idle one's place
        assert srv.book.evicted_total >= 1
        assert _closed_within(idle[0], SLACK_S) < HEAD_S
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    r = httpx.get(url, timeout=5)
    assert r.status_code == 200 and srv.open_connections <= 1


@pytest.mark.parametrize(
    "exc, level",
    [
        (BrokenPipeError(32, "Broken pipe"), "DEBUG"),
        (ConnectionResetError(104, "Connection reset by peer"), "DEBUG"),
        (TimeoutError("timed out"), "DEBUG"),
        (RuntimeError("handler bug"), "WARNING"),
    ],
)
def test_metrics_server_errors_are_one_log_line_never_a_traceback(exc, level, capfd, caplog) -> None:
    """socketserver prints a traceback to stderr (the service's journal) for every failed request,
    e.g. a scraper that went away mid-answer; BoundedHTTPServer logs one line instead."""
    from http.server import BaseHTTPRequestHandler

    from dsv41.httpd import BoundedHTTPServer, bounded_handler

    srv = BoundedHTTPServer(("127.0.0.1", 0), bounded_handler(BaseHTTPRequestHandler), 1.0, 2)
    try:
        caplog.set_level("DEBUG", logger="dsv41.httpd")
        try:
            raise exc
        except Exception:
            srv.handle_error(None, ("127.0.0.1", 1))
    finally:
        srv.server_close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err
    recs = [r for r in caplog.records if r.name == "dsv41.httpd"]
    assert len(recs) == 1 and recs[0].levelname == level and str(exc) in recs[0].getMessage()
