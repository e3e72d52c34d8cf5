"""The overlay's worker pipeline (issue 23) on the CPU: the launching thread hands each Engram
layer's lookup to a per-rank worker and joins it at the layer; both layers of a step in one
request, the bounded hand-off, refusals and fallbacks, the native plan and the per-size launch
graphs (emulated: ``Recorder``). Rows are compared bit for bit with the exact reference."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from dsv41.engram import reader
from dsv41.engram.client import RemoteRowSource, RemoteUnavailable
from dsv41.overlay import core as overlay_core, engram as E, engram_ops as O, engram_rows as ER, engram_worker as EW
from dsv41.transport import native
from overlayutil import (  # noqa: F401 - tabs is a fixture
    Gate,
    StepOps,
    exact_rows as _exact,
    kernel_on_cpu,
    lookup_ids as _ids,
    poisoned as _poisoned,
    reference,
    remote_rows as _rows,
    same_bits,
    tabs,
)

# ------------------------------------------------- the worker pipeline (issue 23), on the CPU


@pytest.fixture
def workers():
    yield
    E.stop_workers()


def test_start_returns_before_the_fetch_and_join_waits_for_the_hand_off(tabs, workers) -> None:
    src = Gate(tabs)
    rr = _rows(tabs, src, 1)
    ids = _ids(tabs, rr, 24, 1)
    out = _poisoned(24, rr.part)
    src.release.clear()
    t0 = time.monotonic()
    rr.start(torch.from_numpy(ids), out)
    assert time.monotonic() - t0 < 0.5 and src.entered.wait(5)  # the worker is inside the fetch
    assert torch.isnan(out.float()).all()  # nothing written yet: the launching thread did not wait
    assert all(name.startswith("dsv41-engram-worker") for _, _, name in src.calls)
    __import__("threading").Timer(0.2, src.release.set).start()
    rr.join()
    assert _exact(tabs, rr, ids, out)
    c = rr.overlay_counters()
    assert c["layer1_handoffs"] == 1 and c["layer1_worker_starts"] == 1 and c["layer1_worker_refusals"] == 0
    rr.join()  # a second join of the same step is a no-op


def test_both_layers_of_a_step_go_in_one_request_and_the_launching_thread_never_syncs(tabs, workers) -> None:
    src = Gate(tabs)
    ops = StepOps()
    r1, r14 = _rows(tabs, src, 1, ops=ops), _rows(tabs, src, 14, ops=ops)
    main = __import__("threading").current_thread().name
    for step, t in enumerate((24, 7, 48)):  # T changes between steps
        ids1, ids14 = _ids(tabs, r1, t, 10 + step), _ids(tabs, r14, t, 20 + step)
        o1, o14 = _poisoned(t, r1.part), _poisoned(t, r14.part)
        ops.go.clear()  # the ids are not down yet when the worker takes the first job
        ops.current = ops.prefetch  # vLLM's _start_prefetch runs under its prefetch stream
        r1.start(torch.from_numpy(ids1), o1)
        r14.start(torch.from_numpy(ids14), o14)
        ops.go.set()
        ops.current = ops.main  # _finish_prefetch on the main stream
        r1.join()
        r14.join()
        assert _exact(tabs, r1, ids1, o1) and _exact(tabs, r14, ids14, o14)
    assert [c[:2] for c in src.calls] == [("lookup_layers", (1, 14))] * 3  # one request per step
    mine = [(w, a) for n, w, a in ops.log if n == main]
    assert all(w in ("record", "wait_event") for w, _ in mine), mine  # no host wait on any stream or event
    ev1_ids, ev1_done = r1.ids_ready.name, r1.done.name
    assert ("record", f"{ev1_ids}@prefetch") in mine and ("wait_event", f"main<-{ev1_done}") in mine
    theirs = [(w, a) for n, w, a in ops.log if n != main]
    assert ("synchronize", ev1_ids) in theirs and ("record", f"{ev1_done}@prefetch") in theirs
    assert ("bind_thread", "") in theirs and not any(w == "stream_synchronize" for w, _ in theirs)
    assert r1._worker is r14._worker and r1._worker.counters["multi_layer_requests"] == 3


def test_a_prefill_chunk_hands_layer_1_off_before_layer_14_is_fetched(tabs, workers, monkeypatch) -> None:
    src = Gate(tabs)
    ops = StepOps()
    r1, r14 = _rows(tabs, src, 1, ops=ops), _rows(tabs, src, 14, ops=ops)
    monkeypatch.setattr("dsv41.engram.client.CHUNK_ROWS", 100)  # 2 x 60 x 12 rows: over one request
    ids1, ids14 = _ids(tabs, r1, 60, 1), _ids(tabs, r14, 60, 2)
    o1, o14 = _poisoned(60, r1.part), _poisoned(60, r14.part)
    ops.go.clear()
    r1.start(torch.from_numpy(ids1), o1)
    r14.start(torch.from_numpy(ids14), o14)
    calls = src.calls

    real = src.inner.lookup

    def slow14(layer_id, rows, out=None):
        if layer_id == 14:
            assert r1._handed.is_set()  # layer 1 was handed off before layer 14's fetch began
        return real(layer_id, rows, out=out)

    src.inner.lookup = slow14
    ops.go.set()
    r1.join()
    r14.join()
    assert [c[:2] for c in calls] == [("lookup", (1,)), ("lookup", (14,))]
    assert _exact(tabs, r1, ids1, o1) and _exact(tabs, r14, ids14, o14)


def test_inside_a_graph_capture_the_lookup_runs_on_the_launching_thread(tabs, workers) -> None:
    src = Gate(tabs)
    ops = StepOps()
    ops.capture = True
    rr = _rows(tabs, src, 14, ops=ops)
    ids = _ids(tabs, rr, 5, 3)
    out = _poisoned(5, rr.part)
    rr.start(torch.from_numpy(ids), out)
    assert _exact(tabs, rr, ids, out)  # done before start returned
    rr.join()
    main = __import__("threading").current_thread().name
    assert rr._worker is None and all(name == main for _, _, name in src.calls)
    assert rr.counters["inline_lookups"] == 1


@pytest.mark.parametrize("required", [False, True])
def test_a_failing_fetch_raises_on_the_launching_thread_in_required_mode(tabs, workers, required: bool) -> None:
    manifest, d, layout = tabs
    # nothing listens on port 1: the worker's fetch fails; exact local rows, or the required refusal
    src = RemoteRowSource(
        "tcp://127.0.0.1:1", manifest, 0, 1, timeout_ms=50, required=False, local=reader.LocalRowReader(manifest, d)
    )
    src.required = required  # after construction, which refuses an unreachable server when required
    try:
        r1, r14 = _rows(tabs, src, 1, tp=1), _rows(tabs, src, 14, tp=1)
        ids1, ids14 = _ids(tabs, r1, 8, 5), _ids(tabs, r14, 8, 6)
        o1, o14 = _poisoned(8, 24), _poisoned(8, 24)
        r1.start(torch.from_numpy(ids1), o1)
        r14.start(torch.from_numpy(ids14), o14)
        if required:
            with pytest.raises(RemoteUnavailable, match="required but failed"):
                r1.join()
            with pytest.raises(RemoteUnavailable, match="required but failed"):
                r14.join()
            return
        r1.join()
        r14.join()
        assert _exact(tabs, r1, ids1, o1) and _exact(tabs, r14, ids14, o14)
        assert src.counters()["fallbacks"] >= 1 and src.counters()["remote_rows"] == 0
    finally:
        src.close()


class _Die(BaseException):
    """Kills the worker thread (no ``except Exception`` catches it)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("required", [False, True])
