"""Loopback fakes and helpers of the unit tests (module and plugin tests included; tools/sanity.sh
copies this file into the collection for ``ansible-test units``):

* row servers: reading a row server's counters once settled, and scripted row servers (a hung
  one, a slow one) for the client's timeout and deadline paths;
* HTTP: ``FakeServing`` (rank 0 as the harness and the modules see it: greedy completions,
  admission, counters) and ``FakeStack`` (rank 0, the table server, the drafter worker and a
  Prometheus API on one server, as `dsv41 status` and the monitoring code read them).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from dsv41.harness.refs import PROMPTS
from dsv41.transport import native, parse_url, protocol as P
from dsv41.transport.server import RowTable

IMPLS = [pytest.param(True, id="cpp"), pytest.param(False, id="python")]
ROWS = 5000


def make_table(seed: int, layer: int, rows: int = ROWS) -> RowTable:
    """A table of ``rows`` random rows (uint8 weight [rows, 256], scale [rows, 8]) whose identity
    is sha256("table-<seed>")."""
    rng = np.random.default_rng(seed)
    return RowTable(
        identity=hashlib.sha256(f"table-{seed}".encode()).digest(),
        layer_id=layer,
        weight=rng.integers(0, 256, (rows, 256), dtype=np.uint8),
        scale=rng.integers(0, 256, (rows, 8), dtype=np.uint8),
    )


def expected(t: RowTable, rows) -> np.ndarray:
    """The exact reply rows of ``t`` for ``rows``: uint8 [len(rows), 264] (weight then scale)."""
    r = np.asarray(rows, dtype=np.int64)
    return np.concatenate([t.weight[r], t.scale[r]], axis=1)


@pytest.fixture(params=IMPLS)
def impl(request):
    """The server/client implementation: True the C++ extension (fails if it is not built), False Python."""
    if request.param and native._fastrow is None:
        pytest.fail("C++ extension not built: run pip install -e .")
    return request.param


def raw_conn(ep) -> socket.socket:
    """A plain TCP connection (TCP_NODELAY, 5 s timeout) to endpoint ``ep``."""
    s = socket.create_connection((ep.host, ep.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s``; ConnectionError when it closes first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def settled_snapshot(srv, quiet_s: float = 0.05, limit_s: float = 3.0) -> dict:
    """The server's counters once they stop moving: the server counts a request after its reply
    is sent (the latency it records includes the send), so a client can read its answer a moment
    before the count moves."""
    end = time.monotonic() + limit_s
    last = srv.snapshot()
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = srv.snapshot()
        if now == last:
            return now
        last = now
    return last


class SilentServer:
    """Answers HELLO with the real table list, never answers a lookup (a hung server)."""

    def __init__(self, tables):
        self.hello = b"".join(P.TABLE_ENTRY.pack(t.identity, t.layer_id, t.rows, 264) for t in tables)
        self.n = len(tables)
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(4)
        self.port = self.ls.getsockname()[1]
        self.conns = []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            try:
                c = self.ls.accept()[0]
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self.conn, args=(c,), daemon=True).start()

    def conn(self, c):
        try:
            while True:
                h = b""
                while len(h) < P.REQ.size:
                    k = c.recv(P.REQ.size - len(h))
                    if not k:
                        return
                    h += k
                ver, op, rid, ident, count, plen = P.REQ.unpack(h)[1:]
                payload = b""
                while len(payload) < plen:
                    k = c.recv(plen - len(payload))
                    if not k:
                        return
                    payload += k
                if op == P.OP_HELLO:  # replies echo the request's version, as the real server's
                    c.sendall(P.REP.pack(P.MAGIC, ver, 0, rid, self.n, len(self.hello)) + self.hello)
                elif op == P.OP_LOOKUP:
                    self.lookup(c, ver, rid, ident, count, payload)
        except OSError:
            pass

    def lookup(self, c, ver, rid, ident, count, payload):
        """A hung server never answers a lookup."""

    def close(self):
        self.ls.close()
        for c in self.conns:
            c.close()


class SlowServer(SilentServer):
    """Answers HELLO at once and each LOOKUP with the exact rows (``reader.read(layer, ids)``)
    after ``delay_s`` per request, one request after another (a slow server)."""

    def __init__(self, tables, reader, delay_s):
        self.reader, self.delay_s = reader, delay_s
        self.layers = {t.identity: t.layer_id for t in tables}
        super().__init__(tables)

    def lookup(self, c, ver, rid, ident, count, payload):
        import numpy as np

        rows = self.reader.read(self.layers[ident], np.frombuffer(payload, "<u8").astype(np.int64))
        time.sleep(self.delay_s)
        c.sendall(P.REP.pack(P.MAGIC, ver, 0, rid, count, count * P.ROW_BYTES) + rows.tobytes())


class V1Server:
    """A version-1 row server as released before version 2 (HELLO and LOOKUP; any other
    version is refused with bad_version and the connection closed)."""

    def __init__(self, tables):
        self.tables = {t.identity: t for t in tables}
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(8)
        self.ep = parse_url(f"tcp://127.0.0.1:{self.ls.getsockname()[1]}")
        self.refused = 0
        self.conns = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c = self.ls.accept()[0]
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        try:
            while True:
                magic, ver, op, rid, ident, count, plen = P.REQ.unpack(recv_exact(c, P.REQ.size))
                payload = recv_exact(c, plen) if plen else b""
                if ver != 1:
                    self.refused += 1
                    c.sendall(P.REP.pack(P.MAGIC, 1, P.ST_BAD_VERSION, rid, 0, 0))
                    c.close()
                    return
                if op == P.OP_HELLO:
                    body = b"".join(
                        P.TABLE_ENTRY.pack(t.identity, t.layer_id, t.rows, 264) for t in self.tables.values()
                    )
                    c.sendall(P.REP.pack(P.MAGIC, 1, 0, rid, len(self.tables), len(body)) + body)
                elif op == P.OP_LOOKUP:
                    rows = np.frombuffer(payload, "<u8").astype(np.int64)
                    body = expected(self.tables[ident], rows).tobytes()
                    c.sendall(P.REP.pack(P.MAGIC, 1, 0, rid, count, len(body)) + body)
                else:
                    c.sendall(P.REP.pack(P.MAGIC, 1, P.ST_UNKNOWN_OP, rid, 0, 0))
        except (OSError, ConnectionError):
            pass

    def close(self):
        self.ls.close()
        for c in self.conns:
            c.close()


def serve_http(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str, threading.Thread]:
    """``handler`` served on a free loopback port by a daemon thread: ``(server, "http://127.0.0.1:PORT",
    thread)``; stop it with ``server.shutdown(); server.server_close()``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}", thread


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing (http.server logs every request to stderr)."""

    def log_message(self, *a):
        pass


class HttpStandIn:
    """Base of the HTTP stand-ins below: ``_serve(handler)`` starts it (:func:`serve_http`) and
    sets ``httpd``, ``url`` and ``thread``; ``close()`` stops it."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd, self.url, self.thread = serve_http(handler)

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeServing(HttpStandIn):
    """A stand-in rank 0 HTTP endpoint: greedy ids are a function of the prompt bytes (so they are
    deterministic), ``shift`` perturbs the id at position ``shift_at`` of prompts named in
    ``shift_names``; counters grow by one lookup per completion on each rank."""

    def __init__(self) -> None:
        self.paused = False
        self.model = "dsv41-lab"
        self.shift_names: set[str] = set()
        self.shift_at = 3
        self.no_token_ids = False
        self.fallbacks = 0
        self.lookups = 0
        self.fallbacks_per_call = 0
        self.drafter_rounds_per_call = 2
        self.rounds = 0
        self.calls: list[str] = []
        fake = self

        class H(QuietHandler):
            def _send(self, code, body, ctype="application/json"):
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append("GET " + self.path)
                if self.path == "/is_paused":
                    return self._send(200, {"is_paused": fake.paused})
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": fake.model}]})
                if self.path == "/metrics":
                    text = "# HELP x\n"
                    for r in ("0", "1"):
                        text += f'dsv41_engram_lookups_total{{rank="{r}"}} {fake.lookups}\n'
                        text += f'dsv41_engram_fallbacks_total{{rank="{r}"}} {fake.fallbacks}\n'
                    text += 'vllm:num_requests_running{model_name="x"} 0\n'
                    text += f"dsv41_drafter_rounds {fake.rounds}\ndsv41_drafter_identity_refusals 0\n"
                    return self._send(200, text.encode(), "text/plain")
                return self._send(404, {})

            def do_POST(self):
                fake.calls.append("POST " + self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path.split("?")[0] == "/pause":
                    fake.pause_query = self.path.partition("?")[2]
                    fake.paused = True
                    return self._send(200, {})
                if self.path == "/resume":
                    fake.paused = False
                    return self._send(200, {})
                if self.path == "/v1/completions":
                    assert body["temperature"] == 0 and body["return_token_ids"] is True
                    prompt = body["prompt"].encode()
                    ids = [(prompt[i % len(prompt)] * 7 + i) % 260 for i in range(body["max_tokens"])]
                    name = {p: n for n, p in PROMPTS}.get(body["prompt"])
                    if name in fake.shift_names and len(ids) > fake.shift_at:
                        ids[fake.shift_at] = (ids[fake.shift_at] + 1) % 260
                    fake.lookups += 1
                    fake.fallbacks += fake.fallbacks_per_call
                    fake.rounds += fake.drafter_rounds_per_call
                    choice = {"text": "x"} if fake.no_token_ids else {"text": "x", "token_ids": ids}
                    return self._send(200, {"choices": [choice]})
                return self._send(404, {})

        self._serve(H)


class FakeStack(HttpStandIn):
    """Rank 0 (``/health``, ``/is_paused``, ``/v1/models``, ``/metrics``), the table server
    (``/ready``), the drafter worker (``/w/metrics``) and a Prometheus API (``/api/v1/alerts``,
    ``/api/v1/query_range``) on one loopback HTTP server at ``url``; every answer is read from the
    attributes at request time, so a test changes them to script a state. Anything else is 404.
    ``close()`` stops it."""

    def __init__(self) -> None:
        self.paused, self.since, self.lookups, self.fallbacks = False, None, [100, 90], [0, 0]
        self.ready = True
        self.worker_ids = {"drafter": "d" * 64, "markov": "m" * 64, "target": "t" * 64}
        self.alerts_code, self.alerts_body = 200, {"status": "success", "data": {"alerts": []}}
        self.range_queries = 0
        f = self

        class H(QuietHandler):
            def _send(self, code, body, ctype="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                p = self.path
                if p == "/health":
                    return self._send(200, {"status": "ok"})
                if p == "/is_paused":
                    return self._send(200, {"is_paused": f.paused, "paused_since": f.since})
                if p == "/v1/models":
                    return self._send(200, {"data": [{"id": "dsv41-lab"}]})
                if p == "/metrics":
                    return self._send(200, f.engine_metrics(), "text/plain")
                if p == "/ready":
                    return self._send(200 if f.ready else 503, "ready" if f.ready else "loading", "text/plain")
                if p == "/w/metrics":
                    return self._send(200, f.worker_metrics(), "text/plain")
                if p == "/api/v1/alerts":
                    return self._send(f.alerts_code, f.alerts_body)
                if p.startswith("/api/v1/query_range"):
                    f.range_queries += 1
                    return self._send(
                        200,
                        {
                            "status": "success",
                            "data": {
                                "resultType": "matrix",
                                "result": [
                                    {"metric": {"rank": "0"}, "values": [[100 + 5 * i, str(i % 3)] for i in range(20)]}
                                ],
                            },
                        },
                    )
                return self._send(404, {})

        self._serve(H)

    def engine_metrics(self) -> str:
        """Rank 0's Prometheus text: speculation counters and both ranks' Engram counters."""
        out = [
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 40.0',
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 50.0',
            "dsv41_drafter_rounds 12.0",
            "dsv41_drafter_fail_closed_rounds 1.0",
            "dsv41_drafter_proxy_respawns 2.0",
        ]
        for r in (0, 1):
            out += [
                f'dsv41_engram_lookups_total{{rank="{r}"}} {self.lookups[r]}',
                f'dsv41_engram_fallbacks_total{{rank="{r}"}} {self.fallbacks[r]}',
            ]
        return "\n".join(out) + "\n"

    def worker_metrics(self) -> str:
        """The drafter worker's Prometheus text, with its identities as ``dsv41_drafter_info`` labels."""
        labels = ",".join(f'{k}="{v}"' for k, v in {**self.worker_ids, "backend": "torch"}.items())
        return f"dsv41_drafter_connections 1.0\ndsv41_drafter_rounds_total 12.0\ndsv41_drafter_info{{{labels}}} 1.0\n"


# ---- streaming completions (vLLM's SSE), for the bench client and the drill's load ----------------


def completion_chunk(ids: list[int], finish: str | None = None, completion: int | None = None) -> dict:
    """One streamed ``/v1/completions`` chunk as vLLM sends it: one choice with ``token_ids``
    (``ids``), ``finish_reason`` ``finish``; with ``completion``, continuous usage
    (``prompt_tokens`` 5, ``completion_tokens`` ``completion``)."""
    d = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids, "finish_reason": finish}]}
    if completion is not None:
        d["usage"] = {"prompt_tokens": 5, "completion_tokens": completion}
    return d


def sse(events: list) -> bytes:
    """Server-sent events: ``data: <event>`` and a blank line per event (a dict as JSON, a str
    such as ``"[DONE]"`` as it is)."""
    return "".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events).encode()


class StreamingEndpoint(HttpStandIn):
    """``POST /v1/completions`` on loopback answered as vLLM streams it: one SSE chunk per token
    (:func:`completion_chunk`, continuous usage, ``finish_reason`` ``length`` on the last), one
    every ``delay_s`` seconds, then ``[DONE]``; every request body is kept in ``bodies``; other
    paths are 404. ``close()`` stops it."""

    def __init__(self, tokens: int = 4, delay_s: float = 0.005) -> None:
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        fake = self

        class H(QuietHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                with fake.lock:
                    fake.bodies.append(body)
                if self.path != "/v1/completions":
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(tokens):
                    time.sleep(delay_s)
                    self.wfile.write(sse([completion_chunk([i + 1], "length" if i == tokens - 1 else None, i + 1)]))
                    self.wfile.flush()
                self.wfile.write(sse(["[DONE]"]))

        self._serve(H)
