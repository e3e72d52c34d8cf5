"""The table server's data port bounds what clients can hold: a connection cap (past it, or past
half of it from one client address, a new connection is closed at once and counted as the
``connection_cap`` refusal) and a send timeout (a client that asks for a large lookup and never
reads its answer is disconnected after ``send_timeout_s``, its buffers freed). Both request loops
(C++ and Python) are checked. Loopback only."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from dsv41.transport import native, protocol as P
from dsv41.transport.server import RowServer, RowTable
from dsv41.transport.url import Endpoint

ROWS = 200_000  # 52.8 MB of rows: far more than the socket buffers hold
LOOPS = [False] + ([True] if native._fastrow is not None else [])


@pytest.fixture(params=LOOPS, ids=lambda n: "c++" if n else "python")
def server(request):
    t = RowTable(b"\x07" * 32, 3, np.zeros((ROWS, 256), np.uint8), np.zeros((ROWS, 8), np.uint8))
    srv = RowServer([t], [Endpoint("tcp", "127.0.0.1", 0)], native=request.param, max_connections=4, send_timeout_s=0.5)
    addr = srv.start()[0]
    yield srv, (addr.host, addr.port), t
    srv.stop(1.0)


def _closed_at_once(s: socket.socket) -> bool:
    s.settimeout(3)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _connect(addr, source: str) -> socket.socket:
    return socket.create_connection(addr, source_address=(source, 0), timeout=5)


def test_connections_past_the_cap_or_a_clients_half_are_closed(server) -> None:
    srv, addr, _t = server
    mine = [_connect(addr, "127.0.0.1") for _ in range(2)]
    try:
        with _connect(addr, "127.0.0.1") as third:  # over this client's half
            assert _closed_at_once(third)
        others = [_connect(addr, "127.0.0.2") for _ in range(2)]
        with _connect(addr, "127.0.0.3") as fifth:  # over the cap
            assert _closed_at_once(fifth)
        for s in mine + others:  # the admitted ones still answer
            s.sendall(P.REQ.pack(P.MAGIC, P.VERSION, P.OP_PING, 1, b"\0" * 32, 0, 0))
            s.settimeout(5)
            assert len(s.recv(P.REP.size)) > 0
        assert srv.snapshot()["refusals"].get("connection_cap") == 2
    finally:
        for s in mine + locals().get("others", []):
            s.close()


def test_a_client_that_never_reads_a_large_answer_is_disconnected(server) -> None:
    srv, addr, t = server
    ids = np.arange(ROWS, dtype="<u8")
    s = _connect(addr, "127.0.0.1")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.sendall(P.REQ.pack(P.MAGIC, P.VERSION, P.OP_LOOKUP, 1, t.identity, ROWS, 8 * ROWS) + ids.tobytes())
        end = time.monotonic() + 10
        while srv.snapshot()["connections"] and time.monotonic() < end:
            time.sleep(0.05)
        assert srv.snapshot()["connections"] == 0, "the server still holds the client that does not read"
    finally:
        s.close()
