"""Spark-side speculators (local, remote, shadow, async proxy), fail-closed paths, watchdog,
respawn budget and the factory that builds them from settings - against synthetic inputs (no
engine needed)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from dsv41 import envs
from dsv41.drafter import factory
from dsv41.drafter.async_speculator import AsyncSpeculator
from dsv41.drafter.memlock import MemlockState
from dsv41.drafter.model import TorchDrafter, identities, random_drafter
from dsv41.drafter.protocol import RoundItem
from dsv41.drafter.shm import SlotState
from dsv41.drafter.speculators import LocalSpeculator, RemoteSpeculator, ShadowSpeculator
from dsv41.drafter.worker import DrafterWorker
from dsv41.engine.spec_decode import DraftInput
from dsv41.errors import ConfigError

torch.set_num_threads(1)
H, V, TARGET = 16, 40, "cd" * 32
MODEL_CFG = {"hidden_size": H, "vocab_size": V}


def _build(env: dict, **kw):
    """The speculator an environment asks for: parse once, then the factory."""
    return factory.build_speculator(envs.parse(env), **kw)


def _kv_extra(env: dict) -> int:
    return factory.kv_budget_extra_tokens(envs.parse(env))


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    random_drafter(d, vocab_size=V, hidden_size=H, seed=1, d_model=32, target_identity=TARGET)
    return str(d)


@pytest.fixture
def worker(ddir):
    w = DrafterWorker(TorchDrafter(ddir), target_identity=TARGET)
    w.start()
    yield w
    w.stop()


def _url(w):
    return f"tcp://{w.address[0]}:{w.address[1]}"


def _inputs(n=2, L=9, depth=5, seed=0):
    rng = np.random.default_rng(seed)
    return [
        DraftInput(
            f"r{i}", rng.integers(0, V, L + i).astype(np.int64), rng.standard_normal(H).astype(np.float32), depth
        )
        for i in range(n)
    ]


def _expected(ddir):
    return factory.expected_identities(ddir, TARGET)


def test_local_and_remote_agree_and_policy_applies(ddir, worker):
    loc = LocalSpeculator(ddir, k=5)
    rem = RemoteSpeculator(_url(worker), _expected(ddir), k=5, timeout_ms=2000)
    batch = _inputs(2)
    a, b = loc.propose(batch), rem.propose(batch)
    for x, y in zip(a, b, strict=False):
        assert x.tokens.size == 4  # batch of 2 -> depth 4 under the default policy
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.top_probs, y.top_probs, atol=1e-6)
        assert y.top_ids.shape == (4, 32) and y.top_ids.dtype == np.int64
    c = rem.counters()
    assert c["rounds"] == 1 and c["drafted_tokens"] == 8 and c["fail_closed_rounds"] == 0
    assert rem.propose([]) == [] and [p.tokens.size for p in rem.propose(_inputs(1, depth=0))] == [0]
    rem.close()


def test_remote_fails_closed_and_recovers_when_worker_dies(ddir, worker):
    rem = RemoteSpeculator(_url(worker), _expected(ddir), k=5, timeout_ms=2000, reconnect_s=0.0)
    assert rem.propose(_inputs(1))[0].tokens.size == 5
    host, port = worker.address
    worker.stop()
    out = rem.propose(_inputs(1))
    assert out[0].tokens.size == 0  # no drafts, no exception
    assert rem.counters()["fail_closed_rounds"] == 1
    w2 = DrafterWorker(TorchDrafter(ddir), host, port, target_identity=TARGET)
    w2.start()
    try:
        assert rem.propose(_inputs(1))[0].tokens.size == 5
        assert rem.counters()["reconnects"] == 1
    finally:
        w2.stop()
        rem.close()


def test_remote_refuses_mismatching_worker(tmp_path, ddir):
    other = tmp_path / "other"
    random_drafter(other, vocab_size=V, hidden_size=H, seed=9, d_model=32, target_identity=TARGET)
    w = DrafterWorker(TorchDrafter(other), target_identity=TARGET)
    w.start()
    try:
        rem = RemoteSpeculator(_url(w), _expected(ddir), k=5, timeout_ms=500, reconnect_s=0.0)
        for _ in range(3):
            assert rem.propose(_inputs(1))[0].tokens.size == 0
        c = rem.counters()
        assert c["identity_refusals"] >= 3 and c["fail_closed_rounds"] == 3 and c["rounds"] == 0
        rem.close()
    finally:
        w.stop()


def test_remote_timeout_fails_closed(ddir):
    w = DrafterWorker(TorchDrafter(ddir), target_identity=TARGET, delay_ms=200)
    w.start()
    try:
        rem = RemoteSpeculator(_url(w), _expected(ddir), k=5, timeout_ms=20)
        assert rem.propose(_inputs(1))[0].tokens.size == 0
        assert rem.counters()["timeouts"] == 1
        rem.close()
    finally:
        w.stop()


def test_shadow_parity_counts(ddir, worker):
    sh = ShadowSpeculator(_url(worker), _expected(ddir), ddir, k=5, timeout_ms=2000)
    for s in range(3):
        sh.propose(_inputs(2, seed=s))
    c = sh.counters()
    assert c["parity_rounds"] == 3 and c["parity_items"] == 6 and c["parity_mismatches"] == 0
    # a worker serving different weights under the same identities is caught by parity
    sh.local = TorchDrafter(ddir)
    with torch.no_grad():
        sh.local.model.lm_head.mul_(-1.0)
    sh.propose(_inputs(2, seed=7))
    assert sh.counters()["parity_mismatches"] >= 1
    sh.close()


def _advance(batch, props, n_tokens):
    """Commit drafts (as if all accepted) plus one more token: the next step's inputs."""
    out = []
    for x, p in zip(batch, props, strict=False):
        new = list(p.tokens[:n_tokens]) + [int(x.token_ids[-1])]
        out.append(DraftInput(x.request_id, np.concatenate([x.token_ids, np.array(new, np.int64)]), x.hidden, x.depth))
    return out


