"""The circuit breaker of remote Engram rows (issue 47), on the CPU against a real table server on
loopback: once a rank knows its table server is unreachable (a refused connect, a timed-out
request, a lent connection's failed request) every later lookup is served from the exact local
rows with no request, connect or timeout on the calling thread; the background probe closes the
breaker as soon as the server answers again. Both row paths: ``RemoteRowSource`` (the stand-in
engine's and the overlay's Python path) and the overlay worker's C++ core (local fill in C++,
the lease probe on its own thread)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dsv41.engram import breaker, reader
from dsv41.engram.client import RemoteRowSource
from dsv41.overlay import core as overlay_core, engram as E
from dsv41.transport import TransportError, TransportTimeout, native
from overlayutil import exact_rows, free_port, lookup_ids, poisoned, remote_rows, serve_tables, tabs  # noqa: F401

PROBE_BOUND_S = 3.0  # the probe's backoff is at most 0.75 s; slack for a loaded CI machine


def _source(tabs_, port: int, timeout_ms: int = 500) -> RemoteRowSource:
    manifest, d, _ = tabs_
    return RemoteRowSource(
        f"tcp://127.0.0.1:{port}", manifest, 0, 1, timeout_ms=timeout_ms, local=reader.LocalRowReader(manifest, d)
    )


def _ids(tabs_, layer: int, n: int, seed: int) -> np.ndarray:
    manifest = tabs_[0]
    from dsv41.engram.manifest import load_manifest

    m = load_manifest(manifest) if not hasattr(manifest, "table") else manifest
    return np.random.default_rng(seed).integers(0, m.table(layer).rows, n).astype(np.int64)


def _ref(tabs_, layer: int, ids: np.ndarray) -> np.ndarray:
    manifest, d, _ = tabs_
    with reader.LocalRowReader(manifest, d) as r:
        return r.read(layer, ids)


class _CallerWatch:
    """Records the threads that connect (``RemoteRowSource._connect``) or send a request on the
    source's own client, so a test can assert the calling thread never does while the breaker is open."""

    def __init__(self, src: RemoteRowSource, monkeypatch) -> None:
        self.connects: list[str] = []
        real = src._connect

        def connect():
            self.connects.append(threading.current_thread().name)
            return real()

        monkeypatch.setattr(src, "_connect", connect)

    def on(self, name: str) -> int:
        return sum(1 for t in self.connects if t == name)


def _lookups_exact(tabs_, src, seed: int) -> bool:
    ok = True
    for k in range(3):
        ids = _ids(tabs_, 1, 200, seed + k)
        ok &= np.array_equal(src.lookup(1, ids), _ref(tabs_, 1, ids))
        a, b = _ids(tabs_, 1, 50, seed + 10 + k), _ids(tabs_, 14, 70, seed + 20 + k)
        outs = [np.empty((50, 264), np.uint8), np.empty((70, 264), np.uint8)]
        got = src.lookup_layers([1, 14], [a, b], outs)
        ok &= np.array_equal(got[0], _ref(tabs_, 1, a)) and np.array_equal(got[1], _ref(tabs_, 14, b))
    return bool(ok)


def test_a_refused_connect_opens_the_breaker_and_lookups_go_local_on_the_calling_thread_only(tabs, monkeypatch) -> None:
    port = free_port()  # nothing listens: every connect is refused
    src = _source(tabs, port)
    try:
        assert not src.connected and src.counters()["connect_failures"] >= 1
        watch = _CallerWatch(src, monkeypatch)
        me = threading.current_thread().name
        t0 = time.monotonic()
        assert _lookups_exact(tabs, src, 1)
        assert time.monotonic() - t0 < 5
        assert watch.on(me) == 0  # no connect in a lookup: the probe (reconnect thread) does them
        c = src.counters()
        assert c["fallbacks"] == 6 and c["remote_rows"] == 0 and c["transport_errors"] == 0
    finally:
        src.close()


def test_a_timed_out_request_opens_the_breaker_and_later_lookups_do_not_wait(tabs, monkeypatch) -> None:
    """A hung server: the first request pays its timeout once; the next lookups pay none."""
    port = free_port()
    srv = serve_tables(tabs, port)
    src = _source(tabs, port, timeout_ms=300)
    try:
        assert src.connected
        client = src._client

        def hung(*_a, **_k):
            time.sleep(0.3)
            raise TransportTimeout("the server did not answer within 300 ms")

        monkeypatch.setattr(client, "lookup_segs", hung)
        monkeypatch.setattr(client, "lookup_many", hung)
        monkeypatch.setattr(src, "_connect", lambda: (_ for _ in ()).throw(TransportTimeout("HELLO timed out")))
        ids = _ids(tabs, 1, 100, 5)
        t0 = time.monotonic()
        assert np.array_equal(src.lookup(1, ids), _ref(tabs, 1, ids))
        first = time.monotonic() - t0
        assert first >= 0.25 and not src.connected and src.counters()["breaker_opens"] == 1
        times = []
        for k in range(5):
            ids = _ids(tabs, 14, 100, 6 + k)
            t0 = time.monotonic()
            assert np.array_equal(src.lookup(14, ids), _ref(tabs, 14, ids))
            times.append(time.monotonic() - t0)
        assert max(times) < 0.2, times  # no timeout: the request is never sent
        assert src.counters()["transport_errors"] == 1 and src.counters()["fallbacks"] == 6
    finally:
        src.close()
        srv.stop()


