"""The drafter worker and client: hello/identities, rounds, timeouts, late replies, refusals,
fuzzed frames against a live worker, metrics."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

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
    return P.Round(
        [
            P.RoundItem(f"q{i}", rng.integers(0, V, 7), rng.standard_normal(H).astype(np.float32), depth)
            for i in range(n)
        ],
        H,
    )


def test_round_matches_local_backend(worker, ddir):
    c = DrafterClient(_url(worker), _expected(worker), timeout_ms=2000)
    hello = c.connect()
    assert hello.max_k == 7 and hello.hidden_size == H and hello.backend == "torch"
    r = _round()
    got = c.round(r)
    ref = TorchDrafter(ddir).draft(r.items)
    for a, b in zip(got.tokens, ref.tokens, strict=False):
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
    for name in (
        "dsv41_drafter_rounds_total",
        "dsv41_drafter_drafts_total",
        "dsv41_drafter_round_seconds_count",
        "dsv41_drafter_refusals_total",
        "dsv41_drafter_info",
    ):
        assert name in text


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
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


# ---------------------------------------------------------------------------------- hostile peers


@pytest.fixture()
def tight(ddir):
    """A worker with short hello/frame timeouts and room for 3 connections."""
    w = DrafterWorker(
        TorchDrafter(ddir, max_batch=8),
        target_identity=TARGET,
        max_connections=3,
        hello_timeout_s=0.4,
        frame_timeout_s=0.4,
    )
    w.start()
    yield w
    w.stop()


def _hello(s):
    P.send_frame(s, P.Msg.HELLO_REQ, P.HelloRequest(TARGET).encode())
    assert P.read_frame(s)[0].msg == P.Msg.HELLO


def _closed_after_error(s, status):
    head, _ = P.read_frame(s)
    assert head.msg == P.Msg.ERROR and head.status == status
    try:  # and the worker closed the connection (a reset when our unread bytes were pending)
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass


def test_silent_and_slowloris_clients_do_not_block_others(tight):
    silent = socket.create_connection(tight.address, timeout=5)  # connects, never says a word
    slow = socket.create_connection(tight.address, timeout=5)
    _hello(slow)
    frame = P.pack_frame(P.Msg.ROUND, _round(1).encode(), round_id=3)
    slow.sendall(frame[:40])  # header + a few payload bytes, then nothing
    c = DrafterClient(_url(tight), _expected(tight), timeout_ms=3000)  # served meanwhile
    assert len(c.round(_round(2)).tokens) == 2
    c.close()
    _closed_after_error(silent, P.Status.TIMEOUT)
    _closed_after_error(slow, P.Status.TIMEOUT)
    silent.close()
    slow.close()


def test_greeted_idle_client_is_not_timed_out(tight):
    c = DrafterClient(_url(tight), _expected(tight), timeout_ms=3000)
    c.connect()
    threading.Event().wait(0.6)  # longer than the frame timeout: idling between rounds is fine
    assert len(c.round(_round(1)).tokens) == 1
    c.close()


def test_length_fields_never_allocate(tight):
    import tracemalloc

    with socket.create_connection(tight.address, timeout=5) as s:  # before hello: 1 MiB is too much
        head = bytearray(P.pack_frame(P.Msg.HELLO_REQ, b""))
        head[20:24] = (1 << 20).to_bytes(4, "little")
        s.sendall(bytes(head))
        _closed_after_error(s, P.Status.BAD_LENGTH)
    with socket.create_connection(tight.address, timeout=5) as s:  # 2^31: over MAX_PAYLOAD
        _hello(s)
        head = bytearray(P.pack_frame(P.Msg.ROUND, b""))
        head[20:24] = (1 << 31).to_bytes(4, "little")
        s.sendall(bytes(head))
        _closed_after_error(s, P.Status.BAD_LENGTH)
    tracemalloc.start()
    try:
        with socket.create_connection(tight.address, timeout=5) as s:  # 60 MiB announced, 100 B sent
            _hello(s)
            head = bytearray(P.pack_frame(P.Msg.ROUND, b""))
            head[20:24] = (60 << 20).to_bytes(4, "little")
            s.sendall(bytes(head) + b"\0" * 100)
            _closed_after_error(s, P.Status.TIMEOUT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (8 << 20), f"worker allocated {peak} B for a 100 B payload"


def test_wrong_version_and_connection_limit(tight):
    with socket.create_connection(tight.address, timeout=5) as s:
        frame = bytearray(P.pack_frame(P.Msg.HELLO_REQ, P.HelloRequest(TARGET).encode()))
        frame[4:6] = (P.VERSION + 1).to_bytes(2, "little")
        s.sendall(bytes(frame))
        _closed_after_error(s, P.Status.BAD_VERSION)
    held = [socket.create_connection(tight.address, timeout=5) for _ in range(3)]
    for s in held:
        _hello(s)
    with socket.create_connection(tight.address, timeout=5) as extra:
        _closed_after_error(extra, P.Status.LIMIT)
    for s in held:
        s.close()
    c = DrafterClient(_url(tight), _expected(tight), timeout_ms=3000, reconnect_s=0.0)
    for _ in range(50):  # the worker notices the closed sockets asynchronously
        try:
            c.connect()
            break
        except DrafterUnavailable:
            threading.Event().wait(0.02)
    assert len(c.round(_round(1)).tokens) == 1
    assert tight.metrics.refusals.labels("limit")._value.get() >= 1
    c.close()


def test_client_hello_bounded_against_a_trickling_or_bloated_worker():
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def fake_worker(mode):
        conn, _ = srv.accept()
        with conn:
            P.read_frame(conn)
            if mode == "bloated":  # announces a 60 MiB HELLO
                head = bytearray(P.pack_frame(P.Msg.HELLO, b""))
                head[20:24] = (60 << 20).to_bytes(4, "little")
                conn.sendall(bytes(head))
            else:  # a valid HELLO header, then one byte every 50 ms
                frame = P.pack_frame(P.Msg.HELLO, b"\0" * 200)
                for b in frame:
                    if stop.wait(0.05):
                        break
                    try:
                        conn.sendall(bytes([b]))
                    except OSError:
                        break
            stop.wait(5)

    url = f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    try:
        for mode, msg in (("bloated", "BAD_LENGTH"), ("trickle", "timed out|before the deadline")):
            t = threading.Thread(target=fake_worker, args=(mode,), daemon=True)
            t.start()
            c = DrafterClient(url, {}, connect_timeout_ms=300)
            t0 = time.monotonic()
            with pytest.raises(DrafterUnavailable, match=msg):
                c.connect(force=True)
            assert time.monotonic() - t0 < 2.0
            stop.set()
            t.join(5)
            stop.clear()
    finally:
        srv.close()