def _wait_reply(spec, timeout=20.0):
    t0 = time.monotonic()
    while spec._inflight is not None and time.monotonic() - t0 < timeout:
        spec._collect()
        if spec._inflight is None:
            break
        time.sleep(0.005)
    return spec


def test_async_proxy_realigned_drafts_watchdog_and_budget(ddir, worker):
    spec = AsyncSpeculator(
        _url(worker),
        _expected(ddir),
        k=5,
        timeout_ms=2000,
        watchdog_ms=5000,
        respawns=1,
        window_s=60,
        max_context=4,
        max_k=7,
    )
    try:
        batch = _inputs(1, depth=5)
        assert spec.propose(batch)[0].tokens.size == 0  # nothing ready on the first step
        _wait_reply(spec)
        ready = spec._ready["r0"]
        # the committed tokens equal the first 2 drafts -> drafts 3.. are proposed
        nxt = [DraftInput("r0", np.concatenate([batch[0].token_ids, ready.tokens[:2]]), batch[0].hidden, 5)]
        got = spec.propose(nxt)[0]
        np.testing.assert_array_equal(got.tokens, ready.tokens[2:7])
        # the same reply is exact: compare with drafting the original context locally
        ref = TorchDrafter(ddir).draft(
            [RoundItem("r0", batch[0].token_ids[-4:], batch[0].hidden, 7, position=batch[0].token_ids.size)]
        )
        np.testing.assert_array_equal(ready.tokens, ref.tokens[0])
        # a diverging context gets no stale drafts
        _wait_reply(spec)
        bad = [
            DraftInput(
                "r0",
                np.concatenate([nxt[0].token_ids, [(int(spec._ready["r0"].tokens[0]) + 1) % V]]),
                batch[0].hidden,
                5,
            )
        ]
        assert spec.propose(bad)[0].tokens.size == 0 and spec.counters()["stale_drafts"] >= 1
        assert "torch" not in open(f"/proc/{spec.proxy_pid}/maps").read()  # torch-free proxy process
        # kill the proxy mid-stream: the next call fails over (no drafts) and respawns once
        pid = spec.proxy_pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while spec.proc.poll() is None and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        out = spec.propose(bad)
        assert out[0].tokens.size == 0
        c = spec.counters()
        assert c["watchdog_fires"] == 1 and c["proxy_respawns"] == 1 and spec.proxy_pid != pid
        # budget of 1 respawn per window: the next death keeps the proxy down for good
        os.kill(spec.proxy_pid, signal.SIGKILL)
        spec.proc.wait(5)
        for _ in range(3):
            assert spec.propose(bad)[0].tokens.size == 0
        c = spec.counters()
        assert c["proxy_gave_up"] == 1 and c["proxy_up"] == 0 and c["proxy_down"] >= 3 and c["watchdog_fires"] == 2
    finally:
        spec.close()


