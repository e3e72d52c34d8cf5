"""The GPU-side join (issue 23 pass N, ``dsv41.overlay.engram_gpujoin``) on the CPU, the device
flag emulated (``FlagOps``/``FakeFlag``): the join is deferred exactly when the layer is not
handed off, not required, the knob on and the flag supported; the worker writes the flag after
the rows; a dead, hung or failing worker's rows are served exactly by the watchdog (counted
refusal, no hang) and a late hand-off writes nothing; generations only grow over many steps;
the knob's values; the C++ functions are optional (no driver here: the host join)."""

from __future__ import annotations

import itertools
import threading
import time
import types

import pytest
import torch

from dsv41.envs import ConfigError
from dsv41.overlay import engram as E
from dsv41.overlay import engram_gpujoin as GJ
from dsv41.overlay import settings as S
from dsv41.transport import native

from overlayutil import FlagOps, Gate, exact_rows as _exact, lookup_ids as _ids, poisoned as _poisoned, remote_rows as _rows, tabs  # noqa: F401 - tabs is a fixture


class _Die(BaseException):
    """Kills the worker thread (no ``except Exception`` catches it)."""


@pytest.fixture
def workers():
    yield
    E.stop_workers()


def _until(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return bool(cond())


def _rows_checked(tabs_, src, layer: int, ops: FlagOps, **kw):
    """RemoteRows whose flag checks, at every write, that the job's rows are already exact."""
    rr = _rows(tabs_, src, layer, ops=ops, **kw)
    job = {}

    def check(gen: int) -> bool:
        ids, out = job[gen]
        return _exact(tabs_, rr, ids, out)

    if rr._flag is not None:
        rr._flag.check = check
    return rr, job


CASES = list(itertools.product([False, True], repeat=5))


@pytest.mark.parametrize("handed,required,supported,knob,refused", CASES)
def test_the_join_is_deferred_exactly_when_not_handed_off_not_required_and_supported(
        tabs, workers, handed: bool, required: bool, supported: bool, knob: bool, refused: bool) -> None:
    src = Gate(tabs, required=required)
    src.hold_worker_only = True
    ops = FlagOps(supported)
    ops.refuse_wait = refused
    rr, job = _rows_checked(tabs, src, 1, ops, gpu_join=knob)
    # no device flag (so no flag writes by the worker) in required mode or with the knob off
    assert (rr._flag is not None) is (supported and knob and not required)
    ids = _ids(tabs, rr, 20, 3)
    out = _poisoned(20, rr.part)
    job[1] = (ids, out)
    if not handed:
        src.release.clear()
    rr.start(torch.from_numpy(ids), out)
    if handed:
        assert _until(rr._ho.is_set)
    else:
        assert src.entered.wait(10)
    want = not handed and not required and supported and knob and not refused
    timer = None
    if not want and not handed:  # a host join waits for the hand-off: release it meanwhile
        timer = threading.Timer(0.1, src.release.set)
        timer.start()
    then = ops.event()
    t0 = time.monotonic()
    queued = rr.join(then)
    assert rr.last_join_deferred is want
    assert rr.counters["deferred_joins"] == int(want)
    if want:
        assert time.monotonic() - t0 < 0.5 and queued is True  # returned at once, the wait on `then` queued
        assert rr._flag.waits == [(1, True)] and not rr._flag.released(1)
        assert torch.isnan(out.float()).all()  # the rows are not there yet: nothing waited on the host
        src.release.set()
        assert _until(lambda: rr._flag.released(1))
        gen, who, _, ok = rr._flag.writes[0]
        assert [w[0] for w in rr._flag.writes] == [1] and who.startswith("dsv41-engram-worker") and ok
    else:
        assert _exact(tabs, rr, ids, out)
        assert rr._flag is None or rr._flag.waits == []
    if timer is not None:
        timer.join()
    if refused and supported and knob and not handed and not required:
        assert rr._flag is None  # a refused wait turns the GPU-side join off for the table
    ids2 = _ids(tabs, rr, 5, 4)  # the next start settles the deferred job
    out2 = _poisoned(5, rr.part)
    job[2] = (ids2, out2)
    rr.lookup(torch.from_numpy(ids2), out2)
    assert _exact(tabs, rr, ids, out) and _exact(tabs, rr, ids2, out2)
    assert rr._pending is None and rr.counters["handoffs"] == 2
    assert rr.counters["worker_refusals"] == rr.counters["handoff_timeouts"] == rr.counters["watchdog_served"] == 0


def _defer_one(tabs_, rr, src, t: int, seed: int, job: dict | None = None):
    ids = _ids(tabs_, rr, t, seed)
    out = _poisoned(t, rr.part)
    if job is not None:
        job[rr._gen + 1] = (ids, out)
    src.release.clear()
    src.entered.clear()
    rr.start(torch.from_numpy(ids), out)
    return ids, out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_is_served_exactly_by_the_watchdog_and_counted(tabs, workers) -> None:
    src = Gate(tabs)
    src.hold_worker_only = True
    ops = FlagOps()
    rr, job = _rows_checked(tabs, src, 1, ops)
    src.fail = _Die()
    ids, out = _defer_one(tabs, rr, src, 16, 7, job)
    src.release.set()
    assert rr.join() is False and rr.last_join_deferred  # no `then`: vLLM waits on its own event
    assert _until(lambda: rr._flag.released(1), 5)  # ALIVE/WATCH_POLL_S, not HANDOFF_TIMEOUT_S: no hang
    gen, who, stream, ok = rr._flag.writes[-1]
    assert gen == 1 and ok and stream == "side" and not who.startswith("dsv41-engram-worker")
    assert _exact(tabs, rr, ids, out)
    # the side stream waited for the job's stream first, and the job's stream then waits for it
    mine = [a for n, w, a in ops.log if n == who and w == "wait_event"]
    assert mine[0].startswith("side<-") and _until(lambda: any(
        a.startswith("prefetch<-") for n, w, a in ops.log if n == who and w == "wait_event"), 5)
    c = rr.counters
    assert c["worker_refusals"] == 1 and c["handoff_timeouts"] == 0 and c["refused_inline"] == 1
    assert c["watchdog_served"] == 1
    ids2 = _ids(tabs, rr, 9, 8)  # the next step: settled, a new worker
    out2 = _poisoned(9, rr.part)
    job[2] = (ids2, out2)
    rr.lookup(torch.from_numpy(ids2), out2)
    assert _exact(tabs, rr, ids2, out2) and rr.counters["worker_starts"] == 2


def test_a_hung_worker_is_served_by_the_watchdog_and_its_late_hand_off_writes_nothing(tabs, workers) -> None:
    src = Gate(tabs)
    src.hold_worker_only = True
    ops = FlagOps()
    rr, job = _rows_checked(tabs, src, 14, ops, handoff_timeout_s=0.3)
    ids, out = _defer_one(tabs, rr, src, 12, 9, job)
    assert src.entered.wait(10)
    stuck = rr._worker
    t0 = time.monotonic()
    assert rr.join(ops.event()) is True and rr.last_join_deferred
    assert time.monotonic() - t0 < 0.2
    assert _until(lambda: rr._flag.released(1), 10)
    assert 0.25 < time.monotonic() - t0 < 5  # the hand-off bound, then served
    assert _exact(tabs, rr, ids, out) and rr.counters["handoff_timeouts"] == 1 and stuck.retired
    assert rr.counters["watchdog_served"] == 1 and rr.counters["refused_inline"] == 1
    writes = list(rr._flag.writes)
    # the next step starts before the hung call returns: settled, a new worker, exact rows
    ids2 = _ids(tabs, rr, 4, 10)
    out2 = _poisoned(4, rr.part)
    job[2] = (ids2, out2)
    src.release.set()
    rr.lookup(torch.from_numpy(ids2), out2)
    assert _exact(tabs, rr, ids2, out2) and rr._worker is not stuck
    before = out.clone()
    stuck.thread.join(5)
    assert not stuck.thread.is_alive()
    # the late worker launched nothing and wrote no flag for the taken job
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))
    assert [w for w in rr._flag.writes if w[0] == 1] == [w for w in writes if w[0] == 1]
    assert not any(w[0] == 1 and w[1].startswith("dsv41-engram-worker") for w in rr._flag.writes)