def test_a_dead_worker_is_a_counted_refusal_never_a_hang(tabs, workers, required: bool) -> None:
    src = Gate(tabs, required=required)
    rr = _rows(tabs, src, 1)
    ids = _ids(tabs, rr, 16, 7)
    out = _poisoned(16, rr.part)
    src.fail = _Die()
    rr.start(torch.from_numpy(ids), out)
    t0 = time.monotonic()
    if required:
        with pytest.raises(E.OverlayRefused, match="worker thread died.*REQUIRED=1"):
            rr.join()
    else:
        rr.join()
        assert _exact(tabs, rr, ids, out)  # served on the launching thread, exactly
    assert time.monotonic() - t0 < 5  # ALIVE_POLL_S, not HANDOFF_TIMEOUT_S
    assert rr.counters["worker_refusals"] == 1 and rr.counters["handoff_timeouts"] == 0
    ids2 = _ids(tabs, rr, 9, 8)  # the next step gets a new worker
    out2 = _poisoned(9, rr.part)
    rr.lookup(torch.from_numpy(ids2), out2)
    assert _exact(tabs, rr, ids2, out2) and rr.counters["worker_starts"] == 2


@pytest.mark.parametrize("required", [False, True])
def test_a_hung_worker_is_refused_after_the_bounded_wait_and_writes_nothing_later(
    tabs, workers, required: bool
) -> None:
    src = Gate(tabs, required=required)
    src.hold_worker_only = True
    rr = _rows(tabs, src, 14, handoff_timeout_s=0.3)
    ids = _ids(tabs, rr, 12, 9)
    out = _poisoned(12, rr.part)
    src.release.clear()  # the worker's fetch hangs
    rr.start(torch.from_numpy(ids), out)
    stuck = rr._worker
    t0 = time.monotonic()
    if required:
        with pytest.raises(E.OverlayRefused, match="handed nothing off within 0.3 s"):
            rr.join()
        out.fill_(float("nan"))
    else:
        rr.join()
        assert _exact(tabs, rr, ids, out)
    assert 0.25 < time.monotonic() - t0 < 5
    assert rr.counters["handoff_timeouts"] == 1 and stuck.retired
    before = out.clone()
    src.release.set()  # the hung call returns: the abandoned job launches nothing, hands nothing off
    stuck.thread.join(5)
    assert not stuck.thread.is_alive()
    assert torch.equal(out.view(torch.int16), before.view(torch.int16)) and not rr._handed.is_set()
    ids2 = _ids(tabs, rr, 4, 10)
    out2 = _poisoned(4, rr.part)
    rr.lookup(torch.from_numpy(ids2), out2)
    assert _exact(tabs, rr, ids2, out2) and rr._worker is not stuck


