"""RemoteRowSource: exact remote rows, exact local fallback on transport error / timeout /
refusal, background reconnect, required mode, counters, argument checks."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from serverutil import SilentServer, SlowServer, settled_snapshot

from dsv41.engram.client import RemoteRowSource, RemoteUnavailable, read_rows_remote
from dsv41.engram.manifest import load_manifest
from dsv41.engram.rowsource import COUNTER_KEYS, LocalRowSource
from dsv41.engram.server import load_tables
from dsv41.engram.reader import LocalRowReader
from dsv41.engram.shards import RowRangeError
from dsv41.engram.synthetic import write_synthetic_tables
from dsv41.errors import Dsv41Error
from dsv41.transport import parse_url
from dsv41.transport import protocol as P
from dsv41.transport.server import RowServer, RowTable


@pytest.fixture(scope="module")
def tabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("t")
    cfg = json.load(open("python/dsv41/data/lab_model.json"))
    cfg["engram_vocab_size"] = 300
    write_synthetic_tables(cfg, d, seed=9)
    m = load_manifest(d / "manifest.json")
    tables, _ = load_tables(m, d)
    return d, m, tables


def serve(tables, port=0):
    srv = RowServer(tables, [parse_url(f"tcp://127.0.0.1:{port}")])
    return srv, srv.start()[0]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def local(d, m):
    return LocalRowReader(m, d, threads=2)


def rand_rows(m, layer, n, seed=0):
    return np.random.default_rng(seed).integers(0, m.table(layer).rows, n)


def test_remote_rows_exact_and_counters(tabs):
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    src = RemoteRowSource([str(ep), "tcp://127.0.0.1:1"], m, 0, 2, timeout_ms=1000, local=local(d, m))
    for L in (1, 2):
        for n in (12, 96, 40000):  # 40000 rows: several CHUNK_ROWS requests
            rows = rand_rows(m, L, n, n)
            np.testing.assert_array_equal(src.lookup(L, rows), ref.read(L, rows))
    assert src.lookup(1, np.zeros(0, np.int64)).shape == (0, 264)
    buf = np.zeros((30, 264), np.uint8)
    rows = rand_rows(m, 2, 30, 1)
    assert src.lookup(2, rows, out=buf) is buf
    np.testing.assert_array_equal(buf, ref.read(2, rows))
    with pytest.raises(Dsv41Error, match="out must be"):
        src.lookup(2, rows, out=np.zeros((29, 264), np.uint8))
    c = src.counters()
    assert set(COUNTER_KEYS) <= set(c)
    assert c["lookups"] == 8 and c["fallbacks"] == 0 and c["remote_rows"] == 2 * (12 + 96 + 40000) + 30
    assert c["latency_count"] == 8 and c["latency_sum_s"] > 0 and c["source"] == "tcp"
    src.close()
    ref.close()
    srv.stop(1)


def test_fallback_then_reconnect_after_restart(tabs):
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 1, 2, timeout_ms=200, local=LocalRowSource(local(d, m)))
    rows = rand_rows(m, 2, 50)
    np.testing.assert_array_equal(src.lookup(2, rows), ref.read(2, rows))
    srv.stop(1)  # server gone
    for i in range(2):
        np.testing.assert_array_equal(src.lookup(2, rows), ref.read(2, rows))
    buf = np.zeros((50, 264), np.uint8)
    assert src.lookup(2, rows, out=buf) is buf  # fallback through a LocalRowSource into out
    np.testing.assert_array_equal(buf, ref.read(2, rows))
    c = src.counters()
    assert c["fallbacks"] == 3 and c["transport_errors"] == 1 and not c["connected"]
    srv2, _ = serve(tables, ep.port)  # restart on the same port
    assert src.wait_connected(10)
    np.testing.assert_array_equal(src.lookup(2, rows), ref.read(2, rows))
    c = src.counters()
    assert c["reconnects"] == 1 and c["fallbacks"] == 3 and c["remote_rows"] == 100
    src.close()
    srv2.stop(1)
    ref.close()


def test_server_absent_from_start_then_appears(tabs):
    d, m, tables = tabs
    port = free_port()
    ref = local(d, m)
    src = RemoteRowSource(f"tcp://127.0.0.1:{port}", m, 0, 1, timeout_ms=100, local=local(d, m))
    rows = rand_rows(m, 1, 24)
    t0 = time.monotonic()
    buf = np.zeros((24, 264), np.uint8)
    assert src.lookup(1, rows, out=buf) is buf  # fallback through a LocalRowReader into out
    np.testing.assert_array_equal(buf, ref.read(1, rows))
    assert time.monotonic() - t0 < 0.5  # no connect wait on the lookup path
    srv, _ = serve(tables, port)
    assert src.wait_connected(10)
    np.testing.assert_array_equal(src.lookup(1, rows), ref.read(1, rows))
    c = src.counters()
    assert c["fallbacks"] == 1 and c["connect_failures"] >= 1 and c["remote_rows"] == 24
    src.close()
    srv.stop(1)
    ref.close()


def test_required_mode_raises(tabs):
    d, m, tables = tabs
    with pytest.raises(RemoteUnavailable, match="required"):
        RemoteRowSource(f"tcp://127.0.0.1:{free_port()}", m, 0, 1, required=True, local=local(d, m))
    srv, ep = serve(tables)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=200, required=True, local=local(d, m))
    src.lookup(1, rand_rows(m, 1, 5))
    srv.stop(1)
    with pytest.raises(RemoteUnavailable, match="required"):
        src.lookup(1, rand_rows(m, 1, 5))
    src.close()


def test_no_local_reader_raises(tabs):
    d, m, tables = tabs
    src = RemoteRowSource(f"tcp://127.0.0.1:{free_port()}", m, 0, 1, local=None)
    with pytest.raises(RemoteUnavailable, match="no local reader"):
        src.lookup(1, [1, 2])
    src.close()


def test_refusal_falls_back_exactly(tabs):
    d, m, tables = tabs
    # same identity, but the server holds only half of layer 1's rows: a lookup past them is refused
    t = tables[0]
    half = RowTable(t.identity, t.layer_id, t.weight[: t.rows // 2], t.scale[: t.rows // 2])
    srv, ep = serve([half, tables[1]])
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=500, local=local(d, m))
    rows = np.array([0, t.rows - 1, 5])
    np.testing.assert_array_equal(src.lookup(1, rows), ref.read(1, rows))
    c = src.counters()
    assert c["refusals"] == 1 and c["fallbacks"] == 1
    src.close()
    srv.stop(1)
    ref.close()


def test_wrong_identity_server_never_used(tabs):
    d, m, tables = tabs
    other = [RowTable(bytes(32), 1, tables[0].weight, tables[0].scale)]
    srv, ep = serve(other)
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=200, local=local(d, m))
    rows = rand_rows(m, 1, 10)
    np.testing.assert_array_equal(src.lookup(1, rows), ref.read(1, rows))
    c = src.counters()
    assert not c["connected"] and c["fallbacks"] == 1 and c["remote_rows"] == 0
    assert "does not serve" in src.last_error
    src.close()
    srv.stop(1)
    with pytest.raises(RemoteUnavailable):
        read_rows_remote(str(ep), m, 1, [1])
    ref.close()


def test_timeout_fallback_latency_bounded(tabs):
    d, m, tables = tabs
    hung = SilentServer(tables)
    ref = local(d, m)
    src = RemoteRowSource(f"tcp://127.0.0.1:{hung.port}", m, 0, 1, timeout_ms=50, local=local(d, m))
    assert src.connected
    rows = rand_rows(m, 2, 24)
    t0 = time.monotonic()
    np.testing.assert_array_equal(src.lookup(2, rows), ref.read(2, rows))
    assert time.monotonic() - t0 < 0.05 + 0.5  # timeout + local read, with slack for a loaded host
    c = src.counters()
    assert c["transport_errors"] == 1 and c["fallbacks"] == 1
    src.close()
    hung.close()
    ref.close()


def test_argument_checks(tabs):
    d, m, tables = tabs
    with pytest.raises(Dsv41Error, match="one per rank"):
        RemoteRowSource(["tcp://127.0.0.1:1"] * 3, m, 0, 2)
    with pytest.raises(Dsv41Error, match="rank"):
        RemoteRowSource("tcp://127.0.0.1:1", m, 2, 2)
    with pytest.raises(Dsv41Error, match="at least one URL"):
        RemoteRowSource("", m, 0, 1)
    with pytest.raises(Dsv41Error, match="timeout_ms"):
        RemoteRowSource("tcp://127.0.0.1:1", m, 0, 1, timeout_ms=0)
    with pytest.raises(Dsv41Error, match="scheme"):
        RemoteRowSource("http://127.0.0.1:1", m, 0, 1)
    src = RemoteRowSource(f"tcp://127.0.0.1:{free_port()}", m, 0, 1, local=local(d, m))
    with pytest.raises(RowRangeError):
        src.lookup(1, [m.table(1).rows])
    with pytest.raises(RowRangeError):
        src.lookup(1, [-1])
    with pytest.raises(RowRangeError):
        src.lookup(7, [0])
    with pytest.raises(Dsv41Error, match="1-D integer"):
        src.lookup(1, [0.5])
    src.close()
    with pytest.raises(RowRangeError):
        read_rows_remote("tcp://127.0.0.1:1", m, 1, [m.table(1).rows])


def test_read_rows_remote_exact(tabs):
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    rows = rand_rows(m, 2, 100)
    np.testing.assert_array_equal(read_rows_remote(str(ep), m.path, 2, rows), ref.read(2, rows))
    srv.stop(1)
    ref.close()


def test_concurrent_lookups_during_outage_are_exact(tabs):
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=200, local=local(d, m))
    errors = []

    def worker(k):
        rng = np.random.default_rng(k)
        for _ in range(40):
            rows = rng.integers(0, m.table(1).rows, 24)
            if not np.array_equal(src.lookup(1, rows), ref.read(1, rows)):
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    srv.stop(1)  # the server goes away while four threads look rows up
    for t in threads:
        t.join(60)
    assert not errors
    alive = [t for t in threading.enumerate() if t.name.startswith("engram-reconnect")]
    assert len(alive) <= 1
    c = src.counters()
    assert c["lookups"] == 160
    src.close()
    ref.close()


def test_hot_path_checks_match_general_path(tabs):
    """ndarray ids go through lookup_segs (checks in C++); every bad input still gets the same
    error as before and sends nothing; odd dtypes and lists take the general path exactly."""
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=1000, local=local(d, m))
    n1 = m.table(1).rows
    for rows in (np.array([0, n1 - 1, 5], np.int64), np.array([3, 4], np.uint64), np.array([7, 8], np.int32),
                 [1, 2, 3], np.arange(10, dtype=np.int64)[::3]):
        buf = np.zeros((len(rows), 264), np.uint8)
        assert src.lookup(1, rows, out=buf) is buf
        np.testing.assert_array_equal(buf, ref.read(1, np.asarray(rows, np.int64)))
    before = settled_snapshot(srv)["requests"]
    buf = np.zeros((2, 264), np.uint8)
    with pytest.raises(RowRangeError, match=f"row {n1} is outside"):
        src.lookup(1, np.array([1, n1], np.int64), out=buf)
    with pytest.raises(RowRangeError, match="row -3 is outside"):
        src.lookup(1, np.array([-3, 1], np.int64), out=buf)
    with pytest.raises(RowRangeError, match="1-D"):
        src.lookup(1, np.zeros((2, 1), np.int64), out=buf)
    for odd in (np.int64(3), np.zeros((2, 1), np.int64)):
        with pytest.raises(RowRangeError, match="1-D"):
            src.lookup(1, odd)
    ro = np.zeros((2, 264), np.uint8)
    ro.flags.writeable = False
    for bad in (ro, np.zeros((3, 264), np.uint8), np.zeros((2, 264), np.int8)):
        with pytest.raises(Dsv41Error, match="out must be"):
            src.lookup(1, np.array([1, 2], np.int64), out=bad)
    assert settled_snapshot(srv)["requests"] == before
    assert src.counters()["fallbacks"] == 0
    src.close()
    ref.close()
    srv.stop(1)


def test_lookup_layers_one_request_exact(tabs):
    d, m, tables = tabs
    srv, ep = serve(tables)
    ref = local(d, m)
    src = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=1000, local=local(d, m))
    assert src._client.multi_table
    for n in (24, 96, 20000):  # 2 x 20000 rows: more than one request's worth, per layer
        rows = [rand_rows(m, 1, n, n), rand_rows(m, 2, n, n + 1)]
        outs = [np.zeros((n, 264), np.uint8), np.zeros((n, 264), np.uint8)]
        before = settled_snapshot(srv)["requests"]
        got = src.lookup_layers((1, 2), rows, outs)
        assert got[0] is outs[0] and got[1] is outs[1]
        if n <= 96:
            assert settled_snapshot(srv)["requests"] == before + 1  # both layers, one request
        for L in (1, 2):
            np.testing.assert_array_equal(got[L - 1], ref.read(L, rows[L - 1]))
        got = src.lookup_layers([2, 1], [rows[1], rows[0]])  # no buffers, either order
        np.testing.assert_array_equal(got[0], ref.read(2, rows[1]))
        np.testing.assert_array_equal(got[1], ref.read(1, rows[0]))
    c = src.counters()
    assert c["lookups"] == 12 and c["fallbacks"] == 0 and c["remote_rows"] == c["rows"] == 4 * (24 + 96 + 20000)
    with pytest.raises(RowRangeError):
        src.lookup_layers((1, 2), [[0], [m.table(2).rows]], None)
    with pytest.raises(RowRangeError):
        src.lookup_layers((1, 7), [[0], [0]])
    with pytest.raises(Dsv41Error, match="one row array"):
        src.lookup_layers((1, 2), [[0]])
    with pytest.raises(Dsv41Error, match="out must be"):
        src.lookup_layers((1, 2), [[0], [1]], [np.zeros((1, 264), np.uint8), np.zeros((2, 264), np.uint8)])
    # the server goes away: both layers fall back, exactly, and count one fallback
    srv.stop(1)
    rows = [rand_rows(m, 1, 24, 5), rand_rows(m, 2, 24, 6)]
    outs = [np.zeros((24, 264), np.uint8), np.zeros((24, 264), np.uint8)]
    got = src.lookup_layers((1, 2), rows, outs)
    for L in (1, 2):
        np.testing.assert_array_equal(got[L - 1], ref.read(L, rows[L - 1]))
    c = src.counters()
    assert c["fallbacks"] == 1 and c["transport_errors"] == 1
    src.close()
    ref.close()


def test_lookup_layers_against_version1_server(tabs):
    """A version-1 server (before OP_LOOKUP_MULTI): one request per layer, exact rows."""
    from serverutil import V1Server

    d, m, tables = tabs
    old = V1Server(tables)
    ref = local(d, m)
    src = RemoteRowSource(f"tcp://127.0.0.1:{old.ep.port}", m, 0, 1, timeout_ms=1000, local=local(d, m))
    assert src.connected and not src._client.multi_table
    rows = [rand_rows(m, 1, 24, 1), rand_rows(m, 2, 24, 2)]
    outs = [np.zeros((24, 264), np.uint8), np.zeros((24, 264), np.uint8)]
    got = src.lookup_layers((1, 2), rows, outs)
    for L in (1, 2):
        np.testing.assert_array_equal(got[L - 1], ref.read(L, rows[L - 1]))
    assert src.counters()["fallbacks"] == 0 and src.counters()["remote_rows"] == 48
    src.close()
    ref.close()
    old.close()


def test_local_rowsource_lookup_layers(tabs):
    d, m, tables = tabs
    src = LocalRowSource(local(d, m))
    ref = local(d, m)
    rows = [rand_rows(m, 1, 10, 3), rand_rows(m, 2, 7, 4)]
    outs = [np.zeros((10, 264), np.uint8), np.zeros((7, 264), np.uint8)]
    got = src.lookup_layers((1, 2), rows, outs)
    assert got[0] is outs[0]
    for L in (1, 2):
        np.testing.assert_array_equal(got[L - 1], ref.read(L, rows[L - 1]))
    assert src.counters()["lookups"] == 2
    src.close()
    ref.close()


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
    src = RemoteRowSource(f"tcp://127.0.0.1:{hung.port}", m, 0, 1, timeout_ms=5000, local=local(d, m),
                          deadline_ms=80)
    assert src.connected and src.deadline_s == 0.08
    ids = [rand_rows(m, 1, 24, 1), rand_rows(m, 2, 24, 2)]
    outs = [np.zeros((24, 264), np.uint8) for _ in range(2)]
    calls = [
        lambda: [src.lookup(2, ids[1], out=outs[1])],                       # hot path
        lambda: src.lookup_layers([1, 2], ids, outs),                        # hot path, one request
        lambda: src.lookup_layers([1, 2], [list(ids[0]), list(ids[1])]),     # general path
        lambda: [src.lookup(1, rand_rows(m, 1, 40000, 3))],                  # pipelined, 3 requests
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
    src = RemoteRowSource(f"tcp://127.0.0.1:{slow.port}", m, 0, 1, timeout_ms=1000, local=local(d, m),
                          deadline_ms=500)
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
    s = envs.parse({"DSV41_ENGRAM_REMOTE": str(ep), "DSV41_ENGRAM_FAULT_DELAY_MS": "30",
                    "DSV41_ENGRAM_LOOKUP_DEADLINE_MS": "1000", "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "1000"})
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
    late = RemoteRowSource(str(ep), m, 0, 1, timeout_ms=1000, local=local(d, m), deadline_ms=100,
                           fault_delay_ms=400)
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
    for kw, frag in (({"deadline_ms": 0}, "deadline_ms"), ({"deadline_ms": 10 ** 9}, "deadline_ms"),
                     ({"fault_delay_ms": -1}, "fault_delay_ms"), ({"fault_delay_ms": float("nan")}, "fault_delay_ms")):
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
        assert src.lookup(1, ids[0], out=outs[0]) is outs[0]                       # hot path
        np.testing.assert_array_equal(outs[0], ref.read(1, ids[0]))
        src.lookup_layers([1, 2], ids, outs)                                       # one request
        np.testing.assert_array_equal(outs[1], ref.read(2, ids[1]))
        big = rand_rows(m, 2, 40000, 7)                                            # pipelined
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
    src = RemoteRowSource(f"tcp://127.0.0.1:{hung.port}", m, 0, 1, timeout_ms=5000, local=local(d, m),
                          deadline_ms=80, spin_us=5_000_000)
    assert src._client.spin_us == 5_000_000
    ids = [rand_rows(m, 1, 24, 1), rand_rows(m, 2, 24, 2)]
    outs = [np.zeros((24, 264), np.uint8) for _ in range(2)]
    calls = [
        lambda: [src.lookup(2, ids[1], out=outs[1])],                       # hot path
        lambda: src.lookup_layers([1, 2], ids, outs),                        # hot path, one request
        lambda: [src.lookup(1, rand_rows(m, 1, 40000, 3))],                  # pipelined, 3 requests
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
