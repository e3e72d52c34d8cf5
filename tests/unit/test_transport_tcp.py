"""TCP row transport: exact rows, refusals with a status, generation checks, timeouts, isolation,
drain.  Every test runs on both implementations (C++ hot path and pure Python)."""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time

import numpy as np
import pytest

from dsv41.transport import Refused, TransportError, TransportTimeout, native, open_client, parse_url, protocol as P
from dsv41.transport.server import RowServer
from dsv41.transport.tcp import TcpClient
from serverutil import (
    ROWS,
    expected,
    impl,  # noqa: F401 - the fixture
    make_table,
    raw_conn,
    recv_exact,
    settled_snapshot,
)


@pytest.fixture
def served(impl):
    tables = [make_table(1, 1), make_table(2, 14)]
    srv = RowServer(tables, [parse_url("tcp://127.0.0.1:0")], native=impl)
    ep = srv.start()[0]
    yield srv, ep, tables, impl
    srv.stop(2)


def req(op=P.OP_LOOKUP, rid=7, ident=bytes(32), count=0, payload=b"", magic=P.MAGIC, version=P.VERSION, plen=None):
    return P.REQ.pack(magic, version, op, rid, ident, count, len(payload) if plen is None else plen) + payload


def reply(s: socket.socket):
    magic, ver, status, rid, count, plen = P.REP.unpack(recv_exact(s, P.REP.size))
    # replies echo the request's version; bad_version carries the server's newest one
    assert magic == P.MAGIC and ver == (P.MAX_VERSION if status == P.ST_BAD_VERSION else P.VERSION)
    return status, rid, count, recv_exact(s, plen) if plen else b""


def test_lookup_exact_rows_and_hello(served):
    srv, ep, tables, impl = served
    c = TcpClient(ep, native=impl)
    hello = c.hello()
    assert [(h["layer_id"], h["rows"], h["row_bytes"]) for h in hello] == [(1, ROWS, 264), (14, ROWS, 264)]
    assert hello[0]["identity"] == tables[0].identity.hex()
    rng = np.random.default_rng(5)
    for t in tables:
        for n in (1, 24, 96, 20000):  # 20000 > GATHER_CHUNK: streamed reply
            rows = rng.integers(0, ROWS, n).astype(np.uint64)
            rows[0] = ROWS - 1
            out = np.full((n, 264), 0xAB, np.uint8)
            c.lookup_into(t.identity, rows, [out], 5.0)
            np.testing.assert_array_equal(out, expected(t, rows))
    # empty lookup is legal
    c.lookup_into(tables[0].identity, np.zeros(0, np.uint64), [np.empty((0, 264), np.uint8)], 1.0)
    c.close()
    snap = settled_snapshot(srv)
    assert snap["requests"] == 9 and snap["rows"] == 2 * (1 + 24 + 96 + 20000)


def test_multiple_destination_ranges(served):
    srv, ep, tables, impl = served
    c = TcpClient(ep, native=impl)
    rows = np.arange(100, 160, dtype=np.uint64)
    dests = [np.empty((k, 264), np.uint8) for k in (1, 0, 20, 39)]
    c.lookup_into(tables[1].identity, rows, dests, 2.0)
    np.testing.assert_array_equal(np.concatenate(dests), expected(tables[1], rows))
    with pytest.raises(ValueError):
        c.lookup_into(tables[1].identity, rows, [np.empty((4, 264), np.uint8)] * 17, 1.0)
    with pytest.raises(ValueError):
        c.lookup_into(tables[1].identity, rows, [np.empty((59, 264), np.uint8)], 1.0)
    with pytest.raises(ValueError):
        c.lookup_into(tables[1].identity, rows, [np.empty((60, 263), np.uint8)], 1.0)
    c.close()


