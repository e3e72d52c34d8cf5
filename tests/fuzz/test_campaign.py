"""The long fuzz campaign (``make fuzz``; not part of ``make test``), issue 10.

At least ``FUZZ_FRAMES`` (default 100,000) malformed frames against each of: the Engram row
protocol over TCP (C++ and Python servers), the ``nixl://`` control channel, the drafter
protocol and the HTTP API of ``dsv41 engine serve``. Each server runs in its own process; the
campaign asserts 0 crashes (the process lives and a good client still gets exact answers at
every checkpoint), 0 wrong rows (every OK row reply compared with the table) and bounded
memory (the server's RSS, sampled every checkpoint, grows by less than ``RSS_BOUND_MIB`` after
warm-up). Each test prints one ``FUZZ {json}`` line with the counts for docs/benchmarks.md.

The frame generators are the CI fuzzers' (``tests/unit/framefuzz.py``, used by ``test_transport_fuzz.py``;
``tests/unit/test_drafter_worker.py``, ``tests/unit/test_engine_api_fuzz.py``), drawn with a
seeded ``random.Random`` (``FUZZ_SEED``) instead of hypothesis, which is too slow for 10^5.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "unit"))
from dsv41.transport import protocol as P  # noqa: E402
from framefuzz import ROWS, TABLE, build_frames, random_frame, read_replies  # noqa: E402

FRAMES = int(os.environ.get("FUZZ_FRAMES", "100000"))
SEED = int(os.environ.get("FUZZ_SEED", "41"))
RSS_BOUND_MIB = 64
CHECK_EVERY = 2000  # malformed frames between checkpoints (liveness, exact rows, RSS sample)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"process {pid} is gone")


class Child:
    """A server of ``fuzz_servers.py`` in its own process."""

    def __init__(self, kind: str, tmp: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", UCX_TLS="tcp", OMP_NUM_THREADS="1")
        self.log = tmp / f"{kind}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fuzz_servers.py"), kind, str(tmp)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "wb"),
            env=env,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), (line, self.log.read_text()[-2000:])
        self.info = json.loads(line[6:])
        self.port, self.pid = self.info["port"], self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> str:
        out = ""
        if self.alive():
            self.proc.stdin.close()
            try:
                out = self.proc.stdout.read()
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return out


class Tally:
    """Counts and RSS samples of one campaign; ``report`` prints the FUZZ line."""

    def __init__(self, name: str, pid: int) -> None:
        self.name, self.pid = name, pid
        self.malformed = self.frames = self.connections = self.rows_compared = self.checkpoints = 0
        self.t0 = time.monotonic()
        self.base = self.peak = 0

    def sample(self) -> None:
        rss = _rss(self.pid)
        if self.checkpoints == 2:  # after warm-up (CHECK_EVERY frames): buffers, pools and caches exist
            self.base = rss
        self.peak = max(self.peak, rss)

    def report(self) -> dict:
        d = {
            "target": self.name,
            "malformed_frames": self.malformed,
            "frames": self.frames,
            "connections": self.connections,
            "rows_compared": self.rows_compared,
            "checkpoints": self.checkpoints,
            "crashes": 0,
            "wrong_rows": 0,
            "rss_base_mib": round(self.base / 2**20, 1),
            "rss_peak_mib": round(self.peak / 2**20, 1),
            "seconds": round(time.monotonic() - self.t0, 1),
        }
        print("FUZZ " + json.dumps(d), flush=True)
        assert self.peak - self.base < RSS_BOUND_MIB << 20, d
        return d


def _good_lookup(port: int) -> None:
    from dsv41.transport import parse_url
    from dsv41.transport.tcp import TcpClient

    c = TcpClient(parse_url(f"tcp://127.0.0.1:{port}"))
    r = np.array([0, ROWS - 1, 7, 123])
    out = np.empty((len(r), P.ROW_BYTES), np.uint8)
    c.lookup_into(TABLE.identity, r.astype(np.uint64), [out], 5.0)
    np.testing.assert_array_equal(out, np.concatenate([TABLE.weight[r], TABLE.scale[r]], axis=1))
    c.close()


def _nixl_hello_frame(rng: random.Random, i: int) -> dict:
    """A NIXL handshake (payload: expected identities) with the count, identities or length off."""
    n = rng.randint(0, 4)
    ids = [TABLE.identity if rng.random() < 0.5 else rng.randbytes(32) for _ in range(n)]
    payload = b"".join(ids)
    count = n + (rng.randint(-2, 2) if rng.random() < 0.3 else 0)
    if rng.random() < 0.2:
        payload = payload[: rng.randrange(len(payload) + 1)] + rng.randbytes(rng.randint(0, 40))
    return {"raw": P.REQ.pack(P.MAGIC, P.VERSION, P.OP_NIXL_HELLO, i, bytes(32), max(0, count), len(payload)) + payload}


def _row_campaign(kind: str, tmp: Path) -> dict:
    child = Child(kind, tmp)
    t = Tally(f"engram-{kind}", child.pid)
    rng = random.Random(SEED)
    ops = (P.OP_NIXL_HELLO, P.OP_HELLO, P.OP_PING, None) if kind == "nixl" else (None,)
    try:
        next_check = 0
        while t.malformed < FRAMES:
            frames = [random_frame(rng, ops) for _ in range(rng.randint(1, 6))]
            if rng.random() < 0.5:  # a well-formed lookup among them, so row replies are compared often
                good = random_frame(rng)
                good.update({"break": None, "rows": [rng.randrange(ROWS) for _ in range(rng.randint(1, 40))]})
                frames.insert(rng.randrange(len(frames) + 1), good)
            data, sent_rows = build_frames(frames, TABLE.identity)
            t.malformed += sum(f["break"] is not None for f in frames)
            t.frames += len(frames)
            if kind == "nixl" and rng.random() < 0.3:
                h = _nixl_hello_frame(rng, len(frames))
                data += h["raw"]
                sent_rows.append(None)
                t.malformed += 1
                t.frames += 1
            s = socket.create_connection(("127.0.0.1", child.port), timeout=5)
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # closed on a fatal frame before reading everything
            t.rows_compared += read_replies(s, sent_rows)
            s.close()
            t.connections += 1
            if t.malformed >= next_check:
                assert child.alive(), child.log.read_text()[-3000:]
                _good_lookup(child.port)
                t.checkpoints += 1
                t.sample()
                next_check += CHECK_EVERY
        _good_lookup(child.port)
        assert child.alive()
        return t.report()
    finally:
        stats = child.close()
        assert "client_errors" not in stats or json.loads(stats.split("STATS ", 1)[1])["client_errors"] == 0, stats


@pytest.mark.parametrize("kind", ["tcp", "tcp-python", "nixl"])
def test_engram_row_protocol_campaign(kind, tmp_path):
    if kind == "nixl":
        pytest.importorskip("nixl_cu12")
    _row_campaign(kind, tmp_path)


def test_drafter_protocol_campaign(tmp_path):
    from dsv41.drafter import protocol as D
    from dsv41.drafter.client import DrafterClient

    child = Child("drafter", tmp_path)
    from fuzz_servers import DRAFTER_H, DRAFTER_TARGET, DRAFTER_V

    t = Tally("drafter", child.pid)
    rng = random.Random(SEED)
    expected = {"drafter": child.info["drafter"], "markov": child.info["markov"], "target": DRAFTER_TARGET}
    good_rng = np.random.default_rng(3)
    good = D.Round(
        [
            D.RoundItem(
                "req-good",
                good_rng.integers(0, DRAFTER_V, 9),
                good_rng.standard_normal(DRAFTER_H).astype(np.float32),
                4,
                0.0,
                5,
                9,
            )
        ],
        DRAFTER_H,
        5000,
    )
    valid = good.encode()

    def good_round():
        c = DrafterClient(f"tcp://127.0.0.1:{child.port}", expected, timeout_ms=5000)
        try:
            d = c.round(good)
            return [x.tolist() for x in d.tokens]
        finally:
            c.close()

    reference = good_round()

    def malformed_frame(i: int) -> bytes:
        how = rng.randrange(6)
        if how == 0:  # a valid header around a random body (any message type, CRC right or wrong)
            body = rng.randbytes(rng.randint(0, 200))
            f = bytearray(D.pack_frame(D.Msg.ROUND, b"", round_id=i))
            f[6:8] = rng.choice([1, 2, 3, 4, 5, 9, rng.getrandbits(16)]).to_bytes(2, "little")
            f[20:24] = len(body).to_bytes(4, "little")
            crc = zlib.crc32(body) ^ (1 if rng.random() < 0.3 else 0)
            f[24:28] = (crc & 0xFFFFFFFF).to_bytes(4, "little")
            return bytes(f) + body
        if how == 1:  # one byte of a valid round frame changed
            f = bytearray(D.pack_frame(D.Msg.ROUND, valid, round_id=i))
            f[rng.randrange(len(f))] = rng.getrandbits(8)
            return bytes(f)
        if how == 2:  # one byte of a valid round payload changed, CRC recomputed (reaches the decoder)
            p = bytearray(valid)
            for _ in range(rng.randint(1, 3)):
                p[rng.randrange(len(p))] = rng.getrandbits(8)
            return D.pack_frame(D.Msg.ROUND, bytes(p), round_id=i)
        if how == 3:  # truncated or over-long payload
            p = valid[: rng.randrange(len(valid))] if rng.random() < 0.5 else valid + rng.randbytes(rng.randint(1, 30))
            return D.pack_frame(D.Msg.ROUND, p, round_id=i)
        if how == 4:  # header fields out of range
            f = bytearray(D.pack_frame(D.Msg.ROUND, valid, round_id=i))
            off, width = rng.choice([(0, 4), (4, 2), (6, 2), (20, 4)])
            f[off : off + width] = rng.randbytes(width)
            return bytes(f)
        return rng.randbytes(rng.randint(1, D.HEADER_SIZE + 40))  # raw junk

    try:
        next_check = 0
        while t.malformed < FRAMES:
            with socket.create_connection(("127.0.0.1", child.port), timeout=5) as s:
                try:
                    if rng.random() < 0.9:
                        D.send_frame(s, D.Msg.HELLO_REQ, D.HelloRequest(DRAFTER_TARGET).encode())
                        head, _ = D.read_frame(s)
                        assert head.msg == D.Msg.HELLO
                    n = rng.randint(1, 4)
                    s.sendall(b"".join(malformed_frame(i) for i in range(n)))
                    t.malformed += n
                    t.frames += n
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(5)
                    while s.recv(65536):
                        pass
                except (OSError, D.ProtocolError):
                    pass  # refused and closed: what a fatal frame gets
            t.connections += 1
            if t.malformed >= next_check:
                assert child.alive(), child.log.read_text()[-3000:]
                assert good_round() == reference
                t.rows_compared += 1
                t.checkpoints += 1
                t.sample()
                next_check += CHECK_EVERY
        assert good_round() == reference and child.alive()
        t.report()
    finally:
        child.close()


def test_http_api_campaign(tmp_path, tmp_path_factory):
    import httpx

    from engineutil import engine_env, free_port, lab_assets, serve_cmd, start, stop, wait_ready

    assets = lab_assets(tmp_path_factory)
    port = free_port()
    log = tmp_path / "server.log"
    proc = start(serve_cmd(assets, port=port, extra=["--kv-cache-tokens", "4096"]), engine_env(), log)
    rng = random.Random(SEED)
    fields = [
        "prompt",
        "messages",
        "model",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "seed",
        "n",
        "best_of",
        "stream",
        "stream_options",
        "return_token_ids",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "echo",
        "suffix",
        "tools",
        "logit_bias",
        "stop",
    ]

    def rand_json(depth=0):
        k = rng.randrange(9 if depth < 3 else 6)
        if k == 0:
            return None
        if k == 1:
            return rng.random() < 0.5
        if k == 2:
            return rng.choice([0, 1, -1, 2**31, 2**64, -(2**70), rng.randint(-1000, 1000)])
        if k == 3:
            return rng.choice([0.0, -0.0, 1e308, -1e-320, float("inf"), float("nan"), rng.uniform(-5, 5)])
        if k in (4, 5):
            return "".join(
                chr(
                    rng.choice(
                        [
                            rng.randint(32, 126),
                            rng.randint(0x80, 0x7FF),
                            rng.randint(0x800, 0xFFFF),
                            rng.randint(0x10000, 0x10FFFF),
                        ]
                    )
                )
                for _ in range(rng.randint(0, 12))
            )
        if k == 6:
            return [rand_json(depth + 1) for _ in range(rng.randint(0, 4))]
        return {
            "".join(rng.choice("abcxyz_") for _ in range(rng.randint(0, 6))): rand_json(depth + 1)
            for _ in range(rng.randint(0, 4))
        }

    def body() -> bytes:
        base = rng.choice(
            [
                {"prompt": "The dog ", "max_tokens": 2},
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ]
        )
        for _ in range(rng.randint(1, 4)):
            base[rng.choice(fields)] = rand_json()
        raw = json.dumps(base).encode()
        how = rng.randrange(10)
        if how == 0:
            raw = raw[:-1] + b', "seed": ' + b"9" * rng.randint(4300, 6000) + b"}"
        elif how == 1:
            raw = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.getrandbits(8)
            raw = bytes(raw)
        elif how == 2:
            raw = raw[: rng.randrange(len(raw))]
        elif how == 3:
            raw = b'{"prompt": "\\ud800", "max_tokens": 1}'
        elif how == 4:
            d = rng.randint(1, 3000)
            raw = b'{"prompt": ' + b"[" * d + b"]" * d + b"}"
        return raw

    t = None
    try:
        wait_ready(port, proc, log)
        t = Tally("http", proc.pid)
        statuses: dict[int, int] = {}
        lock = threading.Lock()
        failures: list[str] = []
        bodies = iter(lambda: (rng.choice(["/v1/completions", "/v1/chat/completions"]), body()), None)

        slowest = [0.0, b""]

        def client():
            # http.client: a keep-alive connection with far less client-side CPU than httpx. A
            # fuzzed body can be a valid request for up to ~1000 tokens: minutes on a loaded CPU.
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            raw = b""
            try:
                while not failures:
                    with lock:
                        if t.malformed >= FRAMES:
                            return
                        path, raw = next(bodies)
                    t0 = time.monotonic()
                    conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
                    r = conn.getresponse()
                    text = r.read()
                    took = time.monotonic() - t0
                    if r.getheader("connection", "").lower() == "close":
                        conn.close()
                        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                    with lock:
                        if took > slowest[0]:
                            slowest[:] = [took, raw[:200]]
                        statuses[r.status] = statuses.get(r.status, 0) + 1
                        t.frames += 1
                        t.malformed += 400 <= r.status < 500  # refused: what a malformed request gets
                        if r.status >= 500:
                            failures.append(f"{r.status} for {raw[:300]!r}: {text[:300]!r}")
            except Exception as exc:  # noqa: BLE001 - a lost answer is a campaign failure, not a thread warning
                failures.append(f"no answer ({type(exc).__name__}: {exc}) to {raw[:300]!r}")
            finally:
                conn.close()

        workers = [
            threading.Thread(target=client, daemon=True) for _ in range(int(os.environ.get("FUZZ_HTTP_CLIENTS", "2")))
        ]
        for w in workers:
            w.start()
        next_check = 0
        while any(w.is_alive() for w in workers):
            time.sleep(0.2)
            if t.malformed >= next_check or not any(w.is_alive() for w in workers):
                assert proc.poll() is None, log.read_text()[-3000:]
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
                t.checkpoints += 1
                t.sample()
                next_check += CHECK_EVERY
        assert not failures, failures[:5]
        text = log.read_text()
        assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
        t.connections = len(workers)
        t.report()
        print("FUZZ-HTTP-STATUSES " + json.dumps(statuses) + f" slowest {slowest[0]:.1f} s: {slowest[1]!r}", flush=True)
    finally:
        stop(proc)