def test_a_start_without_its_finish_joins_the_previous_step_first(tabs, workers) -> None:
    src = Gate(tabs)
    rr = _rows(tabs, src, 1)
    a, b = _ids(tabs, rr, 30, 11), _ids(tabs, rr, 3, 12)
    oa, ob = _poisoned(30, rr.part), _poisoned(3, rr.part)
    rr.start(torch.from_numpy(a), oa)
    rr.start(torch.from_numpy(b), ob)  # e.g. a profile run that never reached the Engram layer
    rr.join()
    assert _exact(tabs, rr, a, oa) and _exact(tabs, rr, b, ob)


def test_the_plan_is_vectorised_into_the_callers_buffers(tabs) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(-3, 50, 1000).astype(np.int64)
    sel, fetch = np.empty(1000, np.int32), np.empty(1000, np.int64)
    own, tmp = np.empty(1000, bool), np.empty(1000, bool)
    n = O.plan_into_numpy(ids, 10, 40, sel, fetch, own, tmp)
    want = [i for i in ids if 10 <= i < 40]
    assert n == len(want) and fetch[:n].tolist() == want
    k = 0
    for i, s in zip(ids, sel, strict=False):
        if 10 <= i < 40:
            assert s == k
            k += 1
        else:
            assert s == -1
    assert O.plan_into_numpy(ids[:0], 10, 40, sel[:0], fetch, own[:0], tmp[:0]) == 0