def test_a_job_handed_off_with_an_error_is_served_and_its_error_raised_at_the_next_start(tabs, workers) -> None:
    src = Gate(tabs)
    ops = FlagOps()
    rr, job = _rows_checked(tabs, src, 1, ops)
    go = threading.Event()
    real = src.inner.lookup

    once = [RuntimeError("worker boom")]

    def failing(layer_id, rows, out=None):  # the worker's fetch fails (once) after the join was deferred
        if threading.current_thread().name.startswith("dsv41-engram-worker") and once:
            assert go.wait(10)
            raise once.pop()
        return real(layer_id, rows, out=out)

    src.inner.lookup = failing
    ids, out = _defer_one(tabs, rr, src, 10, 11, job)
    src.release.set()
    assert rr.join() is False and rr.last_join_deferred
    go.set()
    assert _until(lambda: rr._flag.released(1), 5)
    assert _exact(tabs, rr, ids, out) and rr.counters["deferred_errors"] == 1
    with pytest.raises(RuntimeError, match="worker boom"):
        rr.start(torch.from_numpy(ids), _poisoned(10, rr.part))
    ids2 = _ids(tabs, rr, 3, 12)
    out2 = _poisoned(3, rr.part)
    job[2] = (ids2, out2)
    rr.lookup(torch.from_numpy(ids2), out2)
    assert _exact(tabs, rr, ids2, out2)


