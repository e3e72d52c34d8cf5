"""Shared-memory ring + host flags, and the proxy loop in-process (torch-free paths)."""

from __future__ import annotations

import threading
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

from dsv41.drafter import protocol as P
from dsv41.drafter.proxy import run_proxy
from dsv41.drafter.shm import ProxyState, Ring, SlotState
from dsv41.errors import Dsv41Error


@pytest.fixture
def ring():
    r = Ring.create(3, 4096)
    yield r
    r.close()


def test_slots_flags_and_torn_writes(ring):
    other = Ring.attach(ring.name, untrack=False)
    try:
        ring.write(2, SlotState.REQUEST, 9, b"later")
        ring.write(0, SlotState.REQUEST, 4, b"first")
        assert other.find(SlotState.REQUEST) == [0, 2]  # oldest sequence first
        assert other.read(0) == (4, 0, b"first")
        # a payload byte changed after the CRC was written: not consumed
        off = 512 + 32
        other.buf[off] ^= 0xFF
        assert other.read(0) is None
        ring.beat_engine()
        other.beat_proxy()
        assert ring.proxy_heartbeat > 0 and other.engine_heartbeat > 0
        other.proxy_state = ProxyState.REFUSED
        other.error = "identity mismatch é"
        other.bump("timeouts", 3)
        assert ring.proxy_state == ProxyState.REFUSED and ring.error == "identity mismatch é"
        assert ring.counters()["timeouts"] == 3
        ring.stop = True
        assert other.stop
        with pytest.raises(Dsv41Error, match="do not fit"):
            ring.write(1, SlotState.REQUEST, 1, b"x" * 5000)
    finally:
        other.close()


def test_attach_errors():
    with pytest.raises(Dsv41Error, match="does not exist"):
        Ring.attach("dsv41-missing-ring")
    foreign = shared_memory.SharedMemory(create=True, size=1024)
    try:
        with pytest.raises(Dsv41Error, match="not a dsv41 drafter ring"):
            Ring.attach(foreign.name, untrack=False)
    finally:
        foreign.close()
        foreign.unlink()
    with pytest.raises(Dsv41Error):
        Ring.create(0, 4096)


def _serve(ring, url, **kw):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("n", run_proxy(ring.name, url, {}, **kw)), daemon=True)
    t.start()
    return t, box


def test_proxy_loop_unreachable_worker_stop_and_engine_timeout(ring):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ring.beat_engine()
    t, box = _serve(ring, f"tcp://127.0.0.1:{port}", timeout_ms=50, nap_us=100, nap_max_us=2000)
    rnd = P.Round([P.RoundItem("a", np.array([1, 2]), np.zeros(4, np.float32), 3)], 4).encode()
    ring.write(0, SlotState.REQUEST, 1, rnd)
    t0 = time.monotonic()
    while ring.slot_state(0) != SlotState.REPLY and time.monotonic() - t0 < 10:
        ring.beat_engine()
        time.sleep(0.005)
    seq, status, body = ring.read(0)
    assert seq == 1 and status == P.Status.UNAVAILABLE and b"connect failed" in body
    assert ring.proxy_state == ProxyState.DISCONNECTED and ring.counters()["unavailable"] == 1
    ring.stop = True
    t.join(5)
    assert not t.is_alive() and box["n"] == 1 and ring.proxy_state == ProxyState.STOPPED
    # an orphaned proxy (engine heartbeat stale) exits by itself
    ring.stop = False
    ring.engine_heartbeat = time.monotonic_ns() - int(60e9)
    t, box = _serve(ring, f"tcp://127.0.0.1:{port}", engine_timeout_s=1.0)
    t.join(5)
    assert not t.is_alive() and box["n"] == 0
    with pytest.raises(FileNotFoundError):  # and removes the ring its dead engine left behind
        shared_memory.SharedMemory(name=ring.name)