def test_a_large_lookup_goes_piece_by_piece_exactly(tabs, workers, monkeypatch) -> None:
    """Pieces of PIECE_ROWS rows (plan, fetch, H2D, kernel each; the done event after the last):
    rows exact across every piece boundary, one fetch per piece with owned rows."""
    monkeypatch.setattr(ER, "PIECE_ROWS", 50)
    src = Gate(tabs)
    ops = StepOps()
    rr = _rows(tabs, src, 14, ops=ops)
    ids = _ids(tabs, rr, 60, 13)  # 720 rows: 15 pieces
    out = _poisoned(60, rr.part)
    rr.lookup(torch.from_numpy(ids), out)
    assert _exact(tabs, rr, ids, out)
    assert [c[:2] for c in src.calls] == [("lookup", (14,))] * 15
    done = [a for _, w, a in ops.log if w == "record" and a.startswith(rr.done.name + "@")]
    assert len(done) == 1  # one done event, after the last piece


def test_the_worker_waits_briefly_for_the_steps_other_layer(tabs, workers, monkeypatch) -> None:
    """After a step that started two layers, the worker holds the first one (at most COALESCE_S)
    for the second: one request; a step with one layer only costs that bound once, then the
    worker expects one again."""
    import threading

    monkeypatch.setattr(EW, "COALESCE_S", 5.0)
    src = Gate(tabs)
    r1, r14 = _rows(tabs, src, 1), _rows(tabs, src, 14)
    for step in range(2):
        ids1, ids14 = _ids(tabs, r1, 10, 30 + step), _ids(tabs, r14, 10, 40 + step)
        o1, o14 = _poisoned(10, r1.part), _poisoned(10, r14.part)
        r1.start(torch.from_numpy(ids1), o1)
        time.sleep(0.2)  # the worker has taken layer 1's job by now
        r14.start(torch.from_numpy(ids14), o14)
        r1.join()
        r14.join()
        assert _exact(tabs, r1, ids1, o1) and _exact(tabs, r14, ids14, o14)
    w = r1._worker
    assert w.expect == 2 and [c[:2] for c in src.calls][-1] == ("lookup_layers", (1, 14))  # step 2: one request
    assert w.counters["coalesce_waits"] >= 1
    ids = _ids(tabs, r1, 4, 50)
    out = _poisoned(4, r1.part)
    t0 = time.monotonic()
    r1.lookup(torch.from_numpy(ids), out)  # one layer, joined at once: the join ends the wait
    assert time.monotonic() - t0 < 2.5 and _exact(tabs, r1, ids, out) and w.expect == 1
    r14.lookup(torch.from_numpy(_ids(tabs, r14, 4, 51)), _poisoned(4, r14.part))
    r1.start(torch.from_numpy(ids), out)  # two layers last step, one now and no join yet:
    r14.start(torch.from_numpy(_ids(tabs, r14, 4, 52)), _poisoned(4, r14.part))
    r1.join()
    r14.join()
    assert w.expect == 2
    monkeypatch.setattr(EW, "COALESCE_S", 0.3)
    out.fill_(float("nan"))
    t0 = time.monotonic()
    r1.start(torch.from_numpy(ids), out)
    assert r1._handed.wait(5) and 0.25 < time.monotonic() - t0  # ... the bound, then alone
    r1.join()
    assert _exact(tabs, r1, ids, out) and threading.active_count() >= 1


