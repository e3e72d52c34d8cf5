"""One Engram table's rank-local rows staged for vLLM's kernel (``RemoteRows``): the launching
thread's ``start``/``join`` and the per-job plan, fetch and launch the worker runs
(``dsv41.overlay.engram`` for the whole; ``engram_worker`` for the thread; ``engram_launch`` for
the launch sequences the graphs capture).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dsv41.errors import ConfigError, Dsv41Error
from dsv41.overlay.engram_launch import Launches
from dsv41.overlay.engram_ops import (
    ROW_BYTES,
    CudaOps,
    Handoff,
    HostOps,
    LaunchGraphs,
    OverlayRefused,
    _native_plan,
    log,
    plan_into,
    report_counters,
)
from dsv41.overlay.engram_worker import (
    JOIN_SPIN_NS,
    PIECE_ROWS,
    REPORT_EVERY_S,
    TAIL_ROWS,
    EngramWorker,
    _no_handle,
    _worker_for,
)
from dsv41.overlay.settings import LocalReader

#: Seconds ``_finish_prefetch`` waits for the worker's hand-off of one layer before it counts a
#: refusal and serves that layer's exact rows on the launching thread. The worker's fetch is
#: bounded by the row source's own deadline (``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``, local fallback
#: inside it), so only a hung worker (a CUDA call that never returns, a fallback read stuck on a
#: dead disk) reaches this bound; a dead worker thread is noticed within ``ALIVE_POLL_S``.
HANDOFF_TIMEOUT_S = 30.0
#: Seconds between two checks, while waiting for a hand-off, that the worker thread is alive.
ALIVE_POLL_S = 0.05


class TableSlot:
    """A table's ``_core.EngramSlot`` (the C++ core's view of it): ``key`` (the worker's map
    key), ``native`` and ``set_table(tables)`` (its identity and table rows from a lease's
    ``{layer_id: (identity, rows)}``; a layer the lease does not name stays Python's)."""

    def __init__(self, rows: RemoteRows, native: Any) -> None:
        self.rows, self.native, self.key = rows, native, id(rows)

    def set_table(self, tables: dict) -> None:
        t = tables.get(self.rows.layer_id)
        if t is not None:
            self.native.set_table(self.rows.vocab_start, self.rows.vocab_end, t[0], int(t[1]))

    def set_piece_graphs(self, graphs: list) -> None:
        """``LaunchGraphs.launchable()`` of the table's piece graphs (keys ``(r0, rows)``) to the core."""
        self.native.set_piece_graphs([(k[0], k[1], p, e) for k, p, e in graphs])

    def set_buffers(self) -> None:
        r = self.rows
        self.native.set_buffers(r._hids.ctypes.data, r._hb.ctypes.data, r._fetch.ctypes.data, r.max_rows)


class RemoteRows(Launches):
    """One Engram table's rank-local rows through a RowSource, staged for vLLM's kernel, fetched
    by the rank's ``EngramWorker`` off the launching thread.

    ``source``: RowSource with ``lookup(layer_id, rows, out=None)`` and ``lookup_layers(layer_ids,
    rows, outs=None)`` (one request per step), both filling the caller's buffers; ``layer_id``:
    model layer; ranges as in vLLM's
    ``ParallelEngramEmbedding`` (``head_start``, ``part`` = ``part_n_hash_cols``, ``n_hash_cols``,
    ``vocab_start``, ``vocab_end``); ``dim`` (256) and ``block`` (32); ``max_tokens``: largest T
    (``max_num_batched_tokens``); ``device``: where ``out`` lives; ``dequant(w, s, sel, dst, out,
    n, rows)``: the kernel launch (vLLM's ``_engram_lookup_kernel`` in SORTED mode on CUDA; tests
    pass an emulation on CPU); ``required``: a refused hand-off raises instead of serving the
    rows inline (default: the source's ``is_required()``); ``gpu_join``: join a multi-piece job
    on the GPU where it can run (``DSV41_ENGRAM_GPU_JOIN``, ``engram_gpujoin``; never in required
    mode); ``local_reader``: how the C++ core reads the exact local rows (``settings.LocalReader``;
    default: the settings' defaults); ``handoff_timeout_s``: see
    ``HANDOFF_TIMEOUT_S``; ``ops``: stream/event operations (``CudaOps``/``HostOps`` by device;
    tests pass fakes); ``graphs``: replay a one-piece job's launch as a CUDA graph per token count
    (``LaunchGraphs``; CUDA, or ``graph_record`` in tests).

    Buffers, allocated once (graph-stable; ``staged_rows`` is vLLM's): device int64 ids
    ``[max_tokens, part]`` and their pinned host copy, pinned host ``[rows*4 + rows*264]`` bytes
    (int32 row selectors + packed rows) and the same on the device, the split weight
    ``[rows, dim]`` and scale ``[rows, dim/block]`` tables the kernel reads, and host scratch
    for the plan (bool ``[rows]`` x2, int64 ``[rows]``).

    Per step: ``start`` (launching thread, inside vLLM's ``_start_prefetch`` on the prefetch
    stream) queues the ids' D2H copy + an event and hands the job to the worker; ``join``
    (launching thread, inside ``_finish_prefetch``) waits on the host for the worker's hand-off
    only, then makes the current stream wait on the layer's done event. With the GPU-side join
    (``engram_gpujoin``) a multi-piece job whose piece graphs exist is queued
    whole on the GPU at ``start`` (waits on host-mapped flags the worker stores, then each piece's
    graph), and ``join`` only makes the current stream wait on the done event.
    """

    def __init__(
        self,
        source: Any,
        layer_id: int,
        *,
        head_start: int,
        part: int,
        n_hash_cols: int,
        vocab_start: int,
        vocab_end: int,
        dim: int,
        block: int,
        max_tokens: int,
        device: Any,
        dequant: Callable[..., None],
        rank: int = 0,
        required: bool | None = None,
        handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
        ops: Any = None,
        graphs: bool = True,
        graph_record: Callable[[int, Any], Any] | None = None,
        gpu_join: bool = False,
        local_reader: Any = None,
    ) -> None:
        import torch

        if dim + dim // block != ROW_BYTES:
            raise ConfigError(f"Engram row of {dim} values + {dim // block} scales is not {ROW_BYTES} bytes")
        self.source, self.layer_id, self.rank = source, layer_id, rank
        self.head_start, self.part, self.n_hash_cols = head_start, part, n_hash_cols
        self.vocab_start, self.vocab_end = vocab_start, vocab_end
        self.dim, self.block = dim, block
        self.max_tokens = max_tokens
        self.max_rows = max_tokens * part
        self.device = torch.device(device)
        self.dequant = dequant
        self.required = bool(source.is_required() if required is None else required)
        self.handoff_timeout_s = float(handoff_timeout_s)
        self.local_reader = local_reader if local_reader is not None else LocalReader()
        self.ops = ops if ops is not None else (CudaOps(self.device) if self.device.type == "cuda" else HostOps())
        self._cuda = self.device.type == "cuda"
        he = min(head_start + part, n_hash_cols)
        self._width = max(he - head_start, 0)
        self.d_ids = torch.empty((max_tokens, part), dtype=torch.int64, device=self.device)
        self.h_ids = torch.empty((max_tokens, part), dtype=torch.int64, device="cpu", pin_memory=self._cuda)
        self._native_plan = _native_plan()  # C++ without the GIL where the extension is built
        from dsv41.overlay import core as _core

        # the C++ core's view of this table (hand-off, buffers, launch graphs), where it is built
        self._slot = TableSlot(self, _core._core.EngramSlot(id(self))) if _core.use_core() else None
        self._ho = Handoff(None if self._slot is None else self._slot.native, JOIN_SPIN_NS)
        self._kept: list = []  # host buffers a retired (hung) worker's C++ core may still write
        self._pool: Any = None  # the fetch thread of multi-piece jobs (_fetch_pool)
        self.h_buf: Any = None
        self._fetch: Any = None
        self.graphs = LaunchGraphs(
            self.device,
            self._launch_one,
            bool(graphs and (self.ops.graphs or graph_record is not None)),
            graph_record,
            None if self._slot is None else self._slot.native.set_graphs,
        )
        # a multi-piece job's launches in the fixed piece layout, one graph per (first row, rows)
        # piece, launched by the C++ core: captured only where the core runs
        self.pieces = LaunchGraphs(
            self.device,
            self._launch_piece,
            bool(graphs and self.ops.graphs and self._slot is not None),
            None,
            None if self._slot is None else self._slot.set_piece_graphs,
        )
        self._capture_pieces: tuple[int, Any] | None = None  # (rows, out) of a multi-piece job Python served
        self._capture: tuple[int, Any] | None = None  # (rows, out) to capture at the next start
        self._hids = self.h_ids.numpy().reshape(-1)
        self._new_host_buffers()
        nbytes = self.max_rows * (4 + ROW_BYTES)
        self.d_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.d_w = torch.empty((self.max_rows, dim), dtype=torch.uint8, device=self.device)
        self.d_s = torch.empty((self.max_rows, dim // block), dtype=torch.uint8, device=self.device)
        self.d_dst = torch.arange(self.max_rows, dtype=torch.int32, device=self.device)
        self.ids_ready = self.ops.event()
        self.done = self.ops.event()
        self._handed = self._ho  # is_set()/wait(): the current generation's hand-off
        self._lock = threading.Lock()
        self._gen = 0
        self._inflight = False
        self._submitted = False  # the in-flight job went to a worker (not inline)
        self._error: BaseException | None = None
        self._t = self._rows = 0
        self._out: Any = None
        self._stream: Any = None
        self._worker: EngramWorker | None = None
        self.counters = {
            "starts": 0,
            "handoffs": 0,
            "handoff_wait_s": 0.0,
            "worker_starts": 0,
            "worker_refusals": 0,
            "handoff_timeouts": 0,
            "inline_lookups": 0,
            "refused_inline": 0,
        }
        self._last_report = time.monotonic()
        # the GPU-side join of multi-piece jobs (DSV41_ENGRAM_GPU_JOIN): None where off
        from dsv41.overlay.engram_gpujoin import GpuJoin

        self._gj = GpuJoin.for_rows(self, gpu_join)
        self._gj_job = False  # the in-flight job is joined on the GPU

    def _new_host_buffers(self) -> None:
        """(Re)allocate what the worker writes on the host: the pinned selectors + rows and the
        plan scratch (again only after a hung worker, which may still write into the old ones)."""
        import torch

        nbytes = self.max_rows * (4 + ROW_BYTES)
        if self._slot is not None and self.h_buf is not None:  # the C++ core holds raw pointers
            self._kept.append((self.h_buf, self._fetch))
        self.h_buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self._cuda)
        self._hb = self.h_buf.numpy()
        self._fetch = np.empty(self.max_rows, np.int64)
        self._own = np.empty(self.max_rows, bool)
        self._tmp = np.empty(self.max_rows, bool)
        if self._slot is not None:
            self._slot.set_buffers()
        self.graphs.clear()  # they copy from the old buffer
        if hasattr(self, "pieces"):
            self.pieces.clear()

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes this table's staging holds."""
        return self.h_ids.numel() * 8 + self.h_buf.numel()

    # -- the launching thread -------------------------------------------------------------------
    def lookup(self, indices: Any, out: Any) -> None:
        """``start`` + ``join``: ``out`` is filled (CPU) or ordered before the current stream's
        next work (CUDA). For callers that need the rows at once (tests, the isolated bench)."""
        self.start(indices, out)
        self.join()

    def start(self, indices: Any, out: Any) -> None:
        """Queue the lookup of ``indices`` (int ``[T, n_hash_cols]`` global row ids on
        ``device``) into ``out`` (bf16 ``[T, part, dim]``, vLLM's ``staged_rows[:T]``) on the
        current stream; returns without waiting for the GPU or the fetch. Raises Dsv41Error for T
        above ``max_tokens``. Inside a CUDA-graph capture the lookup runs here, synchronously."""
        t = int(indices.shape[0])
        if self._inflight:  # a start without its finish: the previous job must leave the buffers
            self.join()
        rows = t * self.part
        if rows == 0:
            return
        if t > self.max_tokens:
            raise Dsv41Error(f"Engram overlay: {t} tokens > staging for {self.max_tokens}")
        ops = self.ops
        stream = ops.current_stream()
        if self._width:
            self.d_ids[:t, : self._width].copy_(indices[:, self.head_start : self.head_start + self._width])
        if self._width < self.part:
            self.d_ids[:t, self._width :].fill_(-1)  # padded heads: zero rows, as in the kernel
        self.h_ids[:t].copy_(self.d_ids[:t], non_blocking=self._cuda)
        self.ids_ready.record(stream)
        self._t, self._rows, self._out, self._stream = t, rows, out, stream
        self._gen += 1
        self._error = None
        self._ho.begin(self._gen)
        self._inflight = True
        self.counters["starts"] += 1
        if ops.capturing():  # no second thread may call CUDA while a capture is open
            self.counters["inline_lookups"] += 1
            self._serve_inline()  # hands off
            return
        if self._capture is not None or self._capture_pieces is not None:
            self._capture_pending()  # here, on the launching thread, before the worker gets the job
        w = self._worker
        if w is None or not w.alive():
            w, started = _worker_for(self.source, self.rank, ops)
            self._worker = w
            self.counters["worker_starts"] += int(started)
        self._submitted = True
        if self._gj is not None and rows > PIECE_ROWS and self._gj.start(w, self._gen):
            self._gj_job = True  # queued on the GPU and handed to the core: join waits on nothing
            return
        w.submit(self, self._gen)

    def join(self, then: Any = None) -> bool:
        """Wait on the host for the worker's hand-off of the started lookup, then make the
        current stream wait for its rows (no host wait on any stream) and, ``then`` given (a
        CUDA event: vLLM's prefetch-done), on ``then`` too; True when the wait on ``then`` was
        queued (else the caller waits on it). Raises the job's error
        (``RemoteUnavailable`` in required mode, with its cause); a dead worker, or none within
        ``handoff_timeout_s``, is a counted refusal: ``OverlayRefused`` in required mode, else
        the exact rows are served here (remote, or the row source's local fallback)."""
        if not self._inflight:
            return False
        self._inflight = False
        if self._worker is not None and self._submitted:
            self._worker.joined()
        self._submitted = False
        if self._gj_job:  # the GPU waits for the rows; no host wait here
            self._gj_job = False
            return self._gj.join(then)
        handed, counters = self._ho, self.counters
        # the current stream's wait on the done event is queued by the C++ wait right after the
        # hand-off, before the GIL is taken back (the stream never waits for the GIL); queued == 1: here, below
        ops = self.ops
        cur = ops.current_stream()
        ev = getattr(ops, "event_handle", _no_handle)(self.done) if cur is not None else 0
        sh = getattr(ops, "stream_handle", _no_handle)(cur) if ev else 0
        ev2 = getattr(ops, "event_handle", _no_handle)(then) if ev and then is not None else 0
        t0 = time.monotonic()
        queued = handed.wait_stream(min(ALIVE_POLL_S, self.handoff_timeout_s), sh, ev, ev2)
        if not queued:
            end = t0 + self.handoff_timeout_s
            w = self._worker
            while not queued:
                if w is None or not w.thread.is_alive() or time.monotonic() >= end:
                    break
                queued = handed.wait_stream(min(ALIVE_POLL_S, max(end - time.monotonic(), 0.0)), sh, ev, ev2)
            if not queued:
                counters["handoff_wait_s"] += time.monotonic() - t0
                self._refuse(w)
                return False
        counters["handoff_wait_s"] += time.monotonic() - t0
        counters["handoffs"] += 1
        err = self._error
        if err is not None:
            self._error = None
            raise err
        if not queued & 2 and cur is not None:
            cur.wait_event(self.done)
        return bool(queued & 4)

    def _refuse(self, w: EngramWorker | None) -> None:
        dead = w is None or not w.thread.is_alive()
        with self._lock:  # the worker checks this before it launches or hands off
            self._ho.abandon(self._gen)
        if dead:
            self.counters["worker_refusals"] += 1
            cause = "the rank's Engram worker thread died"
        else:
            self.counters["handoff_timeouts"] += 1
            cause = f"the rank's Engram worker handed nothing off within {self.handoff_timeout_s:g} s"
            w.retire()
            self._new_host_buffers()  # the hung call may still write into the old ones
        self._worker = None
        if self.required:
            raise OverlayRefused(
                f"dsv41 overlay rank {self.rank} layer {self.layer_id}: {cause}; DSV41_ENGRAM_REMOTE_REQUIRED=1"
            )
        log.error(
            "dsv41 overlay rank %d layer %d: %s; serving this step's rows on the launching thread "
            "(a new worker takes the next step)",
            self.rank,
            self.layer_id,
            cause,
        )
        self.counters["refused_inline"] += 1
        self._serve_inline()
        cur = self.ops.current_stream()
        if cur is not None:
            cur.wait_event(self.done)

    def _serve_inline(self) -> None:
        """The whole job on the calling thread (capture time, a refused hand-off)."""
        self._wait_ids()
        self._serve(None, self.counters)
        self._ho.handoff(self._gen)

    # -- the worker thread ----------------------------------------------------------------------
    def _wait_ids(self) -> None:
        self.ids_ready.synchronize()

    def _serve(self, gen: int | None, counters: dict) -> bool:
        """Plan, fetch and launch the job: one piece (a decode step) in one H2D copy, or piece by
        piece (``PIECE_ROWS`` rows each) in the fixed piece layout (``_launch_piece``, the layout
        the C++ core plans into and its piece graphs read): the H2D copy and kernel of one piece
        run on the GPU while the next piece is fetched. On the worker (``gen`` given) a job of
        several pieces is pipelined on the host too: the table's fetch thread plans and fetches
        piece k+1 while the worker launches piece k, into disjoint parts of the staging buffers;
        the worker never leaves a fetch running behind the job, and captures the piece graphs
        at the table's next start (``_capture_pending``). False when the job's hand-off was refused
        meanwhile (nothing more launched)."""
        rows = self._rows
        if rows <= PIECE_ROWS:
            return self._launch(0, rows, 0, self._plan_fetch(0, rows, 0, counters), gen, last=True)
        pieces = self._piece_keys(rows)
        if gen is None:
            for k, key in enumerate(pieces):
                self._plan_fetch_piece(key, counters)
                self._launch_fixed(key, None, last=k + 1 == len(pieces))
            return True
        pool = self._fetch_pool()
        fut = pool.submit(self._plan_fetch_piece, pieces[0], counters)
        try:
            for k, key in enumerate(pieces):
                fut.result()
                fut = None
                if self._ho.is_abandoned(gen):
                    return False
                if k + 1 < len(pieces):
                    fut = pool.submit(self._plan_fetch_piece, pieces[k + 1], counters)
                if not self._launch_fixed(key, gen, last=k + 1 == len(pieces)):
                    return False
            if self.pieces.enabled:
                self._capture_pieces = (rows, self._out)
            return True
        finally:
            if fut is not None:  # an error or a refusal: the next piece's fetch ends before we return
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - the job's own error (if any) is already raised
                    pass

    def _plan_fetch_piece(self, key: tuple[int, int], counters: dict) -> int:
        """Plan piece ``key`` = (first row r0, rows m) and fetch its owned rows into the fixed
        piece layout (fetch list from ``_fetch[r0]``, packed rows from ``max_rows*4 + r0*264``);
        returns how many were fetched."""
        r0, m = key
        n = self._plan(r0, r0 + m, r0)
        if n:
            a = self.max_rows * 4 + r0 * ROW_BYTES
            t0 = time.perf_counter()
            try:
                self.source.lookup(
                    self.layer_id, self._fetch[r0 : r0 + n], out=self._hb[a : a + n * ROW_BYTES].reshape(n, ROW_BYTES)
                )
            finally:
                counters["fetch_s"] = counters.get("fetch_s", 0.0) + time.perf_counter() - t0
            counters["requests"] = counters.get("requests", 0) + 1
        return n

    def _launch_fixed(self, key: tuple[int, int], gen: int | None, last: bool) -> bool:
        """``_launch_piece`` of ``key`` on the job's stream (and the done event after the ``last``
        piece); False (nothing launched) when the job's hand-off was refused meanwhile."""
        if gen is not None:
            with self._lock:
                if self._ho.is_abandoned(gen):
                    return False
        with self.ops.stream(self._stream):
            self._launch_piece(key, self._out)
            if last:
                self.done.record(self._stream)
        return True

    def _fetch_pool(self) -> Any:
        """The table's fetch thread (created at its first multi-piece job; named as the worker's,
        whose calls the row source sees)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"dsv41-engram-worker-{self.rank}-fetch")
        return self._pool

    def _plan_fetch(self, r0: int, r1: int, f0: int, counters: dict) -> int:
        """Plan rows ``[r0, r1)`` and fetch the owned ones into the staging buffer from fetch row
        ``f0`` on; returns how many were fetched."""
        n = self._plan(r0, r1, f0)
        if n:
            t0 = time.perf_counter()
            try:
                self._fetch_rows(f0, n)
            finally:
                counters["fetch_s"] = counters.get("fetch_s", 0.0) + time.perf_counter() - t0
            counters["requests"] = counters.get("requests", 0) + 1
        return n

    def _plan(self, r0: int, r1: int, f0: int) -> int:
        """Mask and plan rows ``[r0, r1)`` of the job: selectors (relative to the piece's first
        fetched row ``f0``) into the pinned buffer, owned ids into ``_fetch[f0:]``."""
        sel = self._hb[r0 * 4 : r1 * 4].view(np.int32)
        return plan_into(
            self._hids[r0:r1],
            self.vocab_start,
            self.vocab_end,
            sel,
            self._fetch[f0:],
            self._own[r0:r1],
            self._tmp[r0:r1],
            self._native_plan,
        )

    def _packed(self, f0: int, n: int) -> np.ndarray:
        off = self._rows * 4 + f0 * ROW_BYTES
        return self._hb[off : off + n * ROW_BYTES].reshape(n, ROW_BYTES)

    def _fetch_rows(self, f0: int, n: int) -> None:
        self.source.lookup(self.layer_id, self._fetch[f0 : f0 + n], out=self._packed(f0, n))

    def _launch(self, r0: int, r1: int, f0: int, n: int, gen: int | None, last: bool) -> bool:
        """A one-piece job's launch (``r0`` 0, ``r1`` its rows, ``f0`` 0, ``last``): H2D of the
        selectors + the ``n`` fetched rows in one copy, split, vLLM's kernel on the job's stream,
        the done event; on the worker the size's launch graph (captured at the table's start
        after its first eager launch, ``_capture_pending``). False (nothing launched) when the job's hand-off was refused meanwhile."""
        import torch

        assert r0 == 0 and f0 == 0 and last, (r0, f0, last)  # several pieces: _launch_fixed
        if gen is not None:
            with self._lock:
                if self._ho.is_abandoned(gen):
                    return False
        if gen is not None and self.graphs.enabled:
            # one graph launch (captured after the first eager one) on the job's stream by its
            # handle: no stream context (two set_stream calls) around it
            if not self.graphs.replay(r1, self._out, self._stream):
                with self.ops.stream(self._stream):
                    self._launch_one(r1, self._out)
                if self.graphs.wanted(r1, self._out):
                    self._capture = (r1, self._out)
            self.done.record(self._stream)
            return True
        b = self._rows * 4 + n * ROW_BYTES
        with self.ops.stream(self._stream):
            d_sel = self.d_buf[: r1 * 4]
            self.d_buf[:b].copy_(self.h_buf[:b], non_blocking=self._cuda)  # selectors and rows in one copy
            if n:
                d_rows = self.d_buf[r1 * 4 : b].view(n, ROW_BYTES)
                self.d_w[:n].copy_(d_rows[:, : self.dim])
                self.d_s[:n].copy_(d_rows[:, self.dim :])
            self.dequant(self.d_w, self.d_s, d_sel.view(torch.int32), self.d_dst[:r1], self._out, n, r1)
            self.done.record(self._stream)
        return True

    @staticmethod
    def _piece_keys(rows: int) -> list[tuple[int, int]]:
        """``(first row, rows)`` of each piece of a job of ``rows`` rows: pieces of ``PIECE_ROWS``;
        in a job of several pieces, for each ``t`` of ``TAIL_ROWS`` in turn the last piece's last
        ``t`` rows a piece of their own where it is longer (the C++ core's ``piece_layout``)."""
        keys = [(r0, min(PIECE_ROWS, rows - r0)) for r0 in range(0, rows, PIECE_ROWS)]
        if len(keys) < 2:
            return keys
        for t in TAIL_ROWS:
            if 0 < t < keys[-1][1]:
                r0, m = keys.pop()
                keys += [(r0, m - t), (r0 + m - t, t)]
        return keys

    def _handoff(self, gen: int, error: BaseException | None) -> None:
        with self._lock:
            if gen != self._gen or self._ho.is_abandoned(gen):
                return
            self._error = error
            self._ho.handoff(gen)

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        report_counters(self.source, self.rank, self.overlay_counters())

    def overlay_counters(self) -> dict:
        """This layer's pipeline counters (``starts``, ``handoffs``, ``handoff_wait_s``,
        ``worker_starts``, ``worker_refusals`` (dead worker), ``handoff_timeouts``,
        ``inline_lookups`` (capture time), ``refused_inline``; with the C++ core ``join_tail_polls``,
        the joins that polled once a multi-piece job's last request was out), its launch graphs' (``graph_*``,
        ``LaunchGraphs``) and its worker's."""
        c = {f"layer{self.layer_id}_{k}": v for k, v in self.counters.items()}
        if self._slot is not None:  # joins that polled once the job's last request was out
            c[f"layer{self.layer_id}_join_tail_polls"] = self._slot.native.tail_polls()
        if self._gj is not None:  # the GPU-side join's C++ counters
            c.update({f"layer{self.layer_id}_{k}": v for k, v in self._gj.counters().items()})
        c.update({f"layer{self.layer_id}_graph_{k}": v for k, v in self.graphs.counters.items()})
        if self._worker is not None:
            c.update({f"worker_{k}": v for k, v in self._worker.counters.items()})
        return c