def test_async_stuck_proxy_detected(ddir, worker):
    spec = AsyncSpeculator(
        _url(worker), _expected(ddir), k=5, timeout_ms=2000, watchdog_ms=300, respawns=0, window_s=60, max_context=4
    )
    try:
        assert spec.wait_ready(20)  # connected: idle, beating every loop (no promise ahead)
        # the proxy reported its memory locking before connecting: locked or the refusal, never unknown
        assert spec.counters()["proxy_memlock"] in (MemlockState.LOCKED, MemlockState.REFUSED)
        time.sleep(0.05)
        os.kill(spec.proxy_pid, signal.SIGSTOP)  # alive but frozen: only the heartbeat shows it
        time.sleep(0.5)
        assert spec.propose(_inputs(1))[0].tokens.size == 0
        assert spec.counters()["watchdog_fires"] == 0  # stale, not yet confirmed
        time.sleep(AsyncSpeculator.STALE_CONFIRM_S + 0.05)
        assert spec.propose(_inputs(1))[0].tokens.size == 0
        c = spec.counters()
        assert c["watchdog_fires"] == 1 and c["proxy_gave_up"] == 1 and spec.proc is None
    finally:
        spec.close()


def test_a_host_stall_longer_than_the_watchdog_kills_no_healthy_proxy(ddir, worker):
    """The whole host stalls (here: the proxy stopped and the engine not drafting) for longer than
    the watchdog period, and the engine runs first when it ends: the proxy's heartbeat is stale
    when the engine looks, though the proxy beats again as soon as it is scheduled. Confirming the
    staleness over STALE_CONFIRM_S keeps that proxy; a stale heartbeat judged at once killed it."""
    spec = AsyncSpeculator(
        _url(worker), _expected(ddir), k=5, timeout_ms=2000, watchdog_ms=300, respawns=0, window_s=60, max_context=4
    )
    try:
        assert spec.wait_ready(20)
        pid = spec.proxy_pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.6)  # the stall: twice the watchdog period
        os.kill(pid, signal.SIGCONT)
        spec.propose(_inputs(1))  # the engine first, before the proxy has run
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            spec.propose(_inputs(1))
            time.sleep(0.02)
            if (time.monotonic_ns() - spec.ring.proxy_heartbeat) / 1e9 < 0.1 and spec._stale_since is None:  # noqa: SLF001
                break
        c = spec.counters()
        assert c["watchdog_fires"] == 0 and spec.proxy_pid == pid and c["proxy_gave_up"] == 0
    finally:
        spec.close()


def test_async_identity_refusal_via_proxy(tmp_path, ddir, worker):
    bad = dict(_expected(ddir), markov="00" * 32)
    spec = AsyncSpeculator(_url(worker), bad, k=5, timeout_ms=500, max_context=4)
    try:
        assert spec.wait_ready(30) is False  # refused, not connected
        spec.propose(_inputs(1))
        _wait_reply(spec)
        c = spec.counters()
        assert c["identity_refusals"] == 1 and c["fail_closed_rounds"] == 1 and c["rounds"] == 0
        assert c["proxy_state"] == 3  # REFUSED
    finally:
        spec.close()


