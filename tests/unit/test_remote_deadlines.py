"""RemoteRowSource under time limits: the whole-call deadline against frozen and slow servers, the
drills' fault delay inside it, and the spinning (busy-poll) client and server: exact rows, bounded
latency, argument checks."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dsv41.engram.client import RemoteRowSource, RemoteUnavailable
from dsv41.errors import Dsv41Error
from dsv41.transport import parse_url, protocol as P
from dsv41.transport.server import RowServer
from remoteutil import local, rand_rows, serve, tabs  # noqa: F401 - tabs is a fixture
from serverutil import SilentServer, SlowServer


# -- the whole-call deadline (deadline_ms, the engine's DSV41_ENGRAM_LOOKUP_DEADLINE_MS) --------
def _timed(fn, *args, **kw):
    t0 = time.monotonic()
    got = fn(*args, **kw)
    return got, time.monotonic() - t0


def test_deadline_bounds_every_path_against_a_frozen_server(tabs):
    """A server that accepts and never answers: with a request timeout far past the deadline,
    every kind of call (hot path, both layers in one request, general path, a pipelined large
    lookup) returns the exact local rows at the deadline, counted; the reconnect thread brings
    the connection back between calls (no lookup waits for it)."""
    d, m, tables = tabs
    hung = SilentServer(tables)
    ref = local(d, m)
    src = RemoteRowSource(f"tcp://127.0.0.1:{hung.port}", m, 0, 1, timeout_ms=5000, local=local(d, m), deadline_ms=80)
    assert src.connected and src.deadline_s == 0.08
    ids = [rand_rows(m, 1, 24, 1), rand_rows(m, 2, 24, 2)]
    outs = [np.zeros((24, 264), np.uint8) for _ in range(2)]
    calls = [
        lambda: [src.lookup(2, ids[1], out=outs[1])],  # hot path
        lambda: src.lookup_layers([1, 2], ids, outs),  # hot path, one request
        lambda: src.lookup_layers([1, 2], [list(ids[0]), list(ids[1])]),  # general path
        lambda: [src.lookup(1, rand_rows(m, 1, 40000, 3))],  # pipelined, 3 requests
    ]
    for k, call in enumerate(calls, 1):
        assert src.wait_connected(10)
        got, dt = _timed(call)
        assert dt < 0.08 + 1.0, f"call {k} took {dt:.3f} s"  # deadline + local read, loaded host
        assert dt >= 0.07
        c = src.counters()
        assert c["deadline_exceeded"] == k and c["fallbacks"] == k and c["transport_errors"] == k
    np.testing.assert_array_equal(outs[1], ref.read(2, ids[1]))
    np.testing.assert_array_equal(outs[0], ref.read(1, ids[0]))
    np.testing.assert_array_equal(got[0], ref.read(1, rand_rows(m, 1, 40000, 3)))
    src.close()
    hung.close()
    ref.close()


def test_deadline_covers_the_connection_lock(tabs):
    """A call that finds the connection held (another thread's request wedged) waits for the
    lock only until the deadline, answers from the local reader, keeps the healthy connection
    and never waits for the lock to count; required mode raises instead."""
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=2000, local=local(d, m), deadline_ms=60)
    req = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=2000, required=True, deadline_ms=60)
    rows = rand_rows(m, 1, 24, 4)
    buf = np.zeros((24, 264), np.uint8)
    src._lock.acquire()
    req._lock.acquire()
    try:
        got, dt = _timed(src.lookup, 1, rows, out=buf)
        assert got is buf and dt < 0.06 + 1.0
        np.testing.assert_array_equal(buf, ref.read(1, rows))
        rows2 = rand_rows(m, 2, 24, 8)
        outs = src.lookup_layers([1, 2], [rows, rows2], [np.zeros((24, 264), np.uint8) for _ in range(2)])
        np.testing.assert_array_equal(outs[1], ref.read(2, rows2))
        c = src.counters()  # read while the lock is held: never waits
        assert c["deadline_exceeded"] == 2 and c["fallbacks"] == 2 and c["lookups"] == 3
        assert c["transport_errors"] == 0 and c["connected"]
        with pytest.raises(RemoteUnavailable, match="deadline"):
            req.lookup(1, rows)
    finally:
        src._lock.release()
        req._lock.release()
    np.testing.assert_array_equal(src.lookup(1, rows), ref.read(1, rows))  # the same connection again
    c = src.counters()
    assert c["fallbacks"] == 2 and c["remote_rows"] == 24 and c["reconnects"] == 0
    src.close()
    req.close()
    srv.stop(1)
    ref.close()


def test_deadline_cuts_a_slow_pipelined_lookup_short(tabs):
    """A slow server (each 16,384-row reply 0.4 s late, inside the 1 s request timeout): the
    whole 3-request lookup would take 1.2 s; the 0.5 s deadline ends it and the local reader
    answers. Without a deadline the same lookup completes remotely."""
    d, m, tables = tabs
    ref = local(d, m)
    slow = SlowServer(tables, ref, 0.4)
    rows = rand_rows(m, 1, 40000, 5)
    want = ref.read(1, rows)
    src = RemoteRowSource(f"tcp://127.0.0.1:{slow.port}", m, 0, 1, timeout_ms=1000, local=local(d, m), deadline_ms=500)
    got, dt = _timed(src.lookup, 1, rows)
    np.testing.assert_array_equal(got, want)
    assert 0.45 <= dt < 1.15, dt
    c = src.counters()
    assert c["deadline_exceeded"] == 1 and c["fallbacks"] == 1 and c["transport_errors"] == 1
    src.close()
    free = RemoteRowSource(f"tcp://127.0.0.1:{slow.port}", m, 0, 1, timeout_ms=1000, local=local(d, m))
    got, dt = _timed(free.lookup, 1, rows)
    np.testing.assert_array_equal(got, want)
    assert dt >= 1.15 and free.counters()["fallbacks"] == 0 and free.counters()["deadline_exceeded"] == 0
    free.close()
    slow.close()
    ref.close()


def test_fault_delay_is_a_slow_server_inside_the_deadline(tabs):
    """DSV41_ENGRAM_FAULT_DELAY_MS on a remote source: every layer's rows arrive that much later
    (rows exact, counted as remote); a delay past the deadline is a deadline miss answered by
    the local reader. sources.from_env wires both variables into RemoteRowSource (no wrapper)."""
    from dsv41 import envs
    from dsv41.engram import sources

    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    rows = rand_rows(m, 2, 24, 6)
    s = envs.parse(
        {
            "DSV41_ENGRAM_REMOTE": str(ep),
            "DSV41_ENGRAM_FAULT_DELAY_MS": "30",
            "DSV41_ENGRAM_LOOKUP_DEADLINE_MS": "1000",
            "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "1000",
        }
    )
    src = sources.from_env(m, d, 0, 1, settings=s)
    assert isinstance(src, RemoteRowSource)  # the delay lives inside the remote source
    assert src.deadline_s == 1.0 and src.fault_delay_s == 0.03
    got, dt = _timed(src.lookup, 2, rows, out=np.zeros((24, 264), np.uint8))
    np.testing.assert_array_equal(got, ref.read(2, rows))
    assert dt >= 0.03
    outs = [np.zeros((24, 264), np.uint8) for _ in range(2)]
    rows1 = rand_rows(m, 1, 24, 7)
    got, dt = _timed(src.lookup_layers, [1, 2], [rows1, rows], outs)
    assert dt >= 0.06  # two layers: two delays, as the docs say (2 x delay per step)
    np.testing.assert_array_equal(outs[0], ref.read(1, rows1))
    np.testing.assert_array_equal(outs[1], ref.read(2, rows))
    c = src.counters()
    assert c["fallbacks"] == 0 and c["remote_rows"] == 72 and c["fault_delay_ms"] == 30.0
    src.close()
    late = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=1000, local=local(d, m), deadline_ms=100, fault_delay_ms=400)
    got, dt = _timed(late.lookup, 2, rows)
    np.testing.assert_array_equal(got, ref.read(2, rows))
    assert 0.09 <= dt < 0.1 + 1.0, dt
    c = late.counters()
    assert c["deadline_exceeded"] == 1 and c["fallbacks"] == 1
    late.close()
    srv.stop(1)
    ref.close()


def test_deadline_and_fault_arguments_checked(tabs):
    d, m, tables = tabs
    for kw, frag in (
        ({"deadline_ms": 0}, "deadline_ms"),
        ({"deadline_ms": 10**9}, "deadline_ms"),
        ({"fault_delay_ms": -1}, "fault_delay_ms"),
        ({"fault_delay_ms": float("nan")}, "fault_delay_ms"),
    ):
        with pytest.raises(Dsv41Error, match=frag):
            RemoteRowSource("tcp://127.0.0.1:1", m, 0, 1, **kw)


# -- busy-poll (spin_us, DSV41_TRANSPORT_CLIENT_SPIN_US / DSV41_TRANSPORT_SERVER_SPIN_US) -------
@pytest.mark.parametrize("server_spin", [0, 200])
@pytest.mark.parametrize("client_spin", [0, 200])
def test_spin_on_and_off_give_exact_rows(tabs, server_spin: int, client_spin: int):
    """Every lookup path gives the local reader's bytes with busy-polling off (0) and on, at
    either end; the C++ server loop keeps serving a connection across spins and blocks."""
    d, m, tables = tabs
    srv = RowServer(tables, [parse_url("tcp://127.0.0.1:0")], spin_us=server_spin)
    ep = srv.start()[0]
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=2000, local=local(d, m), spin_us=client_spin)
    assert src._client.spin_us == client_spin and srv.spin_us == server_spin
    ids = [rand_rows(m, 1, 24, 5), rand_rows(m, 2, 96, 6)]
    outs = [np.zeros((24, 264), np.uint8), np.zeros((96, 264), np.uint8)]
    for _ in range(3):  # back to back (inside the server's spin) and after a pause (past it)
        assert src.lookup(1, ids[0], out=outs[0]) is outs[0]  # hot path
        np.testing.assert_array_equal(outs[0], ref.read(1, ids[0]))
        src.lookup_layers([1, 2], ids, outs)  # one request
        np.testing.assert_array_equal(outs[1], ref.read(2, ids[1]))
        big = rand_rows(m, 2, 40000, 7)  # pipelined
        np.testing.assert_array_equal(src.lookup(2, big), ref.read(2, big))
        time.sleep(0.002)
    c = src.counters()
    assert c["fallbacks"] == 0 and c["remote_rows"] == c["rows"]
    src.close()
    srv.stop(5)
    ref.close()


def test_deadline_honoured_while_spinning(tabs):
    """A spin budget far past the deadline (5 s) against a hung server: every call path still
    returns the exact local rows at the 80 ms deadline, counted, never at the end of the spin."""
    d, m, tables = tabs
    hung = SilentServer(tables)
    ref = local(d, m)
    src = RemoteRowSource(
        f"tcp://127.0.0.1:{hung.port}", m, 0, 1, timeout_ms=5000, local=local(d, m), deadline_ms=80, spin_us=5_000_000
    )
    assert src._client.spin_us == 5_000_000
    ids = [rand_rows(m, 1, 24, 1), rand_rows(m, 2, 24, 2)]
    outs = [np.zeros((24, 264), np.uint8) for _ in range(2)]
    calls = [
        lambda: [src.lookup(2, ids[1], out=outs[1])],  # hot path
        lambda: src.lookup_layers([1, 2], ids, outs),  # hot path, one request
        lambda: [src.lookup(1, rand_rows(m, 1, 40000, 3))],  # pipelined, 3 requests
    ]
    for k, call in enumerate(calls, 1):
        assert src.wait_connected(10)
        got, dt = _timed(call)
        assert dt < 0.08 + 1.0, f"call {k} took {dt:.3f} s"  # deadline + local read, loaded host; spin is 5 s
        c = src.counters()
        assert c["deadline_exceeded"] == k and c["fallbacks"] == k and c["transport_errors"] == k
    np.testing.assert_array_equal(outs[0], ref.read(1, ids[0]))
    np.testing.assert_array_equal(outs[1], ref.read(2, ids[1]))
    np.testing.assert_array_equal(got[0], ref.read(1, rand_rows(m, 1, 40000, 3)))
    src.close()
    hung.close()
    ref.close()


@pytest.mark.parametrize("impl", [True, False], ids=["c++", "python"])
def test_client_spin_stops_at_the_request_timeout(tabs, impl: bool):
    """TcpClient with a 5 s spin budget and a 50 ms timeout against a hung server: the timeout
    ends the spin (TransportTimeout, connection closed), on both implementations."""
    from dsv41.transport import TransportTimeout
    from dsv41.transport.tcp import TcpClient

    d, m, tables = tabs
    hung = SilentServer(tables)
    c = TcpClient(parse_url(f"tcp://127.0.0.1:{hung.port}"), spin_us=5_000_000, native=impl)
    ident = P.identity_bytes(m.table(1).identity)
    out = np.zeros((24, 264), np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        c.lookup_into(ident, rand_rows(m, 1, 24).astype(np.uint64), [out], 0.05)
    assert time.monotonic() - t0 < 1.0  # the 50 ms timeout, loaded host; the spin budget is 5 s
    assert not c.connected
    hung.close()


def test_spinning_server_thread_ends_on_stop_and_on_client_close(tabs):
    """A C++ server thread busy-polling for the next request (5 s budget) ends as soon as its
    client closes, and RowServer.stop drains a spinning connection without waiting out the spin."""
    from dsv41.transport import native

    if not native.use_native():
        pytest.skip("the server spin is in the C++ request loop")
    d, m, tables = tabs
    srv = RowServer(tables, [parse_url("tcp://127.0.0.1:0")], spin_us=5_000_000)
    ep = srv.start()[0]
    ref = local(d, m)
    rows = rand_rows(m, 1, 24, 4)
    a = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=2000)
    np.testing.assert_array_equal(a.lookup(1, rows), ref.read(1, rows))  # its server thread now spins
    a.close()
    end = time.monotonic() + 4.0  # well inside the 5 s spin
    while srv.snapshot()["connections"] and time.monotonic() < end:
        time.sleep(0.01)
    assert srv.snapshot()["connections"] == 0, "a closed client's thread kept spinning"
    b = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=2000)
    np.testing.assert_array_equal(b.lookup(1, rows), ref.read(1, rows))
    t0 = time.monotonic()
    srv.stop(10)
    assert time.monotonic() - t0 < 4.0  # the drain did not wait out the spin
    assert srv.snapshot()["connections"] == 0
    b.close()
    ref.close()


def test_spin_arguments_checked(tabs):
    from dsv41.transport.tcp import TcpClient

    d, m, tables = tabs
    for bad in (-1, float("nan")):
        with pytest.raises(Dsv41Error, match="spin_us"):
            RemoteRowSource("tcp://127.0.0.1:1", m, 0, 1, spin_us=bad)
        with pytest.raises(ValueError, match="spin_us"):
            TcpClient(parse_url("tcp://127.0.0.1:1"), spin_us=bad)
        with pytest.raises(ValueError, match="spin_us"):
            RowServer(tables, [parse_url("tcp://127.0.0.1:0")], spin_us=bad)