def test_refusals_keep_connection(served):
    srv, ep, tables, impl = served
    c = TcpClient(ep, native=impl)
    out = np.full((3, 264), 0x5A, np.uint8)
    with pytest.raises(Refused) as ei:
        c.lookup_into(hashlib.sha256(b"other").digest(), np.arange(3, dtype=np.uint64), [out], 1.0)
    assert ei.value.reason == "wrong_identity"
    with pytest.raises(Refused) as ei:
        c.lookup_into(tables[0].identity, np.array([0, ROWS, 1], np.uint64), [out], 1.0)
    assert ei.value.reason == "out_of_range"
    with pytest.raises(Refused) as ei:
        c.lookup_into(tables[0].identity, np.array([0, 2**64 - 1, 1], np.uint64), [out], 1.0)
    assert ei.value.reason == "out_of_range"
    assert (out == 0x5A).all()  # nothing written on refusal
    assert c.connected
    c.lookup_into(tables[0].identity, np.array([4, 2, 0], np.uint64), [out], 1.0)
    np.testing.assert_array_equal(out, expected(tables[0], [4, 2, 0]))
    c.close()
    assert srv.snapshot()["refusals"] == {"wrong_identity": 1, "out_of_range": 2}


def test_unknown_op_bad_frame_ping(served):
    srv, ep, tables, impl = served
    s = raw_conn(ep)
    s.sendall(req(op=99, rid=11, payload=b"xyz"))
    assert reply(s)[:2] == (P.ST_UNKNOWN_OP, 11)
    s.sendall(req(op=P.OP_LOOKUP, rid=12, ident=tables[0].identity, count=3, payload=b"\0" * 16))
    assert reply(s)[:2] == (P.ST_BAD_FRAME, 12)
    s.sendall(req(op=P.OP_PING, rid=13))
    assert reply(s)[:2] == (P.ST_OK, 13)
    s.sendall(req(op=P.OP_NIXL_HELLO, rid=14, count=1, payload=tables[0].identity))
    assert reply(s)[:2] == (P.ST_NOT_SUPPORTED, 14)  # tcp listener has no NIXL
    s.close()


@pytest.mark.parametrize(
    "frame,status",
    [
        (req(magic=0x12345678, rid=3), P.ST_BAD_MAGIC),
        (req(version=P.MAX_VERSION + 1, rid=3), P.ST_BAD_VERSION),
        (req(rid=3, count=P.MAX_ROWS + 1, plen=8 * (P.MAX_ROWS + 1)), P.ST_OVERSIZE),
    ],
    ids=["bad_magic", "bad_version", "oversize"],
)
def test_fatal_frames_refused_then_closed(served, frame, status):
    srv, ep, tables, impl = served
    s = raw_conn(ep)
    s.sendall(frame)
    st, rid, _, _ = reply(s)
    assert (st, rid) == (status, 3)
    assert s.recv(1) == b""  # server closed this connection only
    s.close()
    c = TcpClient(ep, native=impl)  # others unaffected
    out = np.empty((2, 264), np.uint8)
    c.lookup_into(tables[0].identity, np.array([1, 2], np.uint64), [out], 1.0)
    np.testing.assert_array_equal(out, expected(tables[0], [1, 2]))
    c.close()


def test_bad_client_does_not_disturb_another(served):
    srv, ep, tables, impl = served
    good = TcpClient(ep, native=impl)
    bad = raw_conn(ep)
    bad.sendall(req(rid=1)[:30])  # half a header, then silence
    out = np.empty((24, 264), np.uint8)
    rows = np.arange(24, dtype=np.uint64) * 7
    for _ in range(20):
        good.lookup_into(tables[1].identity, rows, [out], 2.0)
        np.testing.assert_array_equal(out, expected(tables[1], rows))
    bad.sendall(b"\xff" * 100)  # completes the header with payload_len 0xffffffff
    assert reply(bad)[0] == P.ST_OVERSIZE
    good.lookup_into(tables[1].identity, rows, [out], 2.0)
    np.testing.assert_array_equal(out, expected(tables[1], rows))
    bad.close()
    good.close()


class FakeServer:
    """A scripted peer: answers each request with ``behaviour(rid, count) -> bytes | None``
    after ``delay_s`` (None = never answer)."""

    def __init__(self, behaviour, delay_s=0.0):
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(4)
        self.ep = parse_url(f"tcp://127.0.0.1:{self.ls.getsockname()[1]}")
        self.behaviour, self.delay_s = behaviour, delay_s
        self.conns = []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        try:
            c, _ = self.ls.accept()
        except OSError:
            return
        self.conns.append(c)
        try:
            while True:
                h = recv_exact(c, P.REQ.size)
                _, _, op, rid, _, count, plen = P.REQ.unpack(h)
                recv_exact(c, plen)
                data = self.behaviour(rid, count)
                if data is None:
                    continue
                time.sleep(self.delay_s)
                c.sendall(data)
        except (OSError, ConnectionError):
            pass

    def close(self):
        self.ls.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the blocked recv and sends FIN
            except OSError:
                pass
            c.close()


