"""RemoteRowSource: exact remote rows, exact local fallback on transport error / timeout /
refusal, background reconnect, required mode, counters, argument checks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsv41.engram.client import RemoteRowSource, RemoteUnavailable, read_rows_remote
from dsv41.engram.rowsource import COUNTER_KEYS, LocalRowSource
from dsv41.engram.shards import RowRangeError
from dsv41.errors import Dsv41Error
from dsv41.transport.server import RowTable
from remoteutil import free_port, local, rand_rows, serve, tabs  # noqa: F401 - tabs is a fixture
from serverutil import SilentServer, settled_snapshot


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
    for _i in range(2):
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
    for rows in (
        np.array([0, n1 - 1, 5], np.int64),
        np.array([3, 4], np.uint64),
        np.array([7, 8], np.int32),
        [1, 2, 3],
        np.arange(10, dtype=np.int64)[::3],
    ):
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