@pytest.mark.skipif(overlay_core._core is None or native._fastrow is None, reason="the C++ extensions are not built")
def test_the_native_plan_equals_the_numpy_plan_and_refuses_a_converted_buffer() -> None:
    """``_core.plan_rows`` (no GIL) gives the numpy plan's selectors and fetch list for every
    id class (owned, -1, below and past the range) and sizes 0..N; a wrong dtype is a TypeError,
    never a plan into a temporary copy."""
    rng = np.random.default_rng(7)
    for r in (0, 1, 2, 15, 16, 17, 1000, 65536):
        ids = rng.integers(-3, 60, r).astype(np.int64)
        s1, s2 = np.full(r, 7, np.int32), np.full(r, 9, np.int32)
        f1, f2 = np.zeros(r, np.int64), np.ones(r, np.int64)
        n1 = O.plan_into_numpy(ids, 10, 40, s1, f1, np.empty(r, bool), np.empty(r, bool))
        n2 = O.plan_into(ids, 10, 40, s2, f2, None, None, overlay_core._core.plan_rows)
        assert n1 == n2 and np.array_equal(s1, s2) and np.array_equal(f1[:n1], f2[:n2])
    buf = np.empty(8, np.int32)
    for bad in (
        {"ids": np.zeros(8, np.int32)},
        {"sel": np.zeros(8, np.int64)},
        {"fetch": np.zeros(8, np.int32)},
        {"sel": np.zeros(16, np.int32)[::2]},
    ):
        args = {"ids": np.zeros(8, np.int64), "sel": buf, "fetch": np.zeros(8, np.int64), **bad}
        with pytest.raises(TypeError):
            overlay_core._core.plan_rows(args["ids"], 0, 1, args["sel"], args["fetch"])
    with pytest.raises(ValueError, match="need ids.size"):
        overlay_core._core.plan_rows(np.zeros(8, np.int64), 0, 1, np.zeros(4, np.int32), np.zeros(8, np.int64))


class Recorder:
    """``graph_record`` for the CPU: a 'graph' whose replay runs the recorded launch again (what a
    CUDA graph of it does), counting records and replays; ``fail`` makes the next record raise."""

    def __init__(self) -> None:
        self.rr = None
        self.records: list[int] = []
        self.replays = 0
        self.fail = False

    def __call__(self, rows, out):
        import threading

        # the launching thread, at the table's next start, before that job is submitted
        assert threading.current_thread() is threading.main_thread() and not self.rr._submitted
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.records.append(rows)
        rec = self

        class Graph:
            def replay(self) -> None:
                rec.replays += 1
                rec.rr._launch_one(rows, out)

        return Graph()


def test_launch_graphs_replay_per_token_count_exactly_and_a_failed_capture_stays_eager(tabs, workers) -> None:
    """One-piece worker jobs: the first job of a token count launches eagerly and its graph is
    recorded by the launching thread at the next start; later jobs of that count replay it; rows stay exact as T changes
    and as the number of owned rows changes under the same graph; a failed record disables the
    graphs (eager from then on, still exact); new host buffers drop the graphs."""
    src = Gate(tabs)
    rec = Recorder()
    rr = _rows(tabs, src, 14, ops=StepOps(), graph_record=rec)
    rec.rr = rr
    buf = _poisoned(64, rr.part)  # vLLM's staged_rows: one graph-stable buffer, out = staged_rows[:T]
    for step, t in enumerate((24, 24, 7, 24, 7, 48, 24)):
        ids = _ids(tabs, rr, t, 100 + step)
        if step == 3:
            ids[:] = -1  # nothing owned: the graph of 24 still writes zero rows exactly
        buf.fill_(float("nan"))
        rr.lookup(torch.from_numpy(ids), buf[:t])
        assert _exact(tabs, rr, ids, buf[:t]), step
    c = rr.overlay_counters()
    assert rec.records == [24 * rr.part, 7 * rr.part, 48 * rr.part]
    assert rec.replays == c["layer14_graph_replays"] == 4 and c["layer14_graph_captures"] == 3
    rr._new_host_buffers()
    rec.fail = True
    for step, t in enumerate((24, 24)):
        ids = _ids(tabs, rr, t, 200 + step)
        buf.fill_(float("nan"))
        rr.lookup(torch.from_numpy(ids), buf[:t])
        assert _exact(tabs, rr, ids, buf[:t])
    c = rr.overlay_counters()
    assert c["layer14_graph_failures"] == 1 and not rr.graphs.enabled and rec.replays == 4


