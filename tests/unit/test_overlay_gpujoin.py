"""The GPU-side join on the CPU (python/dsv41/overlay/engram_gpujoin.py): the
C++ core's part of a GPU-joined job, with plain host memory standing in for the host-mapped words
and the test writing the ids word where the GPU would. A job is fetched on the lent connection
and each piece's flag stored once its rows are in; without a connection, or after a failed
request, the rows come from the exact local shard (C++ memcpy gather) and the flags are still
stored; the watchdog serves a job nobody claimed and the worker then drops it; exactly one of
the two serves each job. Also the switch: settings, its refusals, where it turns itself off.
(The GPU's side, gj_queue's stream waits and graphs: tests/gpu/memop_release_probe.py hostflag
and tests/gpu/vllm_overlay_step_bench.py --gpu-join 1.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dsv41.engram import reader
from dsv41.engram.client import RemoteRowSource
from dsv41.envs import ConfigError
from dsv41.overlay import core as overlay_core, engram_gpujoin as GJ, engram_ops as O, settings as S
from dsv41.transport import native
from overlayutil import (
    free_port as _free_port,
    remote_rows as _rows,
    serve_tables as _serve,
    tabs,  # noqa: F401 - a pytest fixture, injected by its name
)

needs_core = pytest.mark.skipif(
    overlay_core._core is None or native._fastrow is None, reason="the C++ extensions are not built"
)

PIECE, TAIL, HEAD, CHUNK = 100, (30, 10), 30, 64  # 600 rows: pieces 5 x 100, then 70, 20 and 10 (two tails)
LAYER, TP, RANK = 14, 2, 0


def _source(tabs_, port: int) -> RemoteRowSource:
    manifest, d, _ = tabs_
    return RemoteRowSource(
        f"tcp://127.0.0.1:{port}", manifest, 0, 1, timeout_ms=500, local=reader.LocalRowReader(manifest, d)
    )


def _layout(rows: int) -> list[tuple[int, int]]:
    keys = [(r0, min(PIECE, rows - r0)) for r0 in range(0, rows, PIECE)]
    for t in TAIL if len(keys) > 1 else ():
        if keys[-1][1] > t:
            r0, m = keys.pop()
            keys += [(r0, m - t), (r0 + m - t, t)]
    return keys


class Table:
    """One table's C++ slot with the host buffers the core plans and fetches into (int64 ids
    ``[max_rows]``, uint8 selectors + packed rows ``[max_rows * 268]``, int64 fetch list), its
    identity and rank range from the source, the exact local shard, and plain host memory as the
    GPU-join words (``gj_test_words``)."""

    def __init__(self, tabs_, src, key: int, max_rows: int = 1024) -> None:
        layout = tabs_[2]
        li = layout.layer_index(LAYER)
        self.lo, self.hi = layout.row_range(li, TP, RANK)
        self.table_rows = layout.rows[li]
        self.max_rows = max_rows
        self.ids = np.zeros(max_rows, np.int64)
        self.hb = np.zeros(max_rows * (4 + O.ROW_BYTES), np.uint8)
        self.fetch = np.zeros(max_rows, np.int64)
        self.slot = overlay_core._core.EngramSlot(key)
        self.slot.set_buffers(self.ids.ctypes.data, self.hb.ctypes.data, self.fetch.ctypes.data, max_rows)
        ident, nrows = src._tabs[LAYER]
        self.slot.set_table(self.lo, self.hi, ident, nrows)
        self.slot.set_local(*GJ.local_table(src, LAYER))
        self.slot.gj_test_words()
        self.reader = src.local.reader

    def draw(self, rows: int, seed: int) -> None:
        """The job's ids (as the GPU's D2H copy would leave them): own rows, other ranks', -1."""
        rng = np.random.default_rng(seed)
        ids = rng.integers(self.lo, self.hi, size=rows)
        u = rng.random(rows)
        ids[u < 0.1] = -1
        other = (u > 0.8) & (u <= 0.9)
        ids[other] = rng.integers(0, self.table_rows, size=int(other.sum()))
        self.ids[:rows] = ids

    def exact(self, rows: int) -> bool:
        """Every piece's selectors and packed rows in the fixed piece layout are the plan's and
        the local reader's (bit for bit)."""
        sel = self.hb[: self.max_rows * 4].view(np.int32)
        base = self.max_rows * 4
        for r0, m in _layout(rows):
            v = self.ids[r0 : r0 + m]
            own = (v >= self.lo) & (v < self.hi)
            want_sel = np.where(own, np.cumsum(own) - 1, -1).astype(np.int32)
            if not np.array_equal(sel[r0 : r0 + m], want_sel):
                return False
            n = int(own.sum())
            if not np.array_equal(self.fetch[r0 : r0 + n], v[own]):
                return False
            got = self.hb[base + r0 * O.ROW_BYTES : base + (r0 + n) * O.ROW_BYTES].reshape(n, O.ROW_BYTES)
            if n and not np.array_equal(got, self.reader.read(LAYER, v[own])):
                return False
        return True

    def flags(self, rows: int) -> list[int]:
        return list(self.slot.gj_flags(len(_layout(rows))))

    def wait_flags(self, rows: int, gen: int, timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if all(f >= gen for f in self.flags(rows)):
                return True
            time.sleep(0.001)
        return False


def _core():
    return overlay_core._core.EngramCore(CHUNK, PIECE, 60.0, HEAD, TAIL)


def _submit(core, t: Table, gen: int, rows: int, bound_s: float = 30.0) -> None:
    t.slot.begin(gen)
    assert core.submit_gj(t.slot, gen, rows, 0, 0, 0, PIECE, TAIL, bound_s, 1, queue=False) == 1


class Worker:
    """``core.next()`` on a thread of its own (the GIL released inside); ``stop()`` retires it."""

    def __init__(self, core) -> None:
        self.core, self.got = core, []
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        while True:
            r = self.core.next()
            self.got.append(r)
            if r[0] == O.CORE_RETIRED:
                return

    def stop(self) -> None:
        self.core.retire()
        self.th.join(10)
        assert not self.th.is_alive()


@pytest.fixture
def server(tabs):
    port = _free_port()
    srv = _serve(tabs, port)
    src = _source(tabs, port)
    yield srv, src
    src.close()
    srv.stop()


@needs_core
def test_a_job_is_fetched_and_each_piece_released_once_its_rows_are_in(tabs, server) -> None:
    """With a lent connection: nothing is stored before the ids word holds the job (the worker
    waits for the GPU's write), then every piece's flag holds the job's generation and its rows
    are the exact ones; no fallback; a second job on the same slot as well (flags only grow)."""
    _, src = server
    t = Table(tabs, src, 1)
    core = _core()
    lease = src.native_lease()
    assert lease is not None
    core.lend(lease["fd"], lease["gen"], lease["version"], lease["timeout_ns"], lease["spin_ns"])
    w = Worker(core)
    try:
        for gen, seed in ((1, 5), (2, 6)):
            t.draw(600, seed)
            _submit(core, t, gen, 600)
            time.sleep(0.03)
            assert all(f < gen for f in t.flags(600))  # the ids word is not written yet
            t.slot.gj_write_ids(gen)
            assert t.wait_flags(600, gen)
            assert t.slot.gj_done() == gen and t.exact(600)
        c = dict(t.slot.gj_counters())
        assert c["gj_jobs"] == 2 and c["gj_fallback_jobs"] == 0 and c["gj_takeovers"] == 0 and c["gj_bad_pieces"] == 0
        n = core.counters()
        assert n["native_gj_jobs"] == 2 and n["native_gj_nolease"] == 0 and n["native_requests"] >= 2 * 7
    finally:
        w.stop()
        lease["client"].close()
    assert [g[0] for g in w.got] == [O.CORE_RETIRED]  # served in C++: nothing handed back to Python


@needs_core
def test_without_a_connection_the_rows_come_from_the_local_shard_exactly(tabs, server) -> None:
    """No lent connection (a dead server, no lease yet): the core fills every piece from the exact
    local rows in C++ and stores the flags; counted as a fallback of the job and of the source.
    Nothing is handed back to Python (issue 47: no Python hop per job while the server is dead);
    a connection offered from another thread (the worker's lease probe) is adopted before the
    next job, which is then served remotely in C++."""
    _, src = server
    t = Table(tabs, src, 2)
    core = _core()
    w = Worker(core)
    lease, owned = None, 0
    try:
        for gen, seed in ((1, 11), (2, 12)):
            t.draw(600, seed)
            owned += int(((t.ids[:600] >= t.lo) & (t.ids[:600] < t.hi)).sum())
            _submit(core, t, gen, 600)
            t.slot.gj_write_ids(gen)
            assert t.wait_flags(600, gen) and t.exact(600)
        time.sleep(0.05)
        assert w.got == []  # the core stays in C++: no hand-back per job
        c = dict(t.slot.gj_counters())
        assert c["gj_fallback_jobs"] == 2 and c["gj_fallback_rows"] == owned
        assert core.counters()["native_gj_nolease"] == 2 and core.source_counters()["fallbacks"] == 2
        lease = src.native_lease()  # what the worker's lease probe does, on its own thread
        assert not core.connected()
        core.offer(lease["fd"], lease["gen"], lease["version"], lease["timeout_ns"], lease["spin_ns"])
        assert core.connected() and not core.lent()
        t.draw(600, 13)
        _submit(core, t, 3, 600)
        t.slot.gj_write_ids(3)
        assert t.wait_flags(600, 3) and t.exact(600)
        time.sleep(0.05)
        assert w.got == [] and core.counters()["native_gj_nolease"] == 2  # remote, in C++
        assert core.lent() and core.counters()["native_offers_adopted"] == 1
        assert dict(t.slot.gj_counters())["gj_fallback_jobs"] == 2
    finally:
        w.stop()
        if lease is not None:
            lease["client"].close()


@needs_core
def test_a_failed_request_fills_the_rest_locally_and_hands_the_failure_to_python(tabs, server) -> None:
    """The server goes away with the connection lent: the job's request fails, every piece not
    released yet is filled from the local rows and released, and the core hands GJ_FAILED (with
    the failure's code) back so Python closes the connection and counts it; rows exact."""
    srv, src = server
    t = Table(tabs, src, 3)
    core = _core()
    lease = src.native_lease()
    core.lend(lease["fd"], lease["gen"], lease["version"], lease["timeout_ns"], lease["spin_ns"])
    srv.stop()
    w = Worker(core)
    try:
        t.draw(600, 21)
        _submit(core, t, 1, 600)
        t.slot.gj_write_ids(1)
        assert t.wait_flags(600, 1) and t.exact(600)
        end = time.monotonic() + 10
        while not w.got and time.monotonic() < end:
            time.sleep(0.001)
        status, jobs, code, _ = w.got[0]
        assert status == O.CORE_GJ_FAILED and code != 0 and jobs == [(3, 1, jobs[0][2])]
        assert not core.lent() and core.counters()["native_gj_failed_requests"] == 1
        assert dict(t.slot.gj_counters())["gj_fallback_jobs"] == 1
    finally:
        w.stop()
        lease["client"].close()


@needs_core
def test_the_watchdog_serves_an_unclaimed_job_and_the_worker_then_drops_it(tabs, server) -> None:
    """No worker takes the job (dead, retired or busy): once the GPU wrote its ids word and the
    bound passed, the watchdog claims it, fills it exactly from the local rows and releases it; a
    worker that dequeues it later drops it (it loses the claim): served once."""
    _, src = server
    t = Table(tabs, src, 4)
    core = _core()
    t.draw(600, 31)
    _submit(core, t, 1, 600, bound_s=0.05)
    t0 = time.monotonic()
    t.slot.gj_write_ids(1)
    assert t.wait_flags(600, 1) and t.exact(600)
    assert time.monotonic() - t0 >= 0.04  # not before the bound
    c = dict(t.slot.gj_counters())
    assert c["gj_takeovers"] == 1 and c["gj_fallback_jobs"] == 1 and c["gj_jobs"] == 1
    w = Worker(core)
    time.sleep(0.05)
    w.stop()
    assert core.counters()["native_gj_jobs"] == 0  # dropped: the watchdog had it
    assert dict(t.slot.gj_counters())["gj_jobs"] == 1


@needs_core
def test_the_watchdog_serves_the_jobs_a_retired_worker_left_queued(tabs, server) -> None:
    """A retired core never serves the jobs still in its queue: the watchdog does, exactly."""
    _, src = server
    t = Table(tabs, src, 5)
    core = _core()
    core.retire()
    t.draw(600, 41)
    _submit(core, t, 1, 600, bound_s=0.0)
    t.slot.gj_write_ids(1)
    assert t.wait_flags(600, 1) and t.exact(600)
    assert dict(t.slot.gj_counters())["gj_takeovers"] == 1


@needs_core
def test_a_claimed_job_is_never_taken_over(tabs, server) -> None:
    """The worker claims a job when it dequeues it, before its ids word: the watchdog, with a
    zero bound, finds it claimed and leaves it (no takeover), the worker serves it."""
    _, src = server
    t = Table(tabs, src, 6)
    core = _core()
    w = Worker(core)
    try:
        t.draw(600, 51)
        _submit(core, t, 1, 600, bound_s=0.0)
        time.sleep(0.05)  # the worker dequeued and claimed it, and polls the ids word
        t.slot.gj_write_ids(1)
        assert t.wait_flags(600, 1) and t.exact(600)
        time.sleep(0.01)
        c = dict(t.slot.gj_counters())
        assert c["gj_takeovers"] == 0 and c["gj_jobs"] == 1 and core.counters()["native_gj_jobs"] == 1
    finally:
        w.stop()


@needs_core
def test_each_job_is_served_by_exactly_one_of_worker_and_watchdog(tabs, server) -> None:
    """Jobs submitted with a zero bound while the ids word is already written race the worker's
    claim against the watchdog's: every job is served exactly once (their counts add up), every
    row exact, and the worker never blocks behind a job the watchdog took."""
    _, src = server
    t = Table(tabs, src, 7)
    core = _core()
    w = Worker(core)
    try:
        for gen in range(1, 31):
            t.draw(600, 100 + gen)
            t.slot.gj_write_ids(gen)  # the GPU is ahead: the job is claimable at once by either
            _submit(core, t, gen, 600, bound_s=0.0)
            assert t.wait_flags(600, gen) and t.exact(600), gen
            end = time.monotonic() + 5
            while dict(t.slot.gj_counters())["gj_jobs"] < gen and time.monotonic() < end:
                time.sleep(0.0005)
        c = dict(t.slot.gj_counters())
        assert c["gj_jobs"] == 30
        assert core.counters()["native_gj_jobs"] + c["gj_takeovers"] == 30
    finally:
        w.stop()


@needs_core
def test_a_job_that_cannot_be_queued_is_refused_before_anything_is_queued(tabs, server) -> None:
    """submit_gj checks first: a slot without words or local rows, a job larger than the staging,
    or (with queue=True) no GPU side to queue (no CUDA here) gives 0 and leaves the core's queue
    empty, so the caller serves the job on the host path and nothing waits on a flag."""
    _, src = server
    t = Table(tabs, src, 8)
    core = _core()
    assert core.submit_gj(t.slot, 1, t.max_rows + 1, 0, 0, 0, PIECE, TAIL, 1.0, 1, queue=False) == 0
    assert core.submit_gj(t.slot, 1, 600, 0, 0, 0, PIECE, TAIL, 1.0, 1) == 0  # gj_queue: no stream, no driver
    bare = overlay_core._core.EngramSlot(10)
    assert core.submit_gj(bare, 1, 600, 0, 0, 0, PIECE, TAIL, 1.0, 1, queue=False) == 0
    w = Worker(core)
    time.sleep(0.02)
    w.stop()
    assert core.counters()["native_gj_jobs"] == 0 and [g[0] for g in w.got] == [O.CORE_RETIRED]


@needs_core
def test_set_local_refuses_a_shard_shorter_than_its_table(tmp_path) -> None:
    p = tmp_path / "short.bin"
    p.write_bytes(b"\0" * 1000)
    s = overlay_core._core.EngramSlot(9)
    with pytest.raises(RuntimeError, match="shorter than its table"):
        s.set_local(str(p), 0, 512, 10)
    with pytest.raises(RuntimeError, match="cannot open"):
        s.set_local(str(tmp_path / "missing.bin"), 0, 0, 1)
    assert not s.gj_ready()


def test_local_table_names_the_shard_and_refuses_what_cpp_cannot_serve_exactly(tabs, server) -> None:
    _, src = server
    path, wo, so, rows = GJ.local_table(src, LAYER)
    entry = src.local.reader.tables[LAYER]
    assert path.endswith(entry.file) and (wo, so, rows) == (entry.weight_offset, entry.scale_offset, entry.rows)
    assert GJ.local_table(src, 999) is None
    assert GJ.local_table(SimpleNamespace(local=None), LAYER) is None
    assert GJ.local_table(SimpleNamespace(local=src.local, fault_delay_s=0.01), LAYER) is None
    assert (
        GJ.local_table(SimpleNamespace(local=SimpleNamespace(reader=src.local.reader, fault_delay_s=0.5)), LAYER)
        is None
    )


def _fake_rows(src, **kw):
    base = dict(
        required=False,
        _slot=SimpleNamespace(native=object()),
        _cuda=True,
        ops=SimpleNamespace(graphs=True),
        device=SimpleNamespace(index=0),
        source=src,
        layer_id=LAYER,
        counters={},
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_the_gpu_join_is_used_only_where_it_can_be_exact(tabs, server, monkeypatch) -> None:
    """Off unless switched on; never in required mode (the cause must be raised at that step's
    join); not without CUDA, the C++ slot, the driver's v2 stream memory operations or the exact
    local rows."""
    _, src = server
    monkeypatch.setattr(GJ, "available", lambda index: True)
    assert isinstance(GJ.GpuJoin.for_rows(_fake_rows(src), True), GJ.GpuJoin)
    assert GJ.GpuJoin.for_rows(_fake_rows(src), False) is None
    assert GJ.GpuJoin.for_rows(_fake_rows(src, required=True), True) is None
    assert GJ.GpuJoin.for_rows(_fake_rows(src, _cuda=False), True) is None
    assert GJ.GpuJoin.for_rows(_fake_rows(src, _slot=None), True) is None
    assert GJ.GpuJoin.for_rows(_fake_rows(SimpleNamespace(local=None)), True) is None
    monkeypatch.setattr(GJ, "available", lambda index: False)
    assert GJ.GpuJoin.for_rows(_fake_rows(src), True) is None


def test_a_cpu_table_with_the_switch_on_joins_on_the_host_exactly(tabs, server) -> None:
    """RemoteRows on the CPU with gpu_join=True: no GPU-side join (no CUDA), lookups exact."""
    import torch

    from dsv41.overlay import engram as E
    from overlayutil import exact_rows, lookup_ids, poisoned

    _, src = server
    try:
        rr = _rows(tabs, src, LAYER, gpu_join=True)
        assert rr._gj is None
        ids = lookup_ids(tabs, rr, 8, 3)
        out = poisoned(8, rr.part)
        rr.lookup(torch.from_numpy(ids), out)
        assert exact_rows(tabs, rr, ids, out)
    finally:
        E.stop_workers()


def test_the_switch_parses_and_refuses_a_bad_value_with_one_clear_error() -> None:
    # on by default since the final code ran on a GPU with it on (docs/benchmarks.md)
    assert S.parse({}).gpu_join is True
    assert S.parse({"DSV41_ENGRAM_GPU_JOIN": "0"}).gpu_join is False
    assert S.parse({"DSV41_ENGRAM_GPU_JOIN": "1"}).gpu_join is True
    assert S.parse({"DSV41_ENGRAM_GPU_JOIN": "off"}).gpu_join is False
    with pytest.raises(ConfigError, match="DSV41_ENGRAM_GPU_JOIN") as e:
        S.parse({"DSV41_ENGRAM_GPU_JOIN": "maybe"})
    assert str(e.value).count("DSV41_ENGRAM_GPU_JOIN") >= 1 and "\n" not in str(e.value)


@needs_core
def test_stream_memory_ops_detection_is_false_without_a_usable_driver() -> None:
    """On a host without a GPU (the unit tests' CI) the detection answers False, never raises."""
    got = overlay_core._core.stream_mem_ops(0)
    assert isinstance(got, bool)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        assert got is False


class _Native:
    """The C++ slot's GPU-join calls GpuJoin makes, recorded (no CUDA)."""

    def __init__(self, ready: bool = True, waits: int = 7) -> None:
        self.ready, self.waits, self.calls = ready, waits, []
        self.done = 0

    def gj_setup(self) -> bool:
        self.calls.append("setup")
        return True

    def set_local(self, *a, **kw) -> None:
        self.calls.append(("local", a))

    def gj_ready(self) -> bool:
        return self.ready

    def gj_stream_waits(self, stream, event, event2) -> int:
        self.calls.append(("waits", stream, event, event2))
        return self.waits

    def gj_done(self) -> int:
        return self.done

    def gj_counters(self) -> dict:
        return {"gj_jobs": 0}


class _Ops:
    graphs = True

    def __init__(self) -> None:
        self.cur = SimpleNamespace(name="cur", waited=[], wait_event=lambda ev: self.cur.waited.append(ev))

    def current_stream(self):
        return self.cur

    def stream_handle(self, s) -> int:
        return 11

    def event_handle(self, e) -> int:
        return 22 if e == "done" else 33


def _glue(src, native_, q: int):
    rows = _fake_rows(src, _slot=SimpleNamespace(native=native_), ops=_Ops(), done="done")
    sent = []

    class W:
        core = SimpleNamespace(submit_gj=True)

        def submit_gj(self, r, gen, bound_s):
            sent.append((gen, bound_s))
            return q

    return rows, W(), sent


def test_start_and_join_glue_queue_once_and_never_wait_on_the_host(tabs, server, monkeypatch) -> None:
    """GpuJoin.start sets the table up once (words, local shard, watchdog), hands the job to the
    core's submit_gj (which queues the GPU side) and counts it; 0 from the core is "not queued"
    (the host path serves the job); join queues the current stream's waits on the done event and
    vLLM's event and returns whether the latter was queued: no host wait."""
    _, src = server
    monkeypatch.setattr(overlay_core._core, "gj_watch_start", lambda: True, raising=False)
    nat = _Native()
    rows, w, sent = _glue(src, nat, 1)
    gj = GJ.GpuJoin(rows)
    assert gj.start(w, 5) and sent == [(5, GJ.WATCHDOG_S)] and rows.counters["gpu_joins"] == 1
    assert nat.calls[0] == "setup" and nat.calls[1][0] == "local"
    assert gj.join("vllm-event") is True and nat.calls[-1] == ("waits", 11, 22, 33)
    assert gj.start(w, 6) and nat.calls.count("setup") == 1  # set up once
    nat.waits = 1 | 2
    assert gj.join() is False and nat.calls[-1] == ("waits", 11, 22, 0)
    rows0, w0, _ = _glue(src, _Native(), 0)
    g0 = GJ.GpuJoin(rows0)
    assert not g0.start(w0, 1) and rows0.counters["gpu_joins"] == 0
    nr, wr, sr = _glue(src, _Native(ready=False), 1)
    assert not GJ.GpuJoin(nr).start(wr, 1) and sr == []  # a slot not ready is never handed over


def test_a_partly_queued_job_is_served_again_on_the_host_after_the_core_released_it(tabs, server, monkeypatch) -> None:
    """The core answered -1 (a driver call failed part way): join waits for the core's release
    (gj_done), synchronizes the job's stream, serves the job again on the host and makes the
    current stream wait on its done event; the GPU-side join is off for the table from then on."""
    _, src = server
    monkeypatch.setattr(overlay_core._core, "gj_watch_start", lambda: True, raising=False)
    nat = _Native()
    rows, w, _ = _glue(src, nat, -1)
    served = []
    rows._stream = SimpleNamespace(synchronize=lambda: served.append("sync"))
    rows._serve_inline = lambda: served.append("inline")
    gj = GJ.GpuJoin(rows)
    assert gj.start(w, 3) and rows.counters["gpu_join_redos"] == 1
    nat.done = 3
    assert gj.join() is False and served == ["sync", "inline"] and rows.ops.cur.waited == ["done"]
    assert not gj.start(w, 4)  # off for this table
