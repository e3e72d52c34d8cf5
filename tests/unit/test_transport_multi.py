"""Protocol version 2 (OP_LOOKUP_MULTI, ``lookup_segs``) and the version negotiation with a
version-1 peer; every server/client test runs on both implementations (C++ and pure Python)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from dsv41.transport import Refused, open_client, parse_url, protocol as P
from dsv41.transport.server import RowServer
from dsv41.transport.tcp import TcpClient
from serverutil import (
    V1Server,
    expected,
    impl,  # noqa: F401 - the fixture
    make_table,
    raw_conn,
    recv_exact,
    settled_snapshot,
)


@pytest.fixture
def served(impl):
    tables = [make_table(1, 1), make_table(2, 14, rows=3000)]
    srv = RowServer(tables, [parse_url("tcp://127.0.0.1:0")], native=impl)
    ep = srv.start()[0]
    yield srv, ep, tables, impl
    srv.stop(2)


def client(ep, impl) -> TcpClient:
    c = TcpClient(ep, native=impl)
    c.hello(1.0, version=P.MAX_VERSION)
    assert c.multi_table
    return c


def segs_for(tables, ids):
    outs = [np.full((len(r), 264), 0xEE, np.uint8) for r in ids]
    return tuple(
        (t.identity, np.asarray(r, np.int64), t.rows, o) for t, r, o in zip(tables, ids, outs, strict=False)
    ), outs


def test_multi_lookup_exact(served):
    srv, ep, tables, impl = served
    c = client(ep, impl)
    rng = np.random.default_rng(0)
    for n0, n1 in ((24, 24), (96, 1), (0, 5), (20000, 17000)):  # last: several gather chunks
        ids = [rng.integers(0, tables[0].rows, n0), rng.integers(0, tables[1].rows, n1)]
        segs, outs = segs_for(tables, ids)
        assert c.lookup_segs(segs, 5.0) == (0, n0 + n1, 0)
        for t, r, o in zip(tables, ids, outs, strict=False):
            np.testing.assert_array_equal(o, expected(t, r))
    # one segment is a plain version-1 lookup; uint64 ids too
    ids = np.array([4, 0, 4999], np.uint64)
    out = np.empty((3, 264), np.uint8)
    assert c.lookup_segs(((tables[0].identity, ids, tables[0].rows, out),), 1.0)[0] == 0
    np.testing.assert_array_equal(out, expected(tables[0], ids))
    # the same table twice in one request
    segs, outs = segs_for([tables[1], tables[1]], [[1, 2], [2999]])
    assert c.lookup_segs(segs, 1.0)[0] == 0
    np.testing.assert_array_equal(np.concatenate(outs), expected(tables[1], [1, 2, 2999]))
    c.close()


def test_lookup_segs_checks_send_nothing(served):
    srv, ep, tables, impl = served
    c = client(ep, impl)
    t = tables[0]
    before = settled_snapshot(srv)["requests"]
    out = np.empty((2, 264), np.uint8)
    assert c.lookup_segs(((t.identity, np.array([1, 2], np.int32), t.rows, out),), 1.0) == (2, 0, 0)
    assert c.lookup_segs(((t.identity, [1, 2], t.rows, out),), 1.0) == (2, 0, 0)
    assert c.lookup_segs(((t.identity, np.arange(4, dtype=np.int64)[::2], t.rows, out),), 1.0) == (2, 0, 0)
    assert c.lookup_segs(((t.identity, np.array([1, -1], np.int64), t.rows, out),), 1.0) == (3, 0, 1)
    assert c.lookup_segs(((t.identity, np.array([t.rows, 0], np.int64), t.rows, out),), 1.0) == (3, 0, 0)
    ok = (t.identity, np.array([1], np.int64), t.rows, np.empty((1, 264), np.uint8))
    assert c.lookup_segs((ok, (t.identity, np.array([1, 2], np.int64), 2, out)), 1.0) == (3, 1, 1)
    ro = np.empty((2, 264), np.uint8)
    ro.flags.writeable = False
    for bad in (
        np.empty((3, 264), np.uint8),
        np.empty((2, 263), np.uint8),
        ro,
        np.empty((2, 264), np.int8),
        np.empty((2, 528), np.uint8)[:, ::2],
        None,
    ):
        assert c.lookup_segs(((t.identity, np.array([1, 2], np.int64), t.rows, bad),), 1.0) == (4, 0, 0)
    with pytest.raises(ValueError):
        c.lookup_segs((), 1.0)
    assert settled_snapshot(srv)["requests"] == before  # nothing reached the server
    assert c.lookup_segs((ok,), 1.0)[0] == 0
    c.close()


def test_multi_refusals_keep_connection(served):
    srv, ep, tables, impl = served
    c = client(ep, impl)
    ghost = make_table(9, 3)
    segs, outs = segs_for([tables[0], ghost], [[1], [2]])
    with pytest.raises(Refused) as e:
        c.lookup_segs(segs, 1.0)
    assert e.value.reason == "wrong_identity" and c.connected
    assert (outs[0] == 0xEE).all()  # a refusal writes no row byte
    # the server's own range check (a client limit larger than the table)
    segs = (
        (tables[0].identity, np.array([1], np.int64), 1 << 40, np.empty((1, 264), np.uint8)),
        (tables[1].identity, np.array([tables[1].rows], np.int64), 1 << 40, np.empty((1, 264), np.uint8)),
    )
    with pytest.raises(Refused) as e:
        c.lookup_segs(segs, 1.0)
    assert e.value.reason == "out_of_range" and c.connected
    segs, outs = segs_for(tables, [[7], [8]])
    assert c.lookup_segs(segs, 1.0)[0] == 0
    c.close()


def v2(op, rid, count, payload):
    return P.REQ.pack(P.MAGIC, 2, op, rid, bytes(32), count, len(payload)) + payload


def seg(ident, n, reserved=0):
    return P.SEG.pack(ident, n, reserved)


def reply(s):
    magic, ver, status, rid, count, plen = P.REP.unpack(recv_exact(s, P.REP.size))
    assert magic == P.MAGIC
    return ver, status, rid, count, recv_exact(s, plen) if plen else b""


def test_raw_v2_frames(served):
    srv, ep, tables, impl = served
    a, b = tables
    ids = struct.pack("<3Q", 5, 6, 7)
    s = raw_conn(ep)
    # OP_LOOKUP_MULTI in a version-1 frame: unknown_op, as a version-1 server says
    s.sendall(P.REQ.pack(P.MAGIC, 1, P.OP_LOOKUP_MULTI, 1, bytes(32), 1, 40 + 8) + seg(a.identity, 1) + ids[:8])
    assert reply(s)[:3] == (1, P.ST_UNKNOWN_OP, 1)
    cases = [
        (v2(P.OP_LOOKUP_MULTI, 2, 0, b""), P.ST_BAD_FRAME),
        (v2(P.OP_LOOKUP_MULTI, 3, 17, b"\0" * 40 * 17), P.ST_BAD_FRAME),
        (v2(P.OP_LOOKUP_MULTI, 4, 2, seg(a.identity, 1) + seg(b.identity, 2) + ids), P.ST_OK),
        (v2(P.OP_LOOKUP_MULTI, 5, 2, seg(a.identity, 1) + seg(b.identity, 3) + ids), P.ST_BAD_FRAME),
        (v2(P.OP_LOOKUP_MULTI, 6, 1, seg(a.identity, 3, reserved=1) + ids), P.ST_BAD_FRAME),
        (v2(P.OP_LOOKUP_MULTI, 7, 2, seg(a.identity, 2)), P.ST_BAD_FRAME),
        (v2(P.OP_LOOKUP_MULTI, 8, 1, seg(a.identity, 1) + struct.pack("<Q", a.rows)), P.ST_OUT_OF_RANGE),
        (P.REQ.pack(P.MAGIC, 2, P.OP_LOOKUP, 9, a.identity, 3, 24) + ids, P.ST_OK),
        (v2(P.OP_PING, 10, 0, b""), P.ST_OK),
    ]
    for frame, status in cases:
        s.sendall(frame)
        ver, st, rid, count, body = reply(s)
        assert (ver, st) == (2, status), rid  # replies echo the request's version
        if rid == 4:
            assert count == 3
            assert body == np.concatenate([expected(a, [5]), expected(b, [6, 7])]).tobytes()
        if rid == 9:
            assert body == expected(a, [5, 6, 7]).tobytes()
    s.sendall(P.REQ.pack(P.MAGIC, 1, P.OP_PING, 11, bytes(32), 0, 0))
    assert reply(s)[:3] == (1, P.ST_OK, 11)  # version-1 frames still answered as version 1
    s.sendall(P.REQ.pack(P.MAGIC, P.MAX_VERSION + 1, P.OP_PING, 12, bytes(32), 0, 0))
    assert reply(s)[:3] == (P.MAX_VERSION, P.ST_BAD_VERSION, 12)  # tells the newest version spoken
    assert s.recv(1) == b""
    s.close()


def test_v2_client_meets_v1_server(impl):
    tables = [make_table(1, 1), make_table(2, 14)]
    old = V1Server(tables)
    try:
        c = open_client(old.ep, [t.identity for t in tables])
        assert old.refused == 1 and not c.multi_table  # refused once, reconnected as version 1
        out = np.empty((2, 264), np.uint8)
        assert c.lookup_segs(((tables[0].identity, np.array([3, 9], np.int64), tables[0].rows, out),), 1.0)[0] == 0
        np.testing.assert_array_equal(out, expected(tables[0], [3, 9]))
        segs, _ = segs_for(tables, [[1], [2]])
        with pytest.raises(ValueError, match="version 1"):
            c.lookup_segs(segs, 1.0)  # several tables need version 2: callers split
        c.close()
        # a version-2 HELLO straight to the old server: a clear refusal naming both versions
        c = TcpClient(old.ep, native=impl)
        with pytest.raises(Refused, match="does not speak protocol version 2 .its newest: 1"):
            c.hello(1.0, version=2)
        assert not c.connected
    finally:
        old.close()


def test_v1_client_meets_v2_server(served):
    srv, ep, tables, impl = served
    c = TcpClient(ep, native=impl)  # a client that only ever sends version-1 frames
    assert c.hello(1.0)[0]["rows"] == tables[0].rows and not c.multi_table
    out = np.empty((2, 264), np.uint8)
    c.lookup_into(tables[1].identity, np.array([0, 2999], np.uint64), [out], 1.0)
    np.testing.assert_array_equal(out, expected(tables[1], [0, 2999]))
    c.close()