def test_a_lost_lease_opens_the_sources_own_breaker(tabs) -> None:
    port = free_port()
    srv = serve_tables(tabs, port)
    src = _source(tabs, port)
    try:
        lease = src.native_lease()
        assert lease is not None and src.connected
        srv.stop()
        ids = _ids(tabs, 1, 40, 9)
        out = np.empty((40, 264), np.uint8)
        src.lease_failed(
            lease["client"], TransportError("connection reset by peer"), [(1, ids, out)], time.perf_counter()
        )
        assert np.array_equal(out, _ref(tabs, 1, ids))
        c = src.counters()
        assert not src.connected and c["breaker_opens"] == 1 and c["transport_errors"] == 1
        assert _lookups_exact(tabs, src, 11)  # local, no stale request on the old connection
        assert src.counters()["transport_errors"] == 1
    finally:
        src.close()
        srv.stop()


def test_the_probe_closes_the_breaker_as_soon_as_the_server_answers(tabs) -> None:
    port = free_port()
    src = _source(tabs, port)
    srv = None
    try:
        assert not src.connected
        time.sleep(2 * breaker.RECONNECT_MAX_S)  # the backoff at its bound
        srv = serve_tables(tabs, port)
        t0 = time.monotonic()
        assert src.wait_connected(PROBE_BOUND_S)
        assert time.monotonic() - t0 < PROBE_BOUND_S
        before = src.counters()["remote_rows"]
        assert _lookups_exact(tabs, src, 21)
        assert src.counters()["remote_rows"] == before + 3 * (200 + 120)
    finally:
        src.close()
        if srv is not None:
            srv.stop()


@pytest.fixture
def workers():
    yield
    E.stop_workers()


def _step(tabs_, r1, r14, t: int, seed: int) -> bool:
    ids1, ids14 = lookup_ids(tabs_, r1, t, seed), lookup_ids(tabs_, r14, t, seed + 1000)
    o1, o14 = poisoned(t, r1.part), poisoned(t, r14.part)
    r1.start(torch.from_numpy(ids1), o1)
    r14.start(torch.from_numpy(ids14), o14)
    r1.join()
    r14.join()
    return exact_rows(tabs_, r1, ids1, o1) and exact_rows(tabs_, r14, ids14, o14)


@pytest.mark.skipif(overlay_core._core is None or native._fastrow is None, reason="the C++ extensions are not built")
def test_the_core_fills_local_rows_itself_while_the_server_is_dead_and_the_probe_brings_it_back(
    tabs, workers, monkeypatch
) -> None:
    port = free_port()
    srv = serve_tables(tabs, port)
    src = _source(tabs, port)
    leases: list[str] = []
    real_lease = src.native_lease

    def lease():
        leases.append(threading.current_thread().name)
        return real_lease()

    monkeypatch.setattr(src, "native_lease", lease)
    try:
        r1, r14 = remote_rows(tabs, src, 1), remote_rows(tabs, src, 14)
        for step in range(3):
            assert _step(tabs, r1, r14, 6, 100 + step)
        w = r1._worker
        assert w.core.lent() and leases == [w.thread.name]  # the first lease: the worker's start
        srv.stop()
        c0 = dict(w.counters)
        for step in range(6):
            assert _step(tabs, r1, r14, 6, 110 + step)  # exact: the C++ fill from the shard
        c1 = dict(w.counters)
        assert c1["native_local_jobs"] - c0["native_local_jobs"] >= 10  # every layer of every step but the failed one's
        assert c1["native_jobs"] - c0["native_jobs"] == 12  # all of them served by the core, none by Python
        assert c1.get("local_fills_after_failure", 0) == 1
        assert not w.core.lent() and w.thread.name not in leases[1:]  # no connect on the worker thread
        sc = src.counters()
        assert sc["transport_errors"] >= 1 and sc["fallbacks"] >= 6 and not src.connected
        assert r1.counters["worker_refusals"] == 0 and r1.counters["handoff_timeouts"] == 0
        srv = serve_tables(tabs, port)
        t0 = time.monotonic()
        before = w.counters["native_requests"]
        while w.counters["native_requests"] == before and time.monotonic() - t0 < PROBE_BOUND_S:
            assert _step(tabs, r1, r14, 6, 130)
            time.sleep(0.01)
        assert w.counters["native_requests"] > before, "the probe's lease was not adopted"
        assert w.counters["native_offers_adopted"] >= 1 and set(leases[1:]) <= {w.probe.name}
    finally:
        E.stop_workers()
        src.close()
        srv.stop()


@pytest.mark.skipif(overlay_core._core is None or native._fastrow is None, reason="the C++ extensions are not built")
def test_an_idle_core_takes_a_job_inside_its_spin_window_and_sleeps_after_it(tabs, workers, monkeypatch) -> None:
    """The spin-then-wait wake-up: jobs that come within IDLE_SPIN_S of the last one end its spin
    (counted); with the window 0 the core only sleeps on its condition variable."""
    port = free_port()
    srv = serve_tables(tabs, port)
    src = _source(tabs, port)
    try:
        r1, r14 = remote_rows(tabs, src, 1), remote_rows(tabs, src, 14)
        assert _step(tabs, r1, r14, 4, 200)
        w = r1._worker
        s0 = w.counters["native_idle_spins"]
        for step in range(3):
            time.sleep(0.02)
            assert _step(tabs, r1, r14, 4, 201 + step)
        c = w.counters
        assert c["native_idle_spins"] > s0 and c["native_idle_spin_s"] > 0
        w.core.set_idle_spin(0.0)
        assert _step(tabs, r1, r14, 4, 209)  # ends a spin that began under the old window
        s1 = w.counters["native_idle_spins"]
        for step in range(3):
            assert _step(tabs, r1, r14, 4, 210 + step)
        assert w.counters["native_idle_spins"] == s1
        with pytest.raises(ValueError):
            w.core.set_idle_spin(-1.0)
    finally:
        E.stop_workers()
        src.close()
        srv.stop()