def test_env_contract(ddir, worker, monkeypatch):
    assert _build({}, model_cfg=MODEL_CFG, target_identity=TARGET) is None
    loc = _build({"DSV41_DRAFTER_LOCAL": ddir, "DSV41_DRAFTER_K": "3"}, model_cfg=MODEL_CFG, target_identity=TARGET)
    assert isinstance(loc, LocalSpeculator) and loc.k == 3
    env = {"DSV41_DRAFTER_REMOTE": _url(worker), "DSV41_DRAFTER_DIR": ddir}
    rem = _build(env, model_cfg=MODEL_CFG, target_identity=TARGET)
    assert type(rem) is RemoteSpeculator
    rem.close()
    sh = _build({**env, "DSV41_DRAFTER_SHADOW": "1"}, model_cfg=MODEL_CFG, target_identity=TARGET)
    assert isinstance(sh, ShadowSpeculator)
    sh.close()
    bad = [
        ({"DSV41_DRAFTER_REMOTE": _url(worker)}, "DSV41_DRAFTER_DIR"),
        ({**env, "DSV41_DRAFTER_LOCAL": ddir}, "only one"),
        ({**env, "DSV41_DRAFTER_K": "x"}, "integer"),
        ({**env, "DSV41_DRAFTER_K": "-1"}, "DSV41_DRAFTER_K"),
        ({**env, "DSV41_DRAFTER_K": str(1 << 40)}, "DSV41_DRAFTER_K"),
        ({**env, "DSV41_DRAFTER_TIMEOUT_MS": "0"}, "TIMEOUT_MS"),
        ({**env, "DSV41_DRAFTER_ASYNC": "maybe"}, "0 or 1"),
        ({**env, "DSV41_DRAFTER_ASYNC": "1", "DSV41_DRAFTER_SHADOW": "1"}, "synchronous"),
        ({**env, "DSV41_DRAFTER_DEPTH_POLICY": "9"}, "MAXBATCH"),
        ({"DSV41_DRAFTER_REMOTE": "http://x", "DSV41_DRAFTER_DIR": ddir}, "tcp://"),
    ]
    for e, msg in bad:
        with pytest.raises(Exception, match=msg):
            _build(e, model_cfg=MODEL_CFG, target_identity=TARGET)
    with pytest.raises(ConfigError, match="hidden_size"):
        _build(env, model_cfg={"hidden_size": H * 2}, target_identity=TARGET)
    with pytest.raises(ConfigError, match="distilled for target"):
        _build(env, model_cfg=MODEL_CFG, target_identity="ff" * 32)
    assert identities(ddir)["target"] == TARGET


