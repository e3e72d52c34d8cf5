"""Real traffic is shed, health is not: on the engine API, requests past a client's share get 429
and past the total 503, both in OpenAI's error shape with ``Retry-After``, while ``/health`` and
``/metrics`` keep answering 200 from every client; a connection refused because every open one
is busy gets a whole 503 answer (not a silent close). The operations exporter never answers 500
while its journal is appended to and replaced under it. Loopback only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

from dsv41 import envs  # noqa: E402


class SlowEngine:
    """Streams ``n`` tokens ``gap_s`` apart from its own thread (a long generation)."""

    fatal = None
    frozen = False

    def __init__(self, n: int = 30, gap_s: float = 0.1) -> None:
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


@contextlib.contextmanager
def _engine(max_connections: int, per_client: int):
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.server import create_app
    from dsv41.httpd import uvicorn_limits

    settings = envs.parse(
        {
            "DSV41_HTTP_MAX_CONNECTIONS": str(max_connections),
            "DSV41_HTTP_HEADER_TIMEOUT_S": "5",
            "DSV41_HTTP_MAX_CONNECTIONS_PER_CLIENT": str(per_client),
        }
    )
    app = create_app(SlowEngine(), "m", 64, metrics=EngineMetrics("m", dict), request_limit=(3, 2))
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
        assert time.monotonic() < end
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        t.join(10)


def _client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=20)


def _stream(addr, source: str, started: threading.Event, done: list) -> None:
    with _client(source) as c:
        with c.stream(
            "POST",
            "http://{}:{}/v1/completions".format(*addr),
            json={"model": "m", "prompt": "hi", "max_tokens": 30, "stream": True},
        ) as r:
            started.set()
            done.append(r.status_code)
            for _ in r.iter_bytes():
                pass


def _shed(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    err = json.loads(r.content)["error"]
    assert err["code"] == status and err["message"] and err["type"]
    assert int(r.headers["retry-after"]) >= 1


def test_requests_are_shed_per_client_and_in_total_while_health_answers() -> None:
    with _engine(16, 4) as addr:
        _shed_while_health_answers(addr)


def _shed_while_health_answers(addr) -> None:
    url = "http://{}:{}".format(*addr)
    done: list = []
    threads = []
    for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2"):  # 2 from one client (its share), 1 from another
        ev = threading.Event()
        t = threading.Thread(target=_stream, args=(addr, source, ev, done), daemon=True)
        t.start()
        assert ev.wait(10)
        threads.append(t)
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    with _client("127.0.0.1") as c:
        _shed(c.post(url + "/v1/completions", json=body), 429)  # over this client's share
    with _client("127.0.0.3") as c:
        _shed(c.post(url + "/v1/completions", json=body), 503)  # over the total
        for path in ("/health", "/metrics", "/v1/models", "/is_paused", "/health?x=1"):
            assert c.get(url + path).status_code == 200, path
    with _client("127.0.0.1") as c:
        assert c.get(url + "/health").status_code == 200
    for t in threads:
        t.join(20)
    assert done == [200, 200, 200]


def test_a_connection_refused_while_all_are_busy_gets_a_whole_503() -> None:
    with _engine(8, 2) as addr:
        _refused_while_busy(addr)


def _refused_while_busy(addr) -> None:
    """A client whose share of connections (a quarter of the cap) is all busy streaming: its next
    connection is answered 503 (OpenAI shape, Retry-After) before any request is read."""
    done: list = []
    threads = []
    for _ in range(2):
        ev = threading.Event()
        t = threading.Thread(target=_stream, args=(addr, "127.0.0.4", ev, done), daemon=True)
        t.start()
        assert ev.wait(10)
        threads.append(t)
    # 8 connections, 2 per client: both of 127.0.0.4's are busy streaming, none idle to give up
    with socket.create_connection(addr, source_address=("127.0.0.4", 0), timeout=5) as s:
        raw = s.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), raw
    assert json.loads(body)["error"]["code"] == 503
    assert httpx.get("http://{}:{}/health".format(*addr), timeout=10).status_code == 200  # another client
    for t in threads:
        t.join(20)


def test_the_exporter_never_fails_a_scrape_while_its_journal_is_written(tmp_path) -> None:
    from dsv41.monitoring.exporter import OpsCollector, serve

    journal = tmp_path / "journal.jsonl"
    srv, _t = serve("127.0.0.1:0", OpsCollector("", journal))
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            entry = json.dumps({"op": f"w{i}", "step": "begin", "kind": "window", "ts": time.time()}) + "\n"
            with open(journal, "a") as f:  # appended in two writes: a torn line is visible between them
                f.write(entry[:10])
                f.flush()
                f.write(entry[10:])
            tmp = tmp_path / "journal.tmp"
            tmp.write_text(journal.read_text()[-2000:])
            os.replace(tmp, journal)  # replaced whole, as an atomic writer does
            if i % 7 == 0:
                journal.unlink()

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    codes = []
    try:
        with httpx.Client(timeout=10) as c:
            for _ in range(150):
                r = c.get("http://{}:{}/metrics?x=1".format(*srv.server_address[:2]))
                codes.append(r.status_code)
                assert b"dsv41_promotion_journal_readable" in r.content
    finally:
        stop.set()
        t.join(5)
        srv.shutdown()
        srv.server_close()
    assert set(codes) == {200}


class FloodEngine(SlowEngine):
    """Streams 200,000 tokens as fast as it can (about 40 MB of SSE): more than any buffer holds."""

    def __init__(self) -> None:
        super().__init__(n=200_000, gap_s=0.0)

    def submit(self, ids, params, sink):
        def run():
            for i in range(self.n):
                sink({"type": "tokens", "ids": [65], "prompt_tokens": len(ids), "completion_tokens": i + 1})
            sink({"type": "finish", "reason": "length", "prompt_tokens": len(ids), "completion_tokens": self.n})

        threading.Thread(target=run, daemon=True).start()

        class R:
            request_id = "req-flood"

        return R()


def test_a_client_that_stops_reading_its_answer_is_disconnected() -> None:
    """uvicorn has no send timeout: a client that asked for a long stream and reads nothing kept
    its connection busy (its share of the cap) for as long as it liked. The engine API's h11
    protocol closes it once the transport has been full for the head deadline."""
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.server import create_app
    from dsv41.httpd import uvicorn_limits

    settings = envs.parse({"DSV41_HTTP_MAX_CONNECTIONS": "8", "DSV41_HTTP_HEADER_TIMEOUT_S": "1"})
    app = create_app(FloodEngine(), "m", 64, metrics=EngineMetrics("m", dict), request_limit=(3, 2))
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="error", lifespan="off", **uvicorn_limits(settings)
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config.port = s.getsockname()[1]
    server = uvicorn.Server(config)
    t = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    t.start()
    end = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < end
        time.sleep(0.02)
    try:
        book = config.http.book
        s = socket.create_connection(("127.0.0.1", config.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b'{"model": "m", "prompt": "hi", "max_tokens": 200000, "stream": true, "ignore_eos": true}'
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        time.sleep(0.3)
        assert len(book) == 1
        end = time.monotonic() + 15
        while len(book) and time.monotonic() < end:
            time.sleep(0.1)
        assert len(book) == 0, "the server still holds a client that reads nothing"
        s.close()
    finally:
        server.should_exit = True
        t.join(10)


@pytest.mark.parametrize("why", ["paused", "draining", "engine failed"])
def test_every_503_of_the_api_says_when_to_retry(why) -> None:
    """Not only the load shedder's: the API's own 503s (paused, draining, a failed engine) carry
    ``Retry-After`` and OpenAI's error shape."""
    from fastapi.testclient import TestClient

    from dsv41.engine.server import create_app
    from dsv41.engine.server_state import ServerState

    eng, st = SlowEngine(), ServerState()
    if why == "paused":
        st.hold(None)
    elif why == "draining":
        st.draining = True
    else:
        eng.fatal = "test: the engine failed"
    with TestClient(create_app(eng, "m", 64, state=st, request_limit=(3, 2))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
    _shed(r, 503)
