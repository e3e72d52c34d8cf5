"""Slow and idle clients against every HTTP server (``make fuzz``; outside ``make test``).

For each server of ``tests/unit/test_http_servers_every_endpoint.STARTERS`` (every module of
python/dsv41 that builds one; that test keeps the list complete), ``SLOW_FUZZ_SECONDS`` (default
15) of hostile clients from three loopback addresses, chosen by a seeded ``random.Random``
(``FUZZ_SEED``): connections that send nothing, heads trickled a byte at a time, heads cut off
half way, request bodies promised and never sent, bursts of connections opened and dropped,
answers never read. Meanwhile a prober asks every GET endpoint of the server (with a query
string) from its own address every 50 ms, each on a fresh connection (as a load balancer's or
Prometheus' first probe; an idle keep-alive connection may be closed to make room, which HTTP
clients retry like a keep-alive timeout). Every probe must be answered (200; ``/ready`` may say
503 while loading): idle and slow clients never silence health. One ``FUZZ {json}`` line per server
with the counts, for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "unit"))
from httpserverutil import LIMITS, STARTERS  # noqa: E402

SECONDS = float(os.environ.get("SLOW_FUZZ_SECONDS", "15"))
SEED = int(os.environ.get("FUZZ_SEED", "45"))
# Three attacking addresses: each may hold a quarter of a server's connections busy (a stream
# it does not read, until the send timeout), so three leave room; a fourth would make it a full
# server, whose newcomers get 503 with Retry-After by design.
SOURCES = [f"127.0.0.{i}" for i in range(1, 4)]
PROBER = "127.0.1.1"


def _attack(addr, rng: random.Random, held: list, stop: threading.Event, counts: dict) -> None:
    """One hostile client behaviour; connections it keeps go into ``held`` (closed later)."""
    kind = rng.choice(["idle", "trickle", "cut-head", "no-body", "burst", "no-read"])
    counts[kind] = counts.get(kind, 0) + 1
    try:
        s = socket.create_connection(addr, source_address=(rng.choice(SOURCES), 0), timeout=2)
    except OSError:
        counts["connect_failed"] = counts.get("connect_failed", 0) + 1
        return
    try:
        if kind == "idle":
            held.append(s)
            return
        if kind == "trickle":
            for b in b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n"[: rng.randint(1, 20)]:
                if stop.is_set():
                    break
                s.sendall(bytes([b]))
                time.sleep(0.05)
            held.append(s)
            return
        if kind == "cut-head":
            s.sendall(b"GET /health HTTP/1.1\r\nHo")
            held.append(s)
            return
        if kind == "no-body":
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 5000\r\n\r\n{"model"'
            )
            held.append(s)
            return
        if kind == "burst":
            s.close()
            for _ in range(rng.randint(5, 30)):
                try:
                    socket.create_connection(addr, source_address=(rng.choice(SOURCES), 0), timeout=2).close()
                except OSError:
                    pass
            return
        if kind == "no-read":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
            held.append(s)
            return
    except OSError:
        counts["closed_by_server"] = counts.get("closed_by_server", 0) + 1
        s.close()


@pytest.mark.parametrize("name", sorted(STARTERS))
def test_slow_clients_never_silence_health(name, tmp_path, monkeypatch) -> None:
    for k, v in LIMITS.items():
        monkeypatch.setenv(k, v)
    addr, paths, stop_server = STARTERS[name](tmp_path, monkeypatch)
    rng = random.Random(f"{SEED}-{name}")
    stop = threading.Event()
    probes: dict = {}
    failures: list = []

    def prober() -> None:
        with httpx.Client(
            transport=httpx.HTTPTransport(local_address=PROBER), timeout=10, headers={"Connection": "close"}
        ) as c:
            while not stop.is_set():
                for path in paths:
                    try:
                        code = c.get(f"http://{addr[0]}:{addr[1]}{path}?probe=1").status_code
                    except httpx.HTTPError as exc:
                        code = type(exc).__name__
                    probes[(path, code)] = probes.get((path, code), 0) + 1
                    if not (code == 200 or (path == "/ready" and code == 503)):
                        failures.append((path, code))
                time.sleep(0.05)

    t = threading.Thread(target=prober, daemon=True)
    counts: dict = {}
    held: list = []
    try:
        t.start()
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            _attack(addr, rng, held, stop, counts)
            if len(held) > 200:  # the attacker's own descriptors: drop the oldest
                for s in held[:100]:
                    s.close()
                del held[:100]
    finally:
        stop.set()
        t.join(15)
        for s in held:
            s.close()
        stop_server()
    answered = sum(n for (p, c), n in probes.items())
    print(
        "FUZZ "
        + json.dumps(
            {
                "campaign": "slow-clients",
                "server": name,
                "seconds": SECONDS,
                "attacks": counts,
                "probes": answered,
                "probe_codes": {f"{p} {c}": n for (p, c), n in sorted(probes.items(), key=str)},
            }
        )
    )
    assert answered > 0 and not failures, failures[:10]