def test_a_refused_graph_launch_turns_the_graphs_off_and_the_caller_launches_eagerly() -> None:
    """``cuGraphLaunch`` returning a CUDA error: ``replay`` is False (the caller's eager launch
    serves the step), the graphs are dropped and off, one failure counted; with no graph of a
    size, ``replay`` is False and ``wanted`` True."""
    out = torch.empty((4, 2, 256), dtype=torch.bfloat16)
    launched = []
    lg = O.LaunchGraphs("cpu", lambda rows, o: launched.append(rows), True, record=lambda rows, o: object())
    assert not lg.replay(8, out) and lg.wanted(8, out)
    lg._graphs[lg.key(8, out)] = (object(), 0x1234)
    calls = []
    lg._driver = lambda exec_ptr, stream: calls.append((exec_ptr, stream)) or 700  # CUDA_ERROR_LAUNCH_FAILED
    assert not lg.replay(8, out, types.SimpleNamespace(cuda_stream=99))
    assert calls == [(0x1234, 99)] and not lg.enabled and not lg._graphs and lg.counters["failures"] == 1
    assert not lg.wanted(8, out) and launched == []


def test_a_multi_piece_job_fetches_the_next_piece_while_the_worker_launches(tabs, workers, monkeypatch) -> None:
    """Piece k+1's plan and fetch (the table's fetch thread) run while the
    worker launches piece k, into disjoint staging; rows exact, and no fetch is left running."""
    import threading

    monkeypatch.setattr(ER, "PIECE_ROWS", 100)
    spans: list[tuple[str, float, float]] = []

    def slow_kernel(*a):  # the launch of a piece: slow enough that the next fetch overlaps it
        t0 = time.perf_counter()
        time.sleep(0.03)
        kernel_on_cpu(*a)
        spans.append(("launch", t0, time.perf_counter()))

    class Timed(Gate):
        def lookup(self, layer_id, rows, out=None):
            t0 = time.perf_counter()
            r = super().lookup(layer_id, rows, out)
            spans.append(("fetch:" + threading.current_thread().name, t0, time.perf_counter()))
            return r

    src = Timed(tabs)
    rr = _rows(tabs, src, 14)
    rr.dequant = slow_kernel
    ids = _ids(tabs, rr, 50, 17)  # 600 rows: 6 pieces
    out = _poisoned(50, rr.part)
    rr.lookup(torch.from_numpy(ids), out)
    assert _exact(tabs, rr, ids, out)
    fetches = [s for s in spans if s[0].startswith("fetch:")]
    launches = [s for s in spans if s[0] == "launch"]
    assert len(fetches) == 6 and len(launches) == 6
    assert all("-fetch" in name for name, _, _ in fetches)  # on the table's fetch thread
    # piece k+1's fetch began before piece k's launch ended (k = 0..4)
    assert sum(fetches[k + 1][1] < launches[k][2] for k in range(5)) >= 4


def test_a_failed_piece_fetch_is_raised_at_the_join_and_leaves_nothing_running(tabs, workers, monkeypatch) -> None:
    monkeypatch.setattr(ER, "PIECE_ROWS", 100)
    src = Gate(tabs, required=True)
    rr = _rows(tabs, src, 14)
    ids = _ids(tabs, rr, 50, 18)
    rr.lookup(torch.from_numpy(ids), _poisoned(50, rr.part))  # warm: the fetch thread exists
    calls = len(src.calls)
    src.fail = RemoteUnavailable("remote Engram down (test)")
    rr.start(torch.from_numpy(ids), _poisoned(50, rr.part))
    with pytest.raises(RemoteUnavailable, match="down"):
        rr.join()
    time.sleep(0.1)
    n_after = len(src.calls)
    time.sleep(0.2)
    assert len(src.calls) == n_after and n_after - calls <= 2  # nothing fetched after the failure
    out = _poisoned(50, rr.part)
    rr.lookup(torch.from_numpy(ids), out)  # the next job is exact
    assert _exact(tabs, rr, ids, out)
