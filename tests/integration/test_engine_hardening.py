"""Issue 10 against live engine processes: a frozen TP peer (SIGSTOP) is noticed within
DSV41_TP_PEER_TIMEOUT_S (rank 0's /health 503 with the reason, the stream ends with an error,
new requests are refused, both ranks exit for their supervisor); a 256 MiB chunked upload is
refused with 413 while the server's RSS stays bounded; after a handler-bug 500 a pooled client's
next request works."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from engineutil import (  # noqa: E402
    FakeEngine,  # noqa: E402
    engine_env,
    free_port,
    lab_assets,
    serve_cmd,
    start,
    start_pair,
    stop,
    wait_ready,
)

PEER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _stream(url: str, out: dict, first: threading.Event, max_tokens: int = 2000) -> None:
    chunks, err = [], None
    try:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={"prompt": "The dog ", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()
    except httpx.HTTPError as exc:
        err = exc
    out["chunks"], out["error"] = chunks, err
    first.set()


@pytest.mark.parametrize("frozen", ["r1", "r0"])
def test_frozen_peer_is_noticed_within_the_deadline(assets, tmp_path, frozen):
    p = start_pair(assets, tmp_path, env={"DSV41_TP_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)})
    url = p["url"]
    out, first = {}, threading.Event()
    t = threading.Thread(target=_stream, args=(url, out, first), daemon=True)
    try:
        t.start()
        assert first.wait(30) and out.get("chunks") is None, "the stream did not start"
        p[frozen].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        if frozen == "r1":
            health = None
            while time.monotonic() - t0 < PEER_TIMEOUT_S + 5:
                try:
                    r = httpx.get(url + "/health", timeout=1)
                except httpx.HTTPError:
                    time.sleep(0.05)
                    continue
                if r.status_code == 503:
                    health = (time.monotonic() - t0, r.json())
                    break
                time.sleep(0.05)
            assert health is not None, "rank 0 never answered /health 503"
            took, body = health
            assert took <= PEER_TIMEOUT_S + 2.0, took
            assert body["status"] == "failed" and "did not answer within 3 s" in body["error"], body
            # new requests are refused while it lingers (or the port is already closed)
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
                assert r.status_code == 503, r.text
            except httpx.TransportError:
                pass
            t.join(15)
            assert not t.is_alive(), "the stream hangs"
            last = out["chunks"][-1]
            assert "error" in last and "did not answer" in last["error"]["message"], last
            assert p["r0"].wait(15) == 1
            log = (tmp_path / "rank0.log").read_text()
            assert "dsv41: error: rank 0: the TP peer did not answer within 3 s" in log, log[-2000:]
            assert "Traceback" not in log
            p["r1"].send_signal(signal.SIGCONT)  # it follows: its peer is gone
            assert p["r1"].wait(30) == 1
        else:
            # rank 1 notices a frozen rank 0 by itself and exits within the deadline
            rc = p["r1"].wait(PEER_TIMEOUT_S + 5)
            log = (tmp_path / "rank1.log").read_text()
            assert rc == 1, log[-2000:]
            assert "dsv41: error: rank 1: the TP peer did not answer within 3 s" in log, log[-2000:]
            assert "Traceback" not in log
            assert time.monotonic() - t0 <= PEER_TIMEOUT_S + 3.0
    finally:
        for k in ("r0", "r1"):
            if p[k].poll() is None:
                p[k].send_signal(signal.SIGCONT)
        stop(p["r0"], signal.SIGKILL)
        stop(p["r1"], signal.SIGKILL)
        t.join(10)


@pytest.fixture(scope="module")
def tp1(assets, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp1-hard")
    port = free_port()
    proc = start(serve_cmd(assets, port=port), engine_env(), d / "server.log")
    try:
        wait_ready(port, proc, d / "server.log")
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "log": d / "server.log"}
    finally:
        stop(proc, signal.SIGKILL)


def _chunked_upload(port: int, path: str, total: int, chunk: int = 1 << 16) -> tuple[bytes, int]:
    """POST ``total`` bytes to ``path`` as a chunked body (no Content-Length), reading the
    response on another thread while sending; returns (response bytes, bytes sent)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    resp = bytearray()

    def reader():
        try:
            while True:
                b = s.recv(65536)
                if not b:
                    return
                resp.extend(b)
        except OSError:
            return

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    sent = 0
    try:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        piece = f"{chunk:x}\r\n".encode() + b"7" * chunk + b"\r\n"
        s.sendall(f"{chunk:x}\r\n".encode() + b'{"prompt": "' + b"7" * (chunk - 12) + b"\r\n")
        sent = chunk
        while sent < total and not resp:
            s.sendall(piece)
            sent += chunk
    except OSError:
        pass
    th.join(10)
    s.close()
    return bytes(resp), sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_huge_chunked_body_is_413_with_bounded_rss(tp1, path):
    pid = tp1["proc"].pid
    base = _rss_bytes(pid)
    peak = [base]
    stop_ev = threading.Event()

    def sample():
        while not stop_ev.is_set():
            peak[0] = max(peak[0], _rss_bytes(pid))
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        resp, sent = _chunked_upload(tp1["port"], path, 256 << 20)
    finally:
        stop_ev.set()
        th.join(5)
    grown = peak[0] - base
    print(
        f"RSS {path}: base {base >> 20} MiB, peak {peak[0] >> 20} MiB, grew {grown >> 20} MiB; "
        f"client sent {sent >> 20} MiB"
    )
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    assert b"connection: close" in resp.lower()
    assert sent < 64 << 20, sent  # the server stopped reading long before 256 MiB
    assert grown < 48 << 20, f"RSS grew {grown >> 20} MiB for a 4 MiB limit"
    assert httpx.get(tp1["url"] + "/health", timeout=5).status_code == 200


def test_pooled_client_survives_a_500(tmp_path):
    """A handler bug's 500 says Connection: close, so a pooled client's next request works."""
    import uvicorn

    from dsv41.engine.server import create_app

    app = create_app(FakeEngine(boom=RuntimeError("bug")), "m", 64)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            for _ in range(3):
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 500 and r.headers.get("connection") == "close"
                assert c.get("/v1/models").status_code == 200
        # the same on one raw keep-alive connection: the 500 either says close or the connection stays usable
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        body = b'{"prompt": "x", "max_tokens": 1}'
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head = data.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 500") and b"connection: close" in head, head
        s.close()
    finally:
        server.should_exit = True
        th.join(10)