def ok_reply(rid, count, fill=0x11):
    return P.REP.pack(P.MAGIC, P.VERSION, P.ST_OK, rid, count, count * 264) + bytes([fill]) * (count * 264)


def test_generation_mismatch_never_reaches_buffer(impl):
    fake = FakeServer(lambda rid, count: ok_reply(rid + 1, count))
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((4, 264), np.uint8)
    with pytest.raises(TransportError, match="request|generation"):
        c.lookup_into(bytes(32), np.arange(4, dtype=np.uint64), [out], 1.0)
    assert not out.any() and not c.connected
    fake.close()


def test_timeout_then_late_reply_is_never_written(impl):
    fake = FakeServer(lambda rid, count: ok_reply(rid, count, 0x77), delay_s=0.3)
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((4, 264), np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        c.lookup_into(bytes(32), np.arange(4, dtype=np.uint64), [out], 0.05)
    assert time.monotonic() - t0 < 0.25  # bounded by the timeout, not by the server
    assert not c.connected  # torn down: the late reply has nowhere to land
    time.sleep(0.4)
    assert not out.any()
    fake.close()


def test_malformed_reply_and_short_reply(impl):
    fake = FakeServer(lambda rid, count: P.REP.pack(P.MAGIC, P.VERSION, P.ST_OK, rid, count + 1, 264 * (count + 1)))
    c = TcpClient(fake.ep, native=impl)
    with pytest.raises(TransportError):
        c.lookup_into(bytes(32), np.arange(2, dtype=np.uint64), [np.zeros((2, 264), np.uint8)], 1.0)
    fake.close()
    fake = FakeServer(lambda rid, count: ok_reply(rid, count)[:100])  # then the peer closes
    c = TcpClient(fake.ep, native=impl)
    threading.Timer(0.1, fake.close).start()
    with pytest.raises(TransportError):
        c.lookup_into(bytes(32), np.arange(2, dtype=np.uint64), [np.zeros((2, 264), np.uint8)], 2.0)


@pytest.mark.parametrize("rows", [4, 24])  # replies shorter / longer than the client's 4 KiB scratch
@pytest.mark.parametrize("plen", [300, 4096])
def test_refusal_payload_never_reaches_buffer(impl, rows, plen):
    """A refusal carrying a payload (no dsv41 server sends one, the wire format allows up to
    4,096 B) is discarded: no destination byte written, connection kept, the next reply exact."""
    n_calls = []

    def behaviour(rid, count):
        n_calls.append(rid)
        if len(n_calls) == 1:
            return P.REP.pack(P.MAGIC, P.VERSION, P.ST_OUT_OF_RANGE, rid, 0, plen) + b"\xee" * plen
        return ok_reply(rid, count, 0x42)

    fake = FakeServer(behaviour)
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((rows, 264), np.uint8)
    with pytest.raises(Refused, match="out_of_range"):
        c.lookup_into(bytes(32), np.arange(rows, dtype=np.uint64), [out], 1.0)
    assert not out.any() and c.connected
    halves = [np.zeros((rows // 2, 264), np.uint8), np.zeros((rows - rows // 2, 264), np.uint8)]
    code, total, _ = c.lookup_segs(((bytes(32), np.arange(rows, dtype=np.int64), 10**6, out),), 1.0)
    assert (code, total) == (0, rows) and (out == 0x42).all()
    c.lookup_into(bytes(32), np.arange(rows, dtype=np.uint64), halves, 1.0)  # rows split over two ranges
    assert all((h == 0x42).all() for h in halves)
    c.close()
    fake.close()


def test_refusal_payload_over_4k_closes(impl):
    fake = FakeServer(lambda rid, count: P.REP.pack(P.MAGIC, P.VERSION, P.ST_OUT_OF_RANGE, rid, 0, 5000) + bytes(5000))
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((24, 264), np.uint8)
    with pytest.raises((Refused, TransportError)):
        c.lookup_into(bytes(32), np.arange(24, dtype=np.uint64), [out], 1.0)
    assert not out.any() and not c.connected
    fake.close()


def test_bytes_past_a_reply_fail_the_connection(impl):
    """A peer that sends more than the reply it declares (here 50 bytes after each reply, in the
    same send) fails the connection by the next request at the latest; rows written before are
    the declared reply's only."""
    fake = FakeServer(lambda rid, count: ok_reply(rid, count, 0x33) + b"\x99" * 50)
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((4, 264), np.uint8)
    with pytest.raises(TransportError):
        for _ in range(2):
            c.lookup_into(bytes(32), np.arange(4, dtype=np.uint64), [out], 1.0)
            assert (out == 0x33).all()
    assert not c.connected
    fake.close()


def test_server_frames_split_and_coalesced(served):
    """The server's receive buffer: two requests in one send, a request trickled a few bytes at
    a time, and a payload larger than the buffer (10,000 ids = 80 KB) all get exact replies."""
    srv, ep, tables, impl = served
    t = tables[0]
    s = raw_conn(ep)
    r1, r2 = np.array([3, 1, 4], np.uint64), np.array([ROWS - 1], np.uint64)
    s.sendall(
        req(rid=1, ident=t.identity, count=3, payload=r1.tobytes())
        + req(rid=2, ident=t.identity, count=1, payload=r2.tobytes())
    )
    for rid, rows in ((1, r1), (2, r2)):
        status, got_rid, count, data = reply(s)
        assert (status, got_rid, count) == (P.ST_OK, rid, len(rows))
        assert np.array_equal(np.frombuffer(data, np.uint8).reshape(-1, 264), expected(t, rows))
    frame = req(rid=3, ident=t.identity, count=5, payload=np.arange(5, dtype=np.uint64).tobytes())
    for i in range(0, len(frame), 7):
        s.sendall(frame[i : i + 7])
        time.sleep(0.002)
    status, got_rid, count, data = reply(s)
    assert (status, got_rid, count) == (P.ST_OK, 3, 5)
    assert np.array_equal(np.frombuffer(data, np.uint8).reshape(-1, 264), expected(t, range(5)))
    big = np.random.default_rng(3).integers(0, ROWS, 10_000).astype(np.uint64)
    frame = req(rid=4, ident=t.identity, count=len(big), payload=big.tobytes())
    s.sendall(frame[:1000])
    time.sleep(0.01)
    s.sendall(frame[1000:] + req(op=P.OP_PING, rid=5))
    status, got_rid, count, data = reply(s)
    assert (status, got_rid, count) == (P.ST_OK, 4, len(big))
    assert np.array_equal(np.frombuffer(data, np.uint8).reshape(-1, 264), expected(t, big))
    assert reply(s)[:2] == (P.ST_OK, 5)
    s.close()


def test_connect_failures():
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    ls.close()  # nothing listens there now
    with pytest.raises(TransportError, match="cannot connect"):
        TcpClient(parse_url(f"tcp://127.0.0.1:{port}"))
    with pytest.raises(TransportError, match="cannot connect"):
        TcpClient(parse_url(f"tcp://127.0.0.1:{port}@192.0.2.1"))  # local address not on this host


def test_local_bind_address(served):
    srv, ep, tables, impl = served
    c = TcpClient(parse_url(f"tcp://127.0.0.1:{ep.port}@127.0.0.2"), native=impl)
    assert c.sock.getsockname()[0] == "127.0.0.2"
    out = np.empty((1, 264), np.uint8)
    c.lookup_into(tables[0].identity, np.array([9], np.uint64), [out], 1.0)
    np.testing.assert_array_equal(out, expected(tables[0], [9]))
    c.close()


def test_open_client_checks_identities(served):
    srv, ep, tables, impl = served
    c = open_client(str(ep), [t.identity for t in tables])
    c.close()
    with pytest.raises(Refused, match="does not serve"):
        open_client(str(ep), [tables[0].identity, hashlib.sha256(b"nope").digest()])


def test_stop_drains_and_refuses_new(impl):
    t = make_table(3, 1)
    srv = RowServer([t], [parse_url("tcp://127.0.0.1:0")], native=impl)
    ep = srv.start()[0]
    c = TcpClient(ep, native=impl)
    out = np.empty((2, 264), np.uint8)
    c.lookup_into(t.identity, np.array([0, 1], np.uint64), [out], 1.0)
    t0 = time.monotonic()
    srv.stop(2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TransportError):
        c.lookup_into(t.identity, np.array([0, 1], np.uint64), [out], 1.0)
    with pytest.raises(TransportError):
        TcpClient(ep, connect_timeout_s=0.5)


def test_listen_errors():
    t = make_table(3, 1)
    srv = RowServer([t], [parse_url("tcp://127.0.0.1:0")])
    ep = srv.start()[0]
    clash = RowServer([t], [parse_url(f"tcp://127.0.0.1:{ep.port}")])
    with pytest.raises(OSError):
        clash.start()
    srv.stop(1)
    with pytest.raises(ValueError, match="NIXL exporter"):
        RowServer([t], [parse_url("nixl://127.0.0.1:0")]).start()
    with pytest.raises(ValueError, match="share one identity"):
        RowServer([t, t], [])


def test_implementation_switch(monkeypatch):
    monkeypatch.setenv("DSV41_TRANSPORT_PURE", "1")
    assert native.implementation() == "python"
    monkeypatch.delenv("DSV41_TRANSPORT_PURE")
    assert native.implementation() == ("c++" if native._fastrow is not None else "python")


def test_protocol_helpers():
    assert P.identity_bytes("ab" * 32) == b"\xab" * 32
    assert P.identity_bytes(b"\x01" * 32) == b"\x01" * 32
    for bad in ("ab" * 31, "zz" * 32, b"\x00" * 31):
        with pytest.raises(ValueError):
            P.identity_bytes(bad)
    assert P.status_name(P.ST_OUT_OF_RANGE) == "out_of_range" and P.status_name(999) == "status_999"
    assert struct.calcsize("<IHHQ32sII") == 56


def test_lookup_many_pipelined_exact(served):
    srv, ep, tables, impl = served
    c = TcpClient(ep, native=impl)
    rng = np.random.default_rng(8)
    for n, chunk, window in ((1, 16, 4), (100, 7, 3), (50000, 4096, 4), (50000, 50000, 1), (0, 16, 4)):
        rows = rng.integers(0, ROWS, n).astype(np.uint64)
        out = np.zeros((n, 264), np.uint8)
        c.lookup_many(tables[0].identity, rows, out, 5.0, chunk_rows=chunk, window=window)
        np.testing.assert_array_equal(out, expected(tables[0], rows))
    # the connection stays usable after pipelined lookups (generations stay in step)
    out = np.zeros((3, 264), np.uint8)
    c.lookup_into(tables[1].identity, np.array([1, 2, 3], np.uint64), [out], 1.0)
    np.testing.assert_array_equal(out, expected(tables[1], [1, 2, 3]))
    rows = np.arange(1000, dtype=np.uint64)
    rows[700] = ROWS  # a refused piece in the middle
    out = np.zeros((1000, 264), np.uint8)
    with pytest.raises(Refused) as ei:
        c.lookup_many(tables[0].identity, rows, out, 5.0, chunk_rows=100, window=4)
    assert ei.value.reason == "out_of_range" and not c.connected
    with pytest.raises(ValueError):
        TcpClient(ep, native=impl).lookup_many(tables[0].identity, rows, np.zeros((5, 264), np.uint8), 1.0)
    c.close()


def test_lookup_many_timeout(impl):
    fake = FakeServer(lambda rid, count: ok_reply(rid, count, 0x77), delay_s=0.3)
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((40, 264), np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        c.lookup_many(bytes(32), np.arange(40, dtype=np.uint64), out, 0.05, chunk_rows=10)
    assert time.monotonic() - t0 < 0.25 and not c.connected
    fake.close()


def test_lookup_many_whole_call_deadline(impl):
    # each reply 0.2 s late, inside the 1 s per-reply timeout: the 4 requests would take 0.8 s;
    # `end` (the caller's whole-call deadline) ends the call at 0.3 s and closes the connection
    fake = FakeServer(lambda rid, count: ok_reply(rid, count, 0x77), delay_s=0.2)
    c = TcpClient(fake.ep, native=impl)
    out = np.zeros((40, 264), np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        c.lookup_many(bytes(32), np.arange(40, dtype=np.uint64), out, 1.0, chunk_rows=10, end=t0 + 0.3)
    assert 0.28 <= time.monotonic() - t0 < 0.7 and not c.connected
    fake.close()