def test_a_hand_off_without_its_flag_write_gets_the_flag_after_the_done_event(tabs, workers) -> None:
    src = Gate(tabs)
    src.hold_worker_only = True
    ops = FlagOps()
    ops.drop_worker_writes = True
    rr, job = _rows_checked(tabs, src, 1, ops)
    ids, out = _defer_one(tabs, rr, src, 8, 13, job)
    assert rr.join() is False and rr.last_join_deferred
    src.release.set()
    assert _until(lambda: rr._flag.released(1), 5)
    gen, who, stream, ok = rr._flag.writes[-1]
    assert gen == 1 and ok and stream == "side"
    assert ("wait_event", f"side<-{rr.done.name}") in [(w, a) for _, w, a in ops.log]
    assert rr.counters["watchdog_served"] == 0 and rr.counters["refused_inline"] == 0


def test_generations_only_grow_over_many_steps_of_both_joins(tabs, workers) -> None:
    src = Gate(tabs)
    src.hold_worker_only = True
    ops = FlagOps()
    r1, j1 = _rows_checked(tabs, src, 1, ops)
    r14, j14 = _rows_checked(tabs, src, 14, ops)
    kept = []
    for step in range(40):
        defer = step % 3 != 0
        t = 1 + (step * 7) % 40
        pairs = []
        for rr, job in ((r1, j1), (r14, j14)):
            ids = _ids(tabs, rr, t, 100 + step * 2 + rr.layer_id)
            out = _poisoned(t, rr.part)
            job[rr._gen + 1] = (ids, out)
            pairs.append((rr, ids, out))
        if defer:
            src.release.clear()
        for rr, ids, out in pairs:
            rr.start(torch.from_numpy(ids), out)
        for rr, ids, out in pairs:
            if not defer:
                assert _until(rr._ho.is_set)
            rr.join(ops.event())
            assert rr.last_join_deferred is defer
        src.release.set()
        for rr, ids, out in pairs:
            if defer:
                assert _until(lambda: rr._flag.released(rr._gen))
            kept.append((rr, ids, out))
        if step % 5 == 4:  # a later start settles; every step's rows stayed exact
            for rr, ids, out in kept:
                assert _exact(tabs, rr, ids, out)
            kept.clear()
    for rr in (r1, r14):
        gens = [w[0] for w in rr._flag.writes]
        assert gens == sorted(gens) and len(set(gens)) == len(gens) and all(w[3] for w in rr._flag.writes)
        deferred = [g for g, _ in rr._flag.waits]
        assert deferred == sorted(deferred) and set(deferred) <= set(gens)
        assert rr.counters["deferred_joins"] == len(deferred) == 26
        assert rr.counters["watchdog_served"] == 0


