"""The drafter worker and client: hello/identities, rounds, timeouts, late replies, refusals,
fuzzed frames against a live worker, metrics."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41.drafter import protocol as P
from dsv41.drafter.client import DrafterClient, DrafterUnavailable, IdentityMismatch, RoundTimeout, WorkerRefused
from dsv41.drafter.model import TorchDrafter, random_drafter
from dsv41.drafter.worker import DrafterWorker

torch.set_num_threads(1)
H, V, TARGET = 16, 40, "cd" * 32


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    random_drafter(d, vocab_size=V, hidden_size=H, seed=1, d_model=32, target_identity=TARGET)
    return d


@pytest.fixture(scope="module")
def worker(ddir):
    w = DrafterWorker(TorchDrafter(ddir, max_batch=8), target_identity=TARGET)
    w.start()
    yield w
    w.stop()


def _url(w):
    return f"tcp://{w.address[0]}:{w.address[1]}"


def _expected(w):
    return {"drafter": w.hello.drafter_identity, "markov": w.hello.markov_identity, "target": TARGET}


def _round(n=2, depth=4):
    rng = np.random.default_rng(2)
    return P.Round([P.RoundItem(f"q{i}", rng.integers(0, V, 7), rng.standard_normal(H).astype(np.float32), depth)
                    for i in range(n)], H)


def test_round_matches_local_backend(worker, ddir):
    c = DrafterClient(_url(worker), _expected(worker), timeout_ms=2000)
    hello = c.connect()
    assert hello.max_k == 7 and hello.hidden_size == H and hello.backend == "torch"
    r = _round()
    got = c.round(r)
    ref = TorchDrafter(ddir).draft(r.items)
    for a, b in zip(got.tokens, ref.tokens):
        np.testing.assert_array_equal(a, b)
    assert c.counters["rounds_ok"] == 1
    c.close()


def test_identity_mismatch_refused_both_sides(worker):
    bad = dict(_expected(worker), drafter="00" * 32)
    c = DrafterClient(_url(worker), bad, timeout_ms=500)
    with pytest.raises(IdentityMismatch, match="identity mismatch"):
        c.connect()
    assert c.counters["identity_refusals"] == 1 and c.sock is None
    with pytest.raises(IdentityMismatch):
        c.round_raw(b"")  # stays refused during the backoff, no traffic
    assert c.counters["identity_refusals"] == 1
    # the worker refuses a client that serves another target
    c2 = DrafterClient(_url(worker), dict(_expected(worker), target="ee" * 32), timeout_ms=500)
    with pytest.raises(IdentityMismatch, match="refused our target"):
        c2.connect()
    assert worker.metrics.refusals.labels("identity_mismatch")._value.get() >= 1


def test_timeout_then_late_reply_dropped(ddir):
    w = DrafterWorker(TorchDrafter(ddir), target_identity=TARGET, delay_ms=150)
    w.start()
    try:
        c = DrafterClient(_url(w), _expected(w), timeout_ms=30, connect_timeout_ms=2000)
        c.connect()
        with pytest.raises(RoundTimeout):
            c.round(_round(1))
        w.delay_s = 0.0
        got = c.round(_round(1), timeout_s=5.0)  # the late reply to round 1 arrives first: dropped
        assert len(got.tokens) == 1
        assert c.counters["timeouts"] == 1 and c.counters["late_dropped"] == 1
        c.close()
    finally:
        w.stop()


def test_worker_refuses_bad_rounds_and_keeps_connection(worker):
    c = DrafterClient(_url(worker), _expected(worker), timeout_ms=2000)
    c.connect()
    bad = _round(1)
    bad.items[0].tokens = np.array([V + 3])
    with pytest.raises(WorkerRefused) as ei:
        c.round(bad)
    assert ei.value.status == P.Status.MALFORMED
    with pytest.raises(WorkerRefused) as ei:
        c.round(_round(9))  # over max_batch 8
    assert ei.value.status == P.Status.LIMIT
    wrong = P.Round([P.RoundItem("x", np.array([1]), np.zeros(H + 1, np.float32), 2)], H + 1)
    with pytest.raises(WorkerRefused):
        c.round(wrong)
    assert len(c.round(_round(1)).tokens) == 1  # still usable
    assert c.counters["refusals"] == 3
    c.close()


def test_no_hello_and_unreachable(worker):
    with socket.create_connection(worker.address, timeout=2) as s:
        P.send_frame(s, P.Msg.ROUND, _round(1).encode(), round_id=1)
        head, body = P.read_frame(s)
        assert head.msg == P.Msg.ERROR and head.status == P.Status.NO_HELLO
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = DrafterClient(f"tcp://127.0.0.1:{port}", {}, timeout_ms=50)
    with pytest.raises(DrafterUnavailable, match="connect failed"):
        c.connect()
    assert c.counters["connect_failures"] == 1


def test_metrics_exposed(worker):
    from prometheus_client import generate_latest

    c = DrafterClient(_url(worker), _expected(worker), timeout_ms=2000)
    c.round(_round(2, depth=3))
    c.close()
    text = generate_latest(worker.metrics.registry).decode()
    for name in ("dsv41_drafter_rounds_total", "dsv41_drafter_drafts_total", "dsv41_drafter_round_seconds_count",
                 "dsv41_drafter_refusals_total", "dsv41_drafter_info"):
        assert name in text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(msg=st.sampled_from([1, 3, 4, 5, 9]), body=st.binary(max_size=200), corrupt_crc=st.booleans())
def test_fuzzed_frames_refused_with_status(worker, msg, body, corrupt_crc):
    """After a valid hello, any fuzzed frame gets an ERROR status (never a crash, never drafts)."""
    with socket.create_connection(worker.address, timeout=5) as s:
        P.send_frame(s, P.Msg.HELLO_REQ, P.HelloRequest(TARGET).encode())
        assert P.read_frame(s)[0].msg == P.Msg.HELLO
        frame = bytearray(P.pack_frame(P.Msg.HELLO_REQ, b"", round_id=5))
        frame[6:8] = msg.to_bytes(2, "little")
        frame[20:24] = len(body).to_bytes(4, "little")
        import zlib
        crc = zlib.crc32(body) ^ (1 if corrupt_crc else 0)
        frame[24:28] = (crc & 0xFFFFFFFF).to_bytes(4, "little")
        s.sendall(bytes(frame) + body)
        head, reply = P.read_frame(s)
        if msg == 1 and not corrupt_crc:
            assert head.msg in (P.Msg.HELLO, P.Msg.ERROR)
        else:
            assert head.msg == P.Msg.ERROR and head.status != P.Status.OK
    # the worker still serves a well-behaved client
    c = DrafterClient(_url(worker), _expected(worker), timeout_ms=2000)
    assert len(c.round(_round(1)).tokens) == 1
    c.close()


def test_concurrent_clients(worker):
    errs = []

    def go():
        try:
            c = DrafterClient(_url(worker), _expected(worker), timeout_ms=5000)
            for _ in range(5):
                assert len(c.round(_round(2)).tokens) == 2
            c.close()
        except Exception as exc:  # collected for the assertion below
            errs.append(exc)

    ts = [threading.Thread(target=go) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs
