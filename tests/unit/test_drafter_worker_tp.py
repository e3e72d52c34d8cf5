"""The two-card drafter worker (`dsv41 drafter serve --cards 2`), on CPU with gloo and two
processes: what a client sees is the one-card worker's (hello, identities, limits, drafts), the
lifetime card locks, the pair checks (injected device facts), and the drills: a frozen rank 1 (a
collective that times out, never a hang), rank 1 killed in the middle of a round, rank 0 killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv41.cli import main
from dsv41.drafter import gpulock, pair, protocol as P
from dsv41.drafter.client import DrafterClient, DrafterUnavailable, RoundTimeout, WorkerRefused
from dsv41.drafter.model import TorchDrafter, random_drafter
from dsv41.drafter.worker import DrafterWorker
from dsv41.errors import Dsv41Error

torch.set_num_threads(1)
H, TARGET = 16, "cd" * 32
RANK1 = re.compile(r"rank 1 is pid (\d+)")


# ---------------------------------------------------------------------------------------- helpers


class Pair:
    """A running `dsv41 drafter serve --cards 2 --devices cpu,cpu` (rank 0 = ``proc``)."""

    def __init__(self, proc: subprocess.Popen, url: str, rank1: int, stderr: Path) -> None:
        self.proc, self.url, self.rank1, self.stderr = proc, url, rank1, stderr

    def err(self) -> str:
        return self.stderr.read_text()

    def error_line(self) -> str:
        lines = [ln for ln in self.err().splitlines() if ln.startswith("dsv41: error:")]
        return lines[-1] if lines else ""


def _argv(ddir, tmp: Path, lock_dir: Path, peer_timeout: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dsv41.cli",
        "drafter",
        "serve",
        "--listen",
        "tcp://127.0.0.1:0",
        "--drafter",
        str(ddir),
        "--cards",
        "2",
        "--devices",
        "cpu,cpu",
        "--lock-dir",
        str(lock_dir),
        "--ready-file",
        str(tmp / "ready"),
        "--target-identity",
        TARGET,
        "--peer-timeout",
        str(peer_timeout),
    ]


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not count) and is a rank 1 of ours."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            ours = b"dsv41.drafter.worker_tp" in f.read()
    except OSError:
        return False
    return ours and state != "Z"


def _gone(pid: int) -> bool:
    """``pid`` has exited (no such process, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _cards_free(lock_dir: Path) -> bool:
    """Both CPU stand-in cards can be locked (then released again)."""
    try:
        gpulock.release(gpulock.acquire_all(lock_dir, ["cpu-0", "cpu-1"]))
    except gpulock.CardBusy:
        return False
    return True


def _wait(cond, timeout: float) -> float:
    """Seconds until ``cond()`` held; fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def _start(ddir, tmp: Path, *, lock_dir: Path | None = None, peer_timeout: float = 5.0) -> Pair:
    tmp.mkdir(parents=True, exist_ok=True)
    stderr = tmp / "stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            _argv(ddir, tmp, lock_dir or tmp / "locks", peer_timeout),
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    ready = tmp / "ready"
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the pair did not start (rc {proc.poll()}): {stderr.read_text()[-2000:]}")
        time.sleep(0.05)
    m = RANK1.search(stderr.read_text())
    assert m, stderr.read_text()
    return Pair(proc, ready.read_text().strip(), int(m.group(1)), stderr)


def _cleanup(p: Pair) -> None:
    if p.proc.poll() is None:
        p.proc.kill()
        p.proc.wait(10)
    if _alive(p.rank1):
        os.kill(p.rank1, signal.SIGKILL)


@pytest.fixture
def started():
    pairs: list[Pair] = []
    yield pairs
    for p in pairs:
        _cleanup(p)


def _drafter(tmp_path_factory, d_model: int, vocab: int) -> Path:
    d = tmp_path_factory.mktemp(f"drafter{d_model}")
    random_drafter(d, vocab_size=vocab, hidden_size=H, seed=3, d_model=d_model, target_identity=TARGET)
    return d


@pytest.fixture(scope="module")
def even_dir(tmp_path_factory):
    return _drafter(tmp_path_factory, 32, 40)


@pytest.fixture(scope="module")
def even_pair(even_dir, tmp_path_factory):
    p = _start(even_dir, tmp_path_factory.mktemp("even"))
    yield p
    _cleanup(p)


def _rounds(vocab: int, n: int, seed: int) -> list[P.Round]:
    """Mixed rounds: batch 1-8, depth 0-7, greedy and sampled, tails shorter than n_ctx."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        items = []
        for i in range(int(rng.integers(1, 9))):
            tokens = rng.integers(0, vocab, int(rng.integers(1, 9)))
            items.append(
                P.RoundItem(
                    f"r{i}",
                    tokens,
                    rng.standard_normal(H).astype(np.float32),
                    int(rng.integers(0, 8)),
                    float(rng.choice([0.0, 0.7, 1.3])),
                    int(rng.integers(0, 2**63)),
                    tokens.size + int(rng.integers(0, 5000)),  # the full context may be longer
                )
            )
        out.append(P.Round(items, H))
    return out


def _one_card(ddir):
    w = DrafterWorker(TorchDrafter(ddir), target_identity=TARGET)
    w.start()
    return w


def _client(url: str, timeout_ms: float = 20000) -> DrafterClient:
    return DrafterClient(url, {"target": TARGET}, timeout_ms=timeout_ms, connect_timeout_ms=5000, reconnect_s=0.0)


# ---------------------------------------------------------------------------------------- sameness


def test_a_client_cannot_tell_the_pair_from_one_card(even_pair, even_dir):
    """Same hello (identities, limits, backend name) and bit-identical drafts, top ids and
    probabilities for the same rounds (even halves: docs in dsv41.drafter.tp_model)."""
    one = _one_card(even_dir)
    try:
        a, b = _client(even_pair.url), _client(f"tcp://{one.address[0]}:{one.address[1]}")
        assert a.connect() == b.connect() == one.hello
        items = 0
        for rnd in _rounds(40, 24, seed=7):
            got, want = a.round(rnd), b.round(rnd)
            for name in ("tokens", "top_ids", "top_probs"):
                for x, y in zip(getattr(got, name), getattr(want, name), strict=True):
                    np.testing.assert_array_equal(x, y, err_msg=name)
            items += len(rnd.items)
        assert items > 60 and a.counters["rounds_ok"] == 24
        a.close()
        b.close()
    finally:
        one.stop()


def test_uneven_halves_draft_the_same_tokens(tmp_path_factory, started):
    """Odd d_model and vocabulary (halves 17/16 and 21/20): the same tokens and top ids; the
    probabilities within 1e-6 (a half-width product may take another BLAS kernel)."""
    ddir = _drafter(tmp_path_factory, 33, 41)
    p = _start(ddir, tmp_path_factory.mktemp("uneven"))
    started.append(p)
    ref = TorchDrafter(ddir)
    c = _client(p.url)
    worst = 0.0
    for rnd in _rounds(41, 16, seed=11):
        got, want = c.round(rnd), ref.draft(rnd.items)
        for x, y in zip(got.tokens, want.tokens, strict=True):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(got.top_ids, want.top_ids, strict=True):
            np.testing.assert_array_equal(x, y)
        for x, y in zip(got.top_probs, want.top_probs, strict=True):
            worst = max(worst, float(np.abs(x - y).max(initial=0.0)))
    assert worst <= 1e-6, worst
    c.close()


def test_the_pair_refuses_bad_rounds_and_keeps_serving(even_pair):
    c = _client(even_pair.url)
    bad = _rounds(40, 1, seed=1)[0]
    bad.items[0].tokens = np.array([40 + 2])
    with pytest.raises(WorkerRefused) as ei:
        c.round(bad)
    assert ei.value.status == P.Status.MALFORMED
    big = P.Round([P.RoundItem(f"x{i}", np.array([1]), np.zeros(H, np.float32), 2) for i in range(65)], H)
    with pytest.raises(WorkerRefused) as ei:
        c.round(big)
    assert ei.value.status == P.Status.LIMIT
    assert len(c.round(_rounds(40, 1, seed=2)[0]).tokens) >= 1  # still one healthy pair
    assert even_pair.proc.poll() is None and _alive(even_pair.rank1)
    c.close()


# ---------------------------------------------------------------------------------------- locks


def test_a_held_card_refuses_a_second_worker_naming_the_holder(even_dir, tmp_path, started):
    """A second pair on the same cards exits 1 naming the first's pid; SIGTERM stops the first
    (exit 0, rank 1 gone) and both cards are free again."""
    locks = tmp_path / "locks"
    a = _start(even_dir, tmp_path / "a", lock_dir=locks)
    started.append(a)
    (tmp_path / "b").mkdir()
    r = subprocess.run(
        _argv(even_dir, tmp_path / "b", locks, 5.0),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        f"dsv41: error: card cpu-0 is held by pid {a.proc.pid} (lock {locks}/cpu-0.lock); stop that worker first"
    ), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b" / "ready").exists()
    assert gpulock.holder_pid(locks / "cpu-1.lock") == a.proc.pid
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(30) == 0, a.err()
    _wait(lambda: _gone(a.rank1), 10)
    _wait(lambda: _cards_free(locks), 5)


def test_killed_rank0_frees_both_cards(even_dir, tmp_path, started):
    """SIGKILL on rank 0: rank 1 sees its control channel close and ends; the kernel drops both
    locks (rank 1 held the second card's descriptor until then)."""
    a = _start(even_dir, tmp_path)
    started.append(a)
    a.proc.kill()
    a.proc.wait(10)
    _wait(lambda: _gone(a.rank1), 15)
    _wait(lambda: _cards_free(tmp_path / "locks"), 5)


def test_card_lock_unit(tmp_path):
    fd = gpulock.acquire(tmp_path, "gpu-abc")
    try:
        assert gpulock.holder_pid(tmp_path / "gpu-abc.lock") == os.getpid()
        with pytest.raises(gpulock.CardBusy, match=f"held by pid {os.getpid()}") as ei:
            gpulock.acquire(tmp_path, "gpu-abc")
        assert ei.value.holder == os.getpid()
        # all or none: the free card taken first is released when the second is busy
        with pytest.raises(gpulock.CardBusy):
            gpulock.acquire_all(tmp_path, ["gpu-free", "gpu-abc"])
        gpulock.release([gpulock.acquire(tmp_path, "gpu-free")])
    finally:
        os.close(fd)
    gpulock.release([gpulock.acquire(tmp_path, "gpu-abc")])
    for bad in ("", "../x", "a/b", "x" * 81, ".hidden", "gpu 0"):
        with pytest.raises(Dsv41Error, match="not a card name"):
            gpulock.acquire(tmp_path, bad)
    (tmp_path / "file").write_text("")
    with pytest.raises(Dsv41Error, match="cannot open"):
        gpulock.acquire(tmp_path / "file" / "sub", "gpu-0")


# ---------------------------------------------------------------------------------------- pair checks

CARD = pair.DeviceFacts(
    "cuda:0", True, "NVIDIA GeForce RTX 3090", "GPU-11111111-aaaa", 25_769_803_776, "8.6", "12040", 2
)


def test_pair_checks_with_injected_facts():
    other = replace(CARD, device="cuda:1", uuid="GPU-22222222-bbbb")
    assert pair.check_pair([CARD, other], True) == []
    (warn,) = pair.check_pair([CARD, other], False)
    assert "no peer access between cuda:0 and cuda:1" in warn and "host memory" in warn
    cpu = pair.DeviceFacts("cpu", True, "cpu")
    assert pair.check_pair([cpu, cpu], None) == []
    with pytest.raises(Dsv41Error, match="cuda:1 is not present .2 CUDA device"):
        pair.check_pair([CARD, pair.DeviceFacts("cuda:1", False, visible=2)], None)
    with pytest.raises(Dsv41Error, match="different kinds"):
        pair.check_pair([cpu, other], None)
    with pytest.raises(Dsv41Error, match="same card"):
        pair.check_pair([CARD, replace(CARD, device="cuda:1")], True)  # one UUID under two numbers
    with pytest.raises(Dsv41Error, match="exactly 2"):
        pair.check_pair([CARD], True)
    # every identity fact the check compares refuses a mixed pair
    compared = {"name", "total_memory", "capability", "driver"}
    assert compared < {f.name for f in fields(pair.DeviceFacts)}
    for name in sorted(compared):
        odd = replace(other, **{name: 1 if name == "total_memory" else "other"})
        with pytest.raises(Dsv41Error, match="differ in") as ei:
            pair.check_pair([CARD, odd], True)
        assert "cuda:0 (" in str(ei.value) and "cuda:1 (" in str(ei.value)


def test_card_keys_are_names():
    assert pair.card_key(CARD, 0) == "gpu-11111111-aaaa"
    assert pair.card_key(replace(CARD, uuid="../../etc/x"), 0) == "gpu-etcx"
    assert pair.card_key(replace(CARD, uuid="", device="cuda:3"), 1) == "gpu-index-3"
    assert [pair.card_key(pair.DeviceFacts("cpu", True), i) for i in (0, 1)] == ["cpu-0", "cpu-1"]
    assert pair.parse_devices("cuda,cuda:1", 2) == ["cuda:0", "cuda:1"]


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("dsv41: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_serve_refuses_bad_pair_arguments(even_dir, tmp_path, capsys, monkeypatch):
    base = [
        "drafter",
        "serve",
        "--listen",
        "tcp://127.0.0.1:0",
        "--drafter",
        str(even_dir),
        "--lock-dir",
        str(tmp_path),
    ]
    assert "--devices '': expected 2 devices" in _err(capsys, [*base, "--cards", "2"])
    for devices in ("cpu", "cpu,cpu,cpu", "cpu,tpu", "cpu,", "cuda:x,cuda:1"):
        assert "--devices" in _err(capsys, [*base, "--cards", "2", "--devices", devices])
    assert "is for --cards 2" in _err(capsys, [*base, "--devices", "cpu,cpu"])
    assert "with --cards 2 name both" in _err(
        capsys, [*base, "--cards", "2", "--device", "cpu", "--devices", "cpu,cpu"]
    )
    assert "torch backend only" in _err(capsys, [*base, "--cards", "2", "--devices", "cpu,cpu", "--backend", "exl3"])
    assert "no CUDA graphs" in _err(capsys, [*base, "--cards", "2", "--devices", "cpu,cpu", "--cuda-graphs"])
    # a machine without these cards (this one, or CUDA_VISIBLE_DEVICES hiding them)
    assert "device cuda:6 is not present" in _err(capsys, [*base, "--cards", "2", "--devices", "cuda:6,cuda:7"])
    # injected facts: two different cards are refused before anything is loaded or locked
    facts = {"cuda:0": CARD, "cuda:1": replace(CARD, device="cuda:1", uuid="GPU-2", name="NVIDIA RTX A4000")}
    monkeypatch.setattr(pair, "probe_device", facts.__getitem__)
    monkeypatch.setattr(pair, "probe_peer", lambda a, b: True)
    assert "differ in product" in _err(capsys, [*base, "--cards", "2", "--devices", "cuda:0,cuda:1"])
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()
    # a card another process holds: refused naming the holder (here: this test's process)
    held = gpulock.acquire(tmp_path, "cpu-1")
    try:
        assert f"card cpu-1 is held by pid {os.getpid()}" in _err(
            capsys, [*base, "--cards", "2", "--devices", "cpu,cpu", "--target-identity", TARGET]
        )
    finally:
        os.close(held)
    assert "distilled for target" in _err(
        capsys, [*base, "--cards", "2", "--devices", "cpu,cpu", "--target-identity", "ef" * 32]
    )


# ---------------------------------------------------------------------------------------- drills


def test_a_frozen_rank1_times_out_never_hangs(even_dir, tmp_path, started):
    """SIGSTOP on rank 1: the client's round times out at its own deadline (fails closed), the
    worker's collective ends after --peer-timeout, the round is refused and the worker exits 1 with
    one line; rank 1 is killed, later rounds find no worker (DrafterUnavailable) at once."""
    p = _start(even_dir, tmp_path, peer_timeout=1.5)
    started.append(p)
    c = _client(p.url, timeout_ms=300)
    c.connect()
    os.kill(p.rank1, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RoundTimeout):
        c.round(_rounds(40, 1, seed=3)[0])
    assert time.monotonic() - t0 < 2.0
    assert p.proc.wait(30) == 1
    ended = time.monotonic() - t0
    assert 1.4 < ended < 25, ended
    line = p.error_line()
    assert "did not answer within 1.5 s" in line and "Traceback" not in p.err(), p.err()
    _wait(lambda: _gone(p.rank1), 10)
    t1 = time.monotonic()
    with pytest.raises(DrafterUnavailable):
        c.round(_rounds(40, 1, seed=4)[0], timeout_s=5.0)
    assert time.monotonic() - t1 < 2.0
    _wait(lambda: _cards_free(tmp_path / "locks"), 5)


def test_rank1_killed_mid_round(even_dir, tmp_path, started):
    """Rank 1 frozen, a round enters the collective, rank 1 is SIGKILLed: the round ends at once
    (long before the 60 s peer timeout) refused or disconnected, the worker exits 1 with one
    line, and the client keeps failing closed without waiting."""
    p = _start(even_dir, tmp_path, peer_timeout=60.0)
    started.append(p)
    c = _client(p.url, timeout_ms=30000)
    c.connect()
    os.kill(p.rank1, signal.SIGSTOP)
    box: dict = {}

    def run():
        t = time.monotonic()
        try:
            c.round(_rounds(40, 1, seed=5)[0])
            box["result"] = "drafts"
        except (WorkerRefused, DrafterUnavailable) as exc:
            box["result"] = exc
        box["s"] = time.monotonic() - t

    th = threading.Thread(target=run)
    th.start()
    time.sleep(0.7)  # the round is in rank 0's collective now
    assert th.is_alive()
    os.kill(p.rank1, signal.SIGKILL)
    th.join(20)
    assert not th.is_alive() and box["s"] < 15, box
    res = box["result"]
    assert isinstance(res, DrafterUnavailable) or (
        isinstance(res, WorkerRefused) and res.status == P.Status.INTERNAL
    ), res
    assert p.proc.wait(20) == 1
    line = p.error_line()
    assert "lost the TP peer" in line or "rank 1" in line, p.err()
    assert "Traceback" not in p.err()
    with pytest.raises(DrafterUnavailable):
        c.round(_rounds(40, 1, seed=6)[0], timeout_s=5.0)
    _wait(lambda: _cards_free(tmp_path / "locks"), 5)