def test_capacity_mode():
    assert _kv_extra({}) == 0
    on = {
        "DSV41_DRAFTER_CAPACITY_MODE": "1",
        "DSV41_DRAFTER_REMOTE": "tcp://127.0.0.1:1",
        "DSV41_DRAFTER_DIR": "/d",
        "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS": "4096",
    }
    assert _kv_extra(on) == 4096
    assert _kv_extra({**on, "DSV41_DRAFTER_REMOTE": ""}) == 0  # no remote drafter: nothing freed
    for e, msg in [
        ({**on, "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS": "0"}, "> 0"),
        ({**on, "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS": "lots"}, "integer"),
        ({**on, "DSV41_DRAFTER_LOCAL": "/x"}, "frees no memory"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            _kv_extra(e)


def _shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def test_async_garbage_in_ring_replaces_proxy_and_fails_closed(ddir, worker):
    import struct

    spec = AsyncSpeculator(_url(worker), _expected(ddir), k=5, timeout_ms=2000, respawns=1, window_s=60, max_context=4)
    try:
        batch = _inputs(1)
        spec.propose(batch)  # submits a round
        slot = spec._inflight[0]
        old_ring, old_pid = spec.ring.name, spec.proxy_pid
        struct.pack_into("<I", spec.ring.buf, 512 + slot * spec.ring.stride, 0xBAD)  # garbage state word
        assert spec.propose(batch)[0].tokens.size == 0  # no exception, no drafts
        c = spec.counters()
        assert c["watchdog_fires"] == 1 and c["proxy_respawns"] == 1 and c["fail_closed_rounds"] >= 1
        assert spec.proxy_pid != old_pid and not os.path.exists(_shm_path(old_ring))
        struct.pack_into("<I", spec.ring.buf, 20, 0xBAD)  # garbage proxy state: a scrape still works
        assert spec.counters()["proxy_state"] in (-1, 0, 1, 2, 3, 4)
    finally:
        spec.close()


def test_no_shm_left_after_normal_close_or_engine_kill(ddir, worker):
    spec = AsyncSpeculator(_url(worker), _expected(ddir), k=5, timeout_ms=2000, max_context=4)
    name, pid = spec.ring.name, spec.proxy_pid
    assert spec.wait_ready(20)
    spec.close()
    assert not os.path.exists(_shm_path(name))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # an engine killed with SIGKILL: its orphaned proxy notices and unlinks the ring itself
    import subprocess
    import sys

    code = (
        "import sys, time; from dsv41.drafter.async_speculator import AsyncSpeculator; "
        "s = AsyncSpeculator(sys.argv[1], {}, nap_us=50); "
        "print(s.ring.name, s.proxy_pid, flush=True); time.sleep(60)"
    )
    eng = subprocess.Popen(
        [sys.executable, "-c", code, _url(worker)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        name, ppid = eng.stdout.readline().split()
        assert os.path.exists(_shm_path(name))
    finally:
        eng.kill()
        eng.wait(10)
    t0 = time.monotonic()
    while os.path.exists(_shm_path(name)) and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    assert not os.path.exists(_shm_path(name))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        try:
            os.kill(int(ppid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(int(ppid), signal.SIGKILL)
        raise AssertionError("orphaned proxy still running 10 s after its engine died")


def test_async_proxy_that_cannot_start_leaks_nothing(ddir, worker, monkeypatch):
    from dsv41.drafter import shm

    made = []
    real = shm.Ring.create.__func__
    monkeypatch.setattr(shm.Ring, "create", classmethod(lambda cls, *a: made.append(real(cls, *a)) or made[-1]))
    # a proxy that cannot start at engine start-up: fail closed (no drafts, counted), no leak
    down = AsyncSpeculator(_url(worker), _expected(ddir), proxy_cmd=["/nonexistent-dsv41-python"])
    try:
        assert down.proxy_pid is None and down.ring is None
        assert down.propose(_inputs(1))[0].tokens.size == 0
        assert down.counters()["proxy_gave_up"] == 1
    finally:
        down.close()
    assert made and not os.path.exists(_shm_path(made[-1].name))
    # a respawn that fails keeps the engine decoding (no drafts) and leaves nothing behind
    spec = AsyncSpeculator(_url(worker), _expected(ddir), k=5, respawns=2, max_context=4)
    try:
        spec.proxy_cmd = ["/nonexistent-dsv41-python"]
        os.kill(spec.proxy_pid, signal.SIGKILL)
        spec.proc.wait(5)
        assert spec.propose(_inputs(1))[0].tokens.size == 0
        c = spec.counters()
        assert c["proxy_up"] == 0 and c["proxy_gave_up"] == 1 and spec.ring is None
        assert not os.path.exists(_shm_path(made[-1].name))
    finally:
        spec.close()


def test_async_round_never_readable_replaces_proxy(ddir, worker):
    now = [1000.0]
    spec = AsyncSpeculator(
        _url(worker),
        _expected(ddir),
        k=5,
        timeout_ms=50,
        watchdog_ms=5000,
        respawns=1,
        max_context=4,
        clock=lambda: now[0],
    )
    try:
        assert spec.wait_ready(20)
        batch = _inputs(1)
        spec.propose(batch)
        slot = spec._inflight[0]
        t0 = time.monotonic()
        while spec.ring.slot_state(slot) != SlotState.REPLY and time.monotonic() - t0 < 10:
            time.sleep(0.005)
        d0 = 512 + slot * spec.ring.stride + 32
        spec.ring.buf[d0] ^= 0xFF  # the reply's CRC never matches: unreadable forever
        pid = spec.proxy_pid
        assert spec.propose(batch)[0].tokens.size == 0 and spec._inflight is not None  # not yet
        now[0] += spec._inflight_limit_s + 1
        assert spec.propose(batch)[0].tokens.size == 0
        c = spec.counters()
        assert c["watchdog_fires"] == 1 and c["proxy_respawns"] == 1 and spec.proxy_pid != pid
        assert spec.wait_ready(20)  # and drafting resumes with the fresh proxy
        spec.propose(batch)
        _wait_reply(spec)
        assert spec.counters()["rounds"] >= 1
    finally:
        spec.close()


def test_async_round_longer_than_watchdog_is_not_a_hang(ddir):
    """A proxy blocked in a round (worker slower than the watchdog period, within the round
    timeout) announces when it will be back; the watchdog must not kill it."""
    slow = DrafterWorker(TorchDrafter(ddir), target_identity=TARGET, delay_ms=500)
    slow.start()
    spec = AsyncSpeculator(
        _url(slow), _expected(ddir), k=5, timeout_ms=1500, watchdog_ms=150, respawns=3, max_context=4
    )
    try:
        assert spec.wait_ready(20)
        batch = _inputs(1)
        spec.propose(batch)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            spec.propose(batch)  # the engine keeps stepping while rounds are out
            time.sleep(0.02)
        c = spec.counters()
        assert c["watchdog_fires"] == 0 and c["rounds"] >= 1 and c["timeouts"] == 0
    finally:
        spec.close()
        slow.stop()
