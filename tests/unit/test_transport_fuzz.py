"""Hypothesis fuzzer: malformed frames thrown at a live server never crash it, never produce
wrong rows, and never disturb a well-behaved client (both implementations)."""

from __future__ import annotations

import hashlib
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41.transport import native, parse_url
from dsv41.transport import protocol as P
from dsv41.transport.server import RowServer, RowTable
from dsv41.transport.tcp import TcpClient

ROWS = 300


def _table():
    rng = np.random.default_rng(11)
    return RowTable(hashlib.sha256(b"fuzz").digest(), 1,
                    rng.integers(0, 256, (ROWS, 256), dtype=np.uint8), rng.integers(0, 256, (ROWS, 8), dtype=np.uint8))


TABLE = _table()
CHECKED: list[int] = []  # OK lookup replies whose rows were compared (sanity check below)


@pytest.fixture(scope="module", params=[True, False], ids=["cpp", "python"])
def server(request):
    if request.param and native._fastrow is None:
        pytest.fail("C++ extension not built")
    srv = RowServer([TABLE], [parse_url("tcp://127.0.0.1:0")], native=request.param)
    ep = srv.start()[0]
    yield srv, ep
    srv.stop(2)


def _read_replies(s: socket.socket, sent_rows: list[np.ndarray | None]) -> None:
    """Read every reply there is; any OK lookup reply must hold exactly the right rows."""
    buf = b""
    s.settimeout(0.2)
    try:
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    pos = 0
    while pos + P.REP.size <= len(buf):
        magic, ver, status, rid, count, plen = P.REP.unpack_from(buf, pos)
        assert magic == P.MAGIC and ver == P.VERSION
        assert status in P.STATUS_NAMES
        pos += P.REP.size
        body = buf[pos : pos + plen]
        pos += plen
        if status == P.ST_OK and plen and rid < len(sent_rows) and sent_rows[rid] is not None:
            r = sent_rows[rid].astype(np.int64)
            want = np.concatenate([TABLE.weight[r], TABLE.scale[r]], axis=1).tobytes()
            assert body == want[: len(body)]
            CHECKED.append(len(body))


frame_fields = st.fixed_dictionaries(
    {
        "magic": st.one_of(st.just(P.MAGIC), st.integers(0, 2**32 - 1)),
        "version": st.one_of(st.just(P.VERSION), st.integers(0, 2**16 - 1)),
        "op": st.one_of(st.sampled_from([1, 2, 3, 4]), st.integers(0, 2**16 - 1)),
        "ident": st.one_of(st.just(TABLE.identity), st.binary(min_size=32, max_size=32)),
        "rows": st.lists(st.one_of(st.integers(0, ROWS - 1), st.integers(0, 2**64 - 1)), max_size=40),
        "count_delta": st.one_of(st.just(0), st.integers(-3, 3)),
        "plen_delta": st.one_of(st.just(0), st.integers(-16, 16), st.just(2**31)),
        "trunc": st.one_of(st.none(), st.integers(0, 400)),
        "junk": st.binary(max_size=64),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(frame_fields, min_size=1, max_size=4))
def test_malformed_frames(server, frames):
    srv, ep = server
    s = socket.create_connection((ep.host, ep.port), timeout=2)
    sent_rows: list[np.ndarray | None] = []
    data = b""
    for i, f in enumerate(frames):
        rows = np.array(f["rows"], dtype=np.uint64)
        count = max(0, len(rows) + f["count_delta"])
        payload = rows.tobytes()
        plen = max(0, min(2**32 - 1, len(payload) + f["plen_delta"]))
        frame = P.REQ.pack(f["magic"], f["version"], f["op"], i, f["ident"], count, plen) + payload
        if f["trunc"] is not None:
            frame = frame[: f["trunc"]]
        data += frame + f["junk"]
        ok = f["op"] == P.OP_LOOKUP and count == len(rows) and plen == len(payload) and f["ident"] == TABLE.identity
        sent_rows.append(rows if ok else None)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # server closed on a fatal frame before reading everything
    _read_replies(s, sent_rows)
    s.close()
    # the server still answers a good client with exact rows
    c = TcpClient(ep)
    out = np.empty((3, 264), np.uint8)
    c.lookup_into(TABLE.identity, np.array([0, ROWS - 1, 7], np.uint64), [out], 2.0)
    r = np.array([0, ROWS - 1, 7])
    np.testing.assert_array_equal(out, np.concatenate([TABLE.weight[r], TABLE.scale[r]], axis=1))
    c.close()
    assert srv.snapshot()["client_errors"] == 0


def test_fuzzer_reached_row_replies():
    """The fuzzer above must have compared real row replies, not only refusals."""
    assert len(CHECKED) > 0 and max(CHECKED) > 0