def test_the_knob_is_read_through_the_overlay_settings() -> None:
    # off by default: the deadlock measured on the H200 (docs/gpu.md, "The GPU-side join")
    assert S.parse({}).gpu_join is False and S.parse({"DSV41_ENGRAM_GPU_JOIN": "1"}).gpu_join is True
    assert S.parse({"DSV41_ENGRAM_GPU_JOIN": "0"}).gpu_join is False
    for bad in ("maybe", "2", "-1", "yes please"):
        with pytest.raises(ConfigError, match="^DSV41_ENGRAM_GPU_JOIN must be 0 or 1"):
            S.parse({"DSV41_ENGRAM_GPU_JOIN": bad})


def test_the_knob_can_be_switched_per_table_at_run_time(tabs, workers) -> None:
    src = Gate(tabs)
    src.hold_worker_only = True
    ops = FlagOps()
    rr = _rows(tabs, src, 1, ops=ops)
    for step, on in enumerate((True, False, True, False)):
        rr.gpu_join = on
        ids = _ids(tabs, rr, 6, 30 + step)
        out = _poisoned(6, rr.part)
        src.release.clear()
        rr.start(torch.from_numpy(ids), out)
        assert src.entered.wait(10)
        src.entered.clear()
        if not on:
            threading.Timer(0.05, src.release.set).start()
        rr.join()
        assert rr.last_join_deferred is on
        src.release.set()
        if rr._pending is not None:
            GJ.settle(rr)
        assert _exact(tabs, rr, ids, out)


@pytest.mark.skipif(native._fastrow is None, reason="the C++ extension is not built")
def test_the_stream_memory_ops_are_optional_in_cpp() -> None:
    """No CUDA driver here: ``stream_mem_ops`` False, the flag wait not queued (0: the caller
    joins on the host), the flag write refused, nothing written; ``take`` is atomic with the
    hand-off and a stale or taken generation counts as abandoned."""
    f = native._fastrow
    assert f.stream_mem_ops(0) is False
    s = f.EngramSlot(3)
    s.set_flag(0x1000)  # a flag, but no entry point to write or wait on it
    s.set_release_event(0)
    assert s.flag_wait(0, 1, 0) == 0 and s.flag_write(0, 1) is False and s.flag_written() == 0
    gen, enter, seen, queued, gil = s.wait_times()
    assert gen == 1 and 0 < enter <= seen <= queued <= gil
    s.begin(2)
    assert s.handoff(2) and not s.take(2)  # handed off: nothing to take
    s.begin(3)
    assert s.take(3) and s.is_abandoned(3) and not s.handoff(3)
    s.begin(4)
    assert s.is_abandoned(3) and not s.is_abandoned(4)  # 3 is stale now
    rows = types.SimpleNamespace(_slot=types.SimpleNamespace(native=s), device=torch.device("cpu"), ops=None)
    assert GJ.DeviceFlag.for_rows(rows) is None  # no driver: the host join
    assert GJ.DeviceFlag.for_rows(types.SimpleNamespace(_slot=None)) is None
