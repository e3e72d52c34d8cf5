"""Shared-memory ring + host flags, and the proxy loop in-process (torch-free paths)."""

from __future__ import annotations

import os
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


def test_corrupt_ring_values_raise_ring_corrupt_not_crash(ring):
    import struct

    from dsv41.drafter.shm import RingCorrupt

    ring.write(1, SlotState.REPLY, 5, b"ok")
    struct.pack_into("<I", ring.buf, 512 + 0 * (32 + 4096), 0xDEAD)  # garbage state word in slot 0
    with pytest.raises(RingCorrupt, match="slot 0 state"):
        ring.slot_state(0)
    assert ring.find(SlotState.REPLY) == [1] and ring.find(SlotState.FREE) == [2]  # garbage never matches
    assert ring.read(1) == (5, 0, b"ok")
    struct.pack_into("<I", ring.buf, 20, 77)
    with pytest.raises(RingCorrupt, match="proxy state"):
        _ = ring.proxy_state


def test_attach_refuses_a_header_larger_than_the_segment(ring):
    import struct

    struct.pack_into("<I", ring.buf, 12, 1 << 27)  # slot_size far past the segment's end
    with pytest.raises(Dsv41Error, match="does not fit"):
        Ring.attach(ring.name, untrack=False)
    struct.pack_into("<I", ring.buf, 12, 4096)
    Ring.attach(ring.name, untrack=False).close()


def test_create_skips_a_stale_segment_with_the_same_name(monkeypatch):
    """A segment left by a crashed engine under the name the generator picks is neither reused
    nor clobbered: creation moves on to a fresh name."""
    from multiprocessing import shared_memory as sm

    stale = sm.SharedMemory(create=True, size=1024)
    stale.buf[:4] = b"OLD!"
    names = iter([stale.name.lstrip("/"), "dsv41_test_fresh_ring"])
    monkeypatch.setattr(sm, "_make_filename", lambda: "/" + next(names))
    try:
        r = Ring.create(2, 4096)
        try:
            assert r.name.lstrip("/") == "dsv41_test_fresh_ring"
            assert bytes(stale.buf[:4]) == b"OLD!"
        finally:
            r.close()
        assert not os.path.exists("/dev/shm/dsv41_test_fresh_ring")  # the owner unlinked it
    finally:
        stale.close()
        stale.unlink()


def test_proxy_modules_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, dsv41.drafter.proxy, dsv41.drafter.proxy_cli, dsv41.drafter.shm, dsv41.drafter.client; "
        "bad = [m for m in ('torch', 'dsv41.drafter.model') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_proxy_with_a_live_parent_survives_an_idle_engine(ring):
    """An engine that drafts nothing for a while does not beat; with a parent pid to watch the
    proxy must stay up (else every idle spell would spend a respawn)."""
    ring.engine_heartbeat = time.monotonic_ns() - int(60e9)
    t, box = _serve(ring, "tcp://127.0.0.1:1", engine_timeout_s=0.1, parent_pid=os.getppid(), nap_max_us=2000)
    time.sleep(0.5)
    assert t.is_alive() and os.path.exists("/dev/shm/" + ring.name.lstrip("/"))
    ring.stop = True
    t.join(5)
    assert not t.is_alive() and box["n"] == 0
