"""Remote Engram rows inside vLLM's ``ParallelEngramEmbedding`` (vLLM 0.33.0, see
``vllm_contract.json``).

What changes in vLLM when the overlay is active (``DSV41_ENGRAM_REMOTE`` set):

* ``ParallelEngramEmbedding._allocate_weights`` returns zero-row tensors and the parameters get
  a weight loader that drops the checkpoint's table tensors: no pinned host table is allocated
  or loaded (vLLM 0.33.0 would pin about 94 GiB per rank at TP2).
* ``ParallelEngramEmbedding.lookup(indices, out)`` (called by ``Engram._start_prefetch``, an
  ``eager_break_during_capture`` function, so it re-runs at every PIECEWISE replay) becomes
  ``RemoteRows.start``: the rank's ids ``indices[:, head_start:head_start+part]`` go to a
  pinned host buffer by an async copy on the prefetch stream plus an event, and the job goes to
  the rank's ``EngramWorker`` thread; the launching thread returns without any host wait. The
  worker waits on that event, masks exactly as vLLM's kernel masks (ids outside
  ``[vocab_start_idx, vocab_end_idx)``, ``-1`` and padded heads give zero rows), fetches the
  others through the RowSource (both Engram layers of a decode step in one ``lookup_layers``
  request; remote, exact local fallback, required mode) into pinned memory, copies selectors +
  packed 264-byte rows to the GPU in one H2D copy and launches vLLM's own
  ``_engram_lookup_kernel`` (SORTED mode, BF16 output) into ``staged_rows`` on the prefetch
  stream, records the layer's done event and hands the layer off. Values are bit-identical to
  vLLM's local path because the arithmetic is vLLM's own kernel on the same bytes.
* ``Engram._finish_prefetch`` (also an eager break) first waits on the host for that layer's
  hand-off only (``RemoteRows.join``: bounded; a dead or hung worker is a counted refusal;
  required mode raises the cause here), makes the current stream wait on the done event, then
  runs vLLM's own body. Inside a CUDA-graph capture (vLLM's breakable capture included) the
  lookup runs synchronously on the launching thread: no second thread calls CUDA then.
* ``Engram._create_embedding`` tells the embedding its model layer id (the row source keys
  tables by layer id, vLLM by hash index).

Refusals at model construction (always, since the rows would be stale or wrong): a FULL CUDA
graph decode (``FULL``, ``FULL_DECODE_ONLY``, ``FULL_AND_PIECEWISE``: the eager-break function
is captured once), PIECEWISE without breakable graphs (the fetch would sit inside a compiled
piece), and the specialized decode (``decode_backend: latency_specialized``, FULL graphs).
Structural mismatches (GPU tables, Engram DP sharing, ranges that differ from the dsv41 layout
or the contract): refused in required mode, otherwise that table stays on vLLM's own path with
one log line.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from dsv41.errors import ConfigError, Dsv41Error
from dsv41.overlay import contract as C
from dsv41.overlay import settings as S

log = logging.getLogger("dsv41.overlay")

ROW_BYTES = 264
#: Seconds between two counter reports (log line + JSON file) of one rank.
REPORT_EVERY_S = 60.0
_layer: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("dsv41_engram_layer", default=None)
_sources: dict[tuple, Any] = {}
_sources_lock = threading.Lock()


class OverlayRefused(Dsv41Error):
    """vLLM's configuration cannot serve correct rows through the overlay."""


#: Seconds ``_finish_prefetch`` waits for the worker's hand-off of one layer before it counts a
#: refusal and serves that layer's exact rows on the launching thread. The worker's fetch is
#: bounded by the row source's own deadline (``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``, local fallback
#: inside it), so only a hung worker (a CUDA call that never returns, a fallback read stuck on a
#: dead disk) reaches this bound; a dead worker thread is noticed within ``ALIVE_POLL_S``.
HANDOFF_TIMEOUT_S = 30.0
#: Seconds between two checks, while waiting for a hand-off, that the worker thread is alive.
ALIVE_POLL_S = 0.05
#: Rows of one piece of a lookup (plan, fetch, H2D, kernel): a decode step is one piece; a 32K
#: prefill chunk at TP2 (393,216 rows) six, whose copies and kernels overlap the next fetch.
PIECE_ROWS = 65536
#: Seconds the worker waits, once the first layer's ids are down, for the step's other Engram
#: layer when the last step had two (both in one request saves a round trip, ~0.1-0.3 ms on
#: loopback tcp; the other layer's start follows the first by tens of microseconds).
COALESCE_S = 0.0005
#: Optional ``() -> bool``: vLLM's ``BreakableCUDAGraphCapture.is_active`` (set by ``apply``).
_capture_active: Callable[[], bool] | None = None
_workers: dict[int, "EngramWorker"] = {}
_workers_lock = threading.Lock()


def _plan_into(ids: np.ndarray, lo: int, hi: int, sel: np.ndarray, fetch: np.ndarray, own: np.ndarray,
               tmp: np.ndarray) -> int:
    """Vectorised mask + plan into caller buffers (no allocation): ``ids`` int64 ``[R]``;
    writes ``sel`` int32 ``[R]`` (index into the fetch, -1 = zero row) and ``fetch[:n]`` int64
    (owned ids in request order); ``own``/``tmp``: bool ``[R]`` scratch. Returns ``n``."""
    np.greater_equal(ids, lo, out=own)
    np.less(ids, hi, out=tmp)
    np.logical_and(own, tmp, out=own)
    np.cumsum(own, out=sel, dtype=np.int32)  # 1-based position of each owned id in the fetch
    n = int(sel[-1]) if sel.size else 0
    np.subtract(sel, 1, out=sel)
    np.logical_not(own, out=tmp)
    np.putmask(sel, tmp, -1)
    np.compress(own, ids, out=fetch[:n])
    return n


def plan_rows(ids: np.ndarray, vocab_start: int, vocab_end: int, sel_out: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Mask one rank's ids the way vLLM's ``_engram_lookup_kernel`` does and plan the fetch.

    ``ids``: int32/int64 ``[R]`` (the rank's ``[T, part]`` ids flattened, padded heads = -1).
    Returns ``(sel, fetch)``: ``sel`` int32 ``[R]`` = index into ``fetch`` for owned ids
    (``vocab_start <= id < vocab_end``), -1 for the others (their output rows are zeros, as in
    the kernel); ``fetch`` int64 ``[n]`` = owned ids in request order (global row ids of the
    layer's table).  ``sel_out``: optional int32 ``[R]`` buffer to write ``sel`` into.
    (``RemoteRows`` runs the same arithmetic into its own buffers, allocation-free.)
    """
    ids = np.ascontiguousarray(np.asarray(ids).reshape(-1), dtype=np.int64)
    sel = np.empty(ids.shape, np.int32) if sel_out is None else sel_out
    fetch = np.empty(ids.shape, np.int64)
    own, tmp = np.empty(ids.shape, bool), np.empty(ids.shape, bool)
    n = _plan_into(ids, vocab_start, vocab_end, sel, fetch, own, tmp)
    return sel, fetch[:n]


class _NoEvent:
    """The CPU stand-in of a CUDA event: work on the CPU is done when it returns."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class HostOps:
    """Stream/event operations for a CPU ``device`` (tests without a GPU): one program order."""

    def current_stream(self) -> Any:
        return None

    def event(self) -> Any:
        return _NoEvent()

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def capturing(self) -> bool:
        return False

    def bind_thread(self) -> None:
        return None


class CudaOps(HostOps):
    """Stream/event operations on a CUDA ``device`` (torch). ``capturing()`` is True inside a
    CUDA-graph capture, torch's or vLLM's breakable one (whose eager breaks run between capture
    segments: a worker thread's CUDA calls could then hit the capture's global error mode)."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def current_stream(self) -> Any:
        import torch

        return torch.cuda.current_stream(self.device)

    def event(self) -> Any:
        import torch

        return torch.cuda.Event()

    def stream(self, stream: Any) -> Any:
        import torch

        return torch.cuda.stream(stream)

    def capturing(self) -> bool:
        import torch

        return bool(torch.cuda.is_current_stream_capturing() or (_capture_active is not None and _capture_active()))

    def bind_thread(self) -> None:
        import torch

        torch.cuda.set_device(self.device)  # the current device is per thread


class EngramWorker:
    """The rank's row-fetch thread (one per RowSource, shared by the rank's Engram layers).

    Takes ``RemoteRows`` jobs in submission order. For the first job it waits on the job's
    ids event (the D2H copy of the ids into pinned memory), then takes every other job queued by
    then (both Engram layers of a decode step), plans and masks each, fetches them through the
    RowSource (one ``lookup_layers`` request when more than one layer has rows and the total fits
    one request of ``CHUNK_ROWS``, else one ``lookup`` per layer in order, so layer 1 of a prefill
    chunk is handed off before layer 14 is fetched), launches each layer's H2D copy + vLLM's
    kernel on the layer's stream, records its done event and hands it off. Exceptions of a job
    (``RemoteUnavailable`` in required mode, CUDA errors) are handed off with the job and raised
    by ``RemoteRows.join`` on the launching thread. Counters: ``jobs``, ``requests``,
    ``multi_layer_requests``, ``errors``, ``wake_s`` (submit to dequeue), ``ids_wait_s``, ``coalesce_waits``, ``coalesce_s``,
    ``plan_s`` and ``launch_s`` (one-request steps), ``fetch_s`` (seconds inside the row source) and
    ``host_s`` (the rest of the worker's busy time: ids wait excluded, plan, H2D/kernel launches).
    """

    def __init__(self, source: Any, rank: int, ops: Any) -> None:
        from dsv41.engram.client import CHUNK_ROWS

        self.source, self.rank, self.ops = source, rank, ops
        self.chunk_rows = CHUNK_ROWS
        look = getattr(source, "lookup_layers", None)
        self.multi = look is not None and "outs" in inspect.signature(look).parameters
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.retired = False
        # Layers started and not yet joined (launching thread); the largest such count of the
        # last step is how many jobs a step brings: both Engram layers start before either joins.
        self._open = self._burst = self._joins = 0
        self.expect = 1
        self.counters = {"wake_s": 0.0, "ids_wait_s": 0.0, "coalesce_waits": 0, "coalesce_s": 0.0,
                         "plan_s": 0.0, "launch_s": 0.0, "jobs": 0, "requests": 0, "multi_layer_requests": 0, "errors": 0,
                         "fetch_s": 0.0, "host_s": 0.0}
        self.thread = threading.Thread(target=self._run, name=f"dsv41-engram-worker-{rank}", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        """Whether the thread runs and was not retired."""
        return not self.retired and self.thread.is_alive()

    def submit(self, rows: "RemoteRows", gen: int) -> None:
        """Queue one layer's job (``gen``: the job's generation, see ``RemoteRows.start``).
        Launching thread only (as ``joined``)."""
        self._open += 1
        self._burst = max(self._burst, self._open)
        with self._cond:
            self._queue.append((rows, gen, time.perf_counter()))
            self._cond.notify()

    def joined(self) -> None:
        """One started layer was joined; when none is open, the step's number of layers becomes
        the number the worker waits for (at most ``COALESCE_S``, and never past a join: the
        launching thread has then left the step's starts) before it fetches."""
        self._open -= 1
        if self._open <= 0:
            self._open, self.expect, self._burst = 0, self._burst, 0
        with self._cond:  # a join means no more layers of this step are coming: stop waiting
            self._joins += 1
            self._cond.notify()

    def retire(self) -> None:
        """Stop taking jobs (a hung worker is replaced; it exits once its call returns)."""
        with self._cond:
            self.retired = True
            self._cond.notify()

    def _run(self) -> None:
        self.ops.bind_thread()
        q, cond = self._queue, self._cond
        while True:
            with cond:
                while not q and not self.retired:
                    cond.wait()
                if self.retired:
                    return
                rows, gen, t_sub = q.popleft()
            self.counters["wake_s"] += time.perf_counter() - t_sub
            batch = [(rows, gen)]
            t0 = time.perf_counter()
            rows._wait_ids()
            t1 = time.perf_counter()
            self.counters["ids_wait_s"] += t1 - t0
            with cond:  # the step's other layers: queued meanwhile, or due within COALESCE_S
                if len(q) + 1 < self.expect and rows._rows <= self.chunk_rows:
                    self.counters["coalesce_waits"] += 1
                    end = time.perf_counter() + COALESCE_S
                    joins = self._joins
                    while len(q) + 1 < self.expect and not self.retired and self._joins == joins:
                        left = end - time.perf_counter()
                        if left <= 0:
                            break
                        cond.wait(left)
                while q:
                    r, g, _ = q.popleft()
                    batch.append((r, g))
            self.counters["coalesce_s"] += time.perf_counter() - t1
            self._serve(batch)

    def _serve(self, batch: list) -> None:
        t0 = time.perf_counter()
        fetch0 = self.counters["fetch_s"]
        try:
            self._serve_batch(batch)
        finally:  # host work = the batch's time minus the row source's
            self.counters["host_s"] += time.perf_counter() - t0 - (self.counters["fetch_s"] - fetch0)

    def _serve_batch(self, batch: list) -> None:
        c = self.counters
        ready = []
        for rows, gen in batch:
            try:
                rows._wait_ids()
                ready.append((rows, gen))
            except Exception as exc:  # noqa: BLE001 - handed to the launching thread
                c["errors"] += 1
                rows._handoff(gen, exc)
        c["jobs"] += len(ready)
        if self.multi and len(ready) > 1 and sum(r._rows for r, _ in ready) <= self.chunk_rows:
            self._serve_together(ready)
            return
        for rows, gen in ready:  # one layer after the other: layer 1 is handed off first
            try:
                if rows._serve(gen, c):
                    rows._handoff(gen, None)
            except Exception as exc:  # noqa: BLE001
                c["errors"] += 1
                rows._handoff(gen, exc)
            rows._maybe_report()

    def _serve_together(self, ready: list) -> None:
        """Every layer of ``ready`` (each one piece) in one ``lookup_layers`` request."""
        c = self.counters
        jobs = []
        t0 = time.perf_counter()
        for rows, gen in ready:
            try:
                jobs.append((rows, gen, rows._plan(0, rows._rows, 0)))
            except Exception as exc:  # noqa: BLE001
                c["errors"] += 1
                rows._handoff(gen, exc)
        fetched = [j for j in jobs if j[2]]
        c["plan_s"] += time.perf_counter() - t0
        if fetched:
            f0 = time.perf_counter()
            try:
                if len(fetched) > 1:
                    self.source.lookup_layers([r.layer_id for r, _, _ in fetched],
                                              [r._fetch[:n] for r, _, n in fetched],
                                              [r._packed(0, n) for r, _, n in fetched])
                    c["multi_layer_requests"] += 1
                else:
                    fetched[0][0]._fetch_rows(0, fetched[0][2])
                c["requests"] += 1
            except Exception as exc:  # noqa: BLE001 - every layer of the request gets the cause
                c["errors"] += 1
                for rows, gen, _ in fetched:
                    rows._handoff(gen, exc)
                jobs = [j for j in jobs if not j[2]]
            finally:
                c["fetch_s"] += time.perf_counter() - f0
        for rows, gen, n in jobs:
            try:
                t0 = time.perf_counter()
                launched = rows._launch(0, rows._rows, 0, n, gen, last=True)
                c["launch_s"] += time.perf_counter() - t0
                if launched:
                    rows._handoff(gen, None)
            except Exception as exc:  # noqa: BLE001
                c["errors"] += 1
                rows._handoff(gen, exc)
            rows._maybe_report()


def _worker_for(source: Any, rank: int, ops: Any) -> tuple[EngramWorker, bool]:
    """The rank's live worker for ``source`` (a new one when there is none or it died/retired);
    returns ``(worker, started)``."""
    with _workers_lock:
        w = _workers.get(id(source))
        if w is not None and w.source is source and w.alive():
            return w, False
        w = _workers[id(source)] = EngramWorker(source, rank, ops)
        return w, True


def stop_workers() -> None:
    """Retire every worker (tests; a process exit needs nothing: the threads are daemons)."""
    with _workers_lock:
        for w in _workers.values():
            w.retire()
        _workers.clear()


class RemoteRows:
    """One Engram table's rank-local rows through a RowSource, staged for vLLM's kernel, fetched
    by the rank's ``EngramWorker`` off the launching thread.

    ``source``: RowSource with ``lookup(layer_id, rows, out=None)`` (and ``lookup_layers`` for
    one request per step); ``layer_id``: model layer; ranges as in vLLM's
    ``ParallelEngramEmbedding`` (``head_start``, ``part`` = ``part_n_hash_cols``, ``n_hash_cols``,
    ``vocab_start``, ``vocab_end``); ``dim`` (256) and ``block`` (32); ``max_tokens``: largest T
    (``max_num_batched_tokens``); ``device``: where ``out`` lives; ``dequant(w, s, sel, dst, out,
    n, rows)``: the kernel launch (vLLM's ``_engram_lookup_kernel`` in SORTED mode on CUDA; tests
    pass an emulation on CPU); ``required``: a refused hand-off raises instead of serving the
    rows inline (default: the source's ``required``); ``handoff_timeout_s``: see
    ``HANDOFF_TIMEOUT_S``; ``ops``: stream/event operations (``CudaOps``/``HostOps`` by device;
    tests pass fakes).

    Buffers, allocated once (graph-stable; ``staged_rows`` is vLLM's): device int64 ids
    ``[max_tokens, part]`` and their pinned host copy, pinned host ``[rows*4 + rows*264]`` bytes
    (int32 row selectors + packed rows) and the same on the device, the split weight
    ``[rows, dim]`` and scale ``[rows, dim/block]`` tables the kernel reads, and host scratch
    for the plan (bool ``[rows]`` x2, int64 ``[rows]``).

    Per step: ``start`` (launching thread, inside vLLM's ``_start_prefetch`` on the prefetch
    stream) queues the ids' D2H copy + an event and hands the job to the worker; ``join``
    (launching thread, inside ``_finish_prefetch``) waits on the host for the worker's hand-off
    only, then makes the current stream wait on the layer's done event.
    """

    def __init__(self, source: Any, layer_id: int, *, head_start: int, part: int, n_hash_cols: int,
                 vocab_start: int, vocab_end: int, dim: int, block: int, max_tokens: int, device: Any,
                 dequant: Callable[..., None], rank: int = 0, required: bool | None = None,
                 handoff_timeout_s: float = HANDOFF_TIMEOUT_S, ops: Any = None) -> None:
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
        self.required = bool(getattr(source, "required", False) if required is None else required)
        self.handoff_timeout_s = float(handoff_timeout_s)
        self.ops = ops if ops is not None else (CudaOps(self.device) if self.device.type == "cuda" else HostOps())
        # RemoteRowSource fills a caller buffer; other RowSources return their rows
        self._fills = "out" in inspect.signature(source.lookup).parameters
        self._cuda = self.device.type == "cuda"
        he = min(head_start + part, n_hash_cols)
        self._width = max(he - head_start, 0)
        self.d_ids = torch.empty((max_tokens, part), dtype=torch.int64, device=self.device)
        self.h_ids = torch.empty((max_tokens, part), dtype=torch.int64, device="cpu", pin_memory=self._cuda)
        self._new_host_buffers()
        nbytes = self.max_rows * (4 + ROW_BYTES)
        self.d_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.d_w = torch.empty((self.max_rows, dim), dtype=torch.uint8, device=self.device)
        self.d_s = torch.empty((self.max_rows, dim // block), dtype=torch.uint8, device=self.device)
        self.d_dst = torch.arange(self.max_rows, dtype=torch.int32, device=self.device)
        self._hids = self.h_ids.numpy().reshape(-1)
        self.ids_ready = self.ops.event()
        self.done = self.ops.event()
        self._handed = threading.Event()
        self._lock = threading.Lock()
        self._gen = 0
        self._abandoned = -1  # generation of a job whose hand-off was refused (never launched)
        self._inflight = False
        self._submitted = False  # the in-flight job went to a worker (not inline)
        self._error: BaseException | None = None
        self._t = self._rows = 0
        self._out: Any = None
        self._stream: Any = None
        self._worker: EngramWorker | None = None
        self.counters = {"starts": 0, "handoffs": 0, "handoff_wait_s": 0.0, "worker_starts": 0,
                         "worker_refusals": 0, "handoff_timeouts": 0, "inline_lookups": 0, "refused_inline": 0}
        self._last_report = time.monotonic()

    def _new_host_buffers(self) -> None:
        """(Re)allocate what the worker writes on the host: the pinned selectors + rows and the
        plan scratch (again only after a hung worker, which may still write into the old ones)."""
        import torch

        nbytes = self.max_rows * (4 + ROW_BYTES)
        self.h_buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self._cuda)
        self._hb = self.h_buf.numpy()
        self._fetch = np.empty(self.max_rows, np.int64)
        self._own = np.empty(self.max_rows, bool)
        self._tmp = np.empty(self.max_rows, bool)

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
            self.d_ids[:t, : self._width].copy_(indices[:, self.head_start: self.head_start + self._width])
        if self._width < self.part:
            self.d_ids[:t, self._width:].fill_(-1)  # padded heads: zero rows, as in the kernel
        self.h_ids[:t].copy_(self.d_ids[:t], non_blocking=self._cuda)
        self.ids_ready.record(stream)
        self._t, self._rows, self._out, self._stream = t, rows, out, stream
        self._gen += 1
        self._error = None
        self._handed.clear()
        self._inflight = True
        self.counters["starts"] += 1
        if ops.capturing():  # no second thread may call CUDA while a capture is open
            self.counters["inline_lookups"] += 1
            self._serve_inline()
            self._handed.set()
            return
        w = self._worker
        if w is None or not w.alive():
            w, started = _worker_for(self.source, self.rank, ops)
            self._worker = w
            self.counters["worker_starts"] += int(started)
        self._submitted = True
        w.submit(self, self._gen)

    def join(self) -> None:
        """Wait on the host for the worker's hand-off of the started lookup, then make the
        current stream wait for its rows (no host wait on any stream). Raises the job's error
        (``RemoteUnavailable`` in required mode, with its cause); a dead worker, or none within
        ``handoff_timeout_s``, is a counted refusal: ``OverlayRefused`` in required mode, else
        the exact rows are served here (remote, or the row source's local fallback)."""
        if not self._inflight:
            return
        self._inflight = False
        if self._worker is not None and self._submitted:
            self._worker.joined()
        self._submitted = False
        handed = self._handed
        if not handed.is_set():
            t0 = time.monotonic()
            end = t0 + self.handoff_timeout_s
            w = self._worker
            while not handed.wait(min(ALIVE_POLL_S, max(end - time.monotonic(), 0.0))):
                if w is None or not w.thread.is_alive() or time.monotonic() >= end:
                    break
            self.counters["handoff_wait_s"] += time.monotonic() - t0
            if not handed.is_set():
                self._refuse(w)
                return
        self.counters["handoffs"] += 1
        err = self._error
        if err is not None:
            self._error = None
            raise err
        cur = self.ops.current_stream()
        if cur is not None:
            cur.wait_event(self.done)

    def _refuse(self, w: EngramWorker | None) -> None:
        dead = w is None or not w.thread.is_alive()
        with self._lock:  # the worker checks this before it launches or hands off
            self._abandoned = self._gen
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
            raise OverlayRefused(f"dsv41 overlay rank {self.rank} layer {self.layer_id}: {cause}; "
                                 f"DSV41_ENGRAM_REMOTE_REQUIRED=1")
        log.error("dsv41 overlay rank %d layer %d: %s; serving this step's rows on the launching thread "
                  "(a new worker takes the next step)", self.rank, self.layer_id, cause)
        self.counters["refused_inline"] += 1
        self._serve_inline()
        cur = self.ops.current_stream()
        if cur is not None:
            cur.wait_event(self.done)

    def _serve_inline(self) -> None:
        """The whole job on the calling thread (capture time, a refused hand-off)."""
        self._wait_ids()
        self._serve(None, self.counters)

    # -- the worker thread ----------------------------------------------------------------------
    def _wait_ids(self) -> None:
        self.ids_ready.synchronize()

    def _serve(self, gen: int | None, counters: dict) -> bool:
        """Plan, fetch and launch the job piece by piece (``PIECE_ROWS`` rows each): the H2D
        copy and kernel of one piece run on the GPU while the next piece is fetched, so of a
        prefill chunk only the last piece's copy and kernel follow the fetch. False when the
        job's hand-off was refused meanwhile (nothing more launched)."""
        rows, f0 = self._rows, 0
        for r0 in range(0, rows, PIECE_ROWS):
            r1 = min(r0 + PIECE_ROWS, rows)
            n = self._plan(r0, r1, f0)
            if n:
                t0 = time.perf_counter()
                try:
                    self._fetch_rows(f0, n)
                finally:
                    counters["fetch_s"] = counters.get("fetch_s", 0.0) + time.perf_counter() - t0
                counters["requests"] = counters.get("requests", 0) + 1
            if not self._launch(r0, r1, f0, n, gen, last=r1 == rows):
                return False
            f0 += n
        return True

    def _plan(self, r0: int, r1: int, f0: int) -> int:
        """Mask and plan rows ``[r0, r1)`` of the job: selectors (relative to the piece's first
        fetched row ``f0``) into the pinned buffer, owned ids into ``_fetch[f0:]``."""
        sel = self._hb[r0 * 4: r1 * 4].view(np.int32)
        return _plan_into(self._hids[r0:r1], self.vocab_start, self.vocab_end, sel, self._fetch[f0:],
                          self._own[r0:r1], self._tmp[r0:r1])

    def _packed(self, f0: int, n: int) -> np.ndarray:
        off = self._rows * 4 + f0 * ROW_BYTES
        return self._hb[off: off + n * ROW_BYTES].reshape(n, ROW_BYTES)

    def _fetch_rows(self, f0: int, n: int) -> None:
        packed = self._packed(f0, n)
        if self._fills:
            self.source.lookup(self.layer_id, self._fetch[f0: f0 + n], out=packed)
        else:
            packed[...] = self.source.lookup(self.layer_id, self._fetch[f0: f0 + n])

    def _launch(self, r0: int, r1: int, f0: int, n: int, gen: int | None, last: bool) -> bool:
        """H2D of the piece's selectors + rows, split, vLLM's kernel on the job's stream (and
        the done event after the ``last`` piece); False (nothing launched) when the job's
        hand-off was refused meanwhile."""
        import torch

        if gen is not None:
            with self._lock:
                if gen == self._abandoned:
                    return False
        nb = self._cuda  # async from pinned memory on CUDA; in program order on the CPU
        a, b = self._rows * 4 + f0 * ROW_BYTES, self._rows * 4 + (f0 + n) * ROW_BYTES
        with self.ops.stream(self._stream):
            d_sel = self.d_buf[r0 * 4: r1 * 4]
            if r0 == 0 and last:  # one piece: selectors and rows in one H2D copy
                self.d_buf[:b].copy_(self.h_buf[:b], non_blocking=nb)
            else:
                d_sel.copy_(self.h_buf[r0 * 4: r1 * 4], non_blocking=nb)
                if n:
                    self.d_buf[a:b].copy_(self.h_buf[a:b], non_blocking=nb)
            if n:
                d_rows = self.d_buf[a:b].view(n, ROW_BYTES)
                self.d_w[f0: f0 + n].copy_(d_rows[:, : self.dim])
                self.d_s[f0: f0 + n].copy_(d_rows[:, self.dim:])
            self.dequant(self.d_w[f0:], self.d_s[f0:], d_sel.view(torch.int32), self.d_dst[r0:r1], self._out, n,
                         r1 - r0)
            if last:
                self.done.record(self._stream)
        return True

    def _handoff(self, gen: int, error: BaseException | None) -> None:
        with self._lock:
            if gen != self._gen or gen == self._abandoned:
                return
            self._error = error
            self._handed.set()

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        report_counters(self.source, self.rank, self.overlay_counters())

    def overlay_counters(self) -> dict:
        """This layer's pipeline counters (``starts``, ``handoffs``, ``handoff_wait_s``,
        ``worker_starts``, ``worker_refusals`` (dead worker), ``handoff_timeouts``,
        ``inline_lookups`` (capture time), ``refused_inline``) and its worker's."""
        c = {f"layer{self.layer_id}_{k}": v for k, v in self.counters.items()}
        if self._worker is not None:
            c.update({f"worker_{k}": v for k, v in self._worker.counters.items()})
        return c


def report_counters(source: Any, rank: int, overlay: dict | None = None) -> dict:
    """Log the row source's counters (and ``overlay``: the pipeline's, ``RemoteRows.overlay_counters``)
    and write them to ``<tmp>/dsv41-overlay-rank<R>.json`` (read by the qualification steps:
    ``docker exec dsv41-serve cat ...``)."""
    c = dict(source.counters(), **(overlay or {}))
    log.info("dsv41 overlay rank %d engram counters: %s", rank,
             " ".join(f"{k}={v}" for k, v in sorted(c.items()) if not isinstance(v, float)))
    path = os.path.join(tempfile.gettempdir(), f"dsv41-overlay-rank{rank}.json")
    from dsv41 import fileio
    from dsv41.errors import Dsv41Error

    try:
        fileio.atomic_write_json(path, {"rank": rank, "time": time.time(), "counters": c}, indent=None, default=str)
    except Dsv41Error as exc:  # a full /tmp must not break serving
        log.warning("dsv41 overlay: cannot write %s: %s", path, exc)
    return c


def vllm_dequant(module: ModuleType, emb: Any) -> Callable[..., None]:
    """Launcher of vLLM's own ``_engram_lookup_kernel`` in SORTED mode with BF16 output:
    ``sel`` holds local row ids (``-1`` = zero row), ``dst`` the output row of each entry."""
    import torch

    triton = module.triton
    kernel = module._engram_lookup_kernel

    def run(w: Any, s: Any, sel: Any, dst: Any, out: Any, n: int, rows: int) -> None:
        grid = min(triton.cdiv(rows, 16), emb._num_sms)
        kernel[(grid,)](
            w.view(torch.float8_e4m3fn), s, sel, dst, out, 0, n, rows, 0, 0,
            HEAD_START=emb.head_start, LOCAL_HEADS=emb.part_n_hash_cols, TOTAL_HEADS=emb.n_hash_cols,
            DIM=emb.dim, QUANT_BLOCK=emb.block_size, BLOCK_R=16, GRID=grid, SORTED=True, PACKED=False,
            OUT_STRIDE=out.stride(0), PEER_ROWS=0)

    return run


def check_compilation(vllm_config: Any) -> None:
    """OverlayRefused unless decode runs eager or in breakable PIECEWISE graphs and the
    specialized decode is off (``vllm_contract.json`` ``compilation``)."""
    comp = vllm_config.compilation_config
    mode = getattr(comp.cudagraph_mode, "name", str(comp.cudagraph_mode))
    if mode not in C.COMPILATION["engram_remote"]["cudagraph_mode_allowed"]:
        raise OverlayRefused(
            f"DSV41_ENGRAM_REMOTE needs PIECEWISE (or no) CUDA graphs, vLLM runs cudagraph_mode={mode}: "
            f"a FULL decode graph captures the host-side row fetch once; start vLLM with {C.PIECEWISE_FLAG}")
    if mode == "PIECEWISE":
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

        if not is_breakable_cudagraph_enabled():
            raise OverlayRefused(
                "DSV41_ENGRAM_REMOTE needs breakable PIECEWISE graphs (the fetch runs between graph "
                "segments): remove VLLM_USE_BREAKABLE_CUDAGRAPH=0 from the environment")
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict) and extra.get("decode_backend") == "latency_specialized":
        raise OverlayRefused(
            "DSV41_ENGRAM_REMOTE cannot run under the specialized decode (FULL-graph decode steps): "
            "remove \"decode_backend\": \"latency_specialized\" from --additional-config")


def _source(settings: S.OverlaySettings, tp: int, rank: int) -> tuple[Any, Any]:
    """(RowSource, dsv41 EngramLayout) of this rank, one per process (shared by the layers):
    a ``RemoteRowSource`` with ``DSV41_ENGRAM_REMOTE_TIMEOUT_MS`` per request, the engine's
    whole-call deadline ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS`` and busy-poll budget
    ``DSV41_TRANSPORT_CLIENT_SPIN_US``, and the runtime root's tables as its exact fallback."""
    key = (settings.engram_urls, tp, rank)
    with _sources_lock:
        if key in _sources:
            return _sources[key]
        from dsv41.engram.client import RemoteRowSource
        from dsv41.engram.manifest import load_manifest
        from dsv41.engram.sweep import layout_from_manifest
        from dsv41.engram.reader import LocalRowReader

        url = S.rank_url(settings, tp, rank)
        manifest_path, tables_dir = S.runtime_files(settings)
        manifest = load_manifest(manifest_path)
        layout = layout_from_manifest(manifest)
        local = LocalRowReader(manifest, tables_dir) if tables_dir is not None else None
        if local is None:
            log.warning("dsv41 overlay rank %d: no local tables under the runtime root: no exact fallback", rank)
        # the engine's whole-call deadline and busy-poll budget, from the same settings
        # (DSV41_ENGRAM_LOOKUP_DEADLINE_MS, DSV41_TRANSPORT_CLIENT_SPIN_US)
        src = RemoteRowSource(url, manifest, rank, tp, settings.timeout_ms, settings.required, local=local,
                              deadline_ms=settings.env.engram_lookup_deadline_ms,
                              spin_us=settings.env.transport_client_spin_us)
        _sources[key] = (src, layout)
        return _sources[key]


def _skip_weight(param: Any, loaded_weight: Any) -> None:
    """Weight loader of the overlay's zero-row tables: the checkpoint tensor is dropped."""
    return None


def apply(module: ModuleType, settings: S.OverlaySettings, contract: dict) -> None:
    """Patch vLLM's Engram module (``vllm.models.deepseek_v41.common.engram``)."""
    import torch

    if getattr(module, "_dsv41_overlay", False):
        return
    global _capture_active
    PEE, Engram = module.ParallelEngramEmbedding, module.Engram
    orig_alloc, orig_lookup, orig_create = PEE._allocate_weights, PEE.lookup, Engram._create_embedding
    orig_finish = getattr(Engram, "_finish_prefetch", None)
    orig_finish = getattr(orig_finish, "__wrapped__", orig_finish)  # vLLM's body, without its eager break
    try:  # vLLM's breakable capture: its eager breaks run between capture segments
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

        _capture_active = BreakableCUDAGraphCapture.is_active
    except (ImportError, AttributeError):  # no vLLM here (tests), or a stand-in without it
        _capture_active = None

    def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
        token = _layer.set((layout, layer_hash_index))
        try:
            return orig_create(self, layout, layer_hash_index)
        finally:
            _layer.reset(token)

    def _decline(why: str) -> None:
        if settings.required:
            raise OverlayRefused(f"dsv41 overlay: {why}; refusing to start because DSV41_ENGRAM_REMOTE_REQUIRED=1")
        log.error("dsv41 overlay: %s; this table stays on vLLM's own path", why)

    def _allocate_weights(self: Any) -> Any:
        ctx = _layer.get()
        if ctx is None or torch.get_default_device().type == "meta":
            return orig_alloc(self)
        vlayout, hash_index = ctx
        layer_id = int(vlayout.layer_ids[hash_index])
        vcfg = module.get_current_vllm_config()
        check_compilation(vcfg)
        if not self.cpu_offload or self.dp_size != 1 or self.dp_shared_memory or self.peer_rows:
            _decline(f"layer {layer_id}: Engram tables must be host-offloaded, per rank, without Engram DP "
                     f"(cpu_offload={self.cpu_offload}, engram dp_size={self.dp_size}, "
                     f"dp_shared_memory={self.dp_shared_memory})")
            return orig_alloc(self)
        tp, rank = self.tp_size, module.get_tensor_model_parallel_rank()
        src, layout = _source(settings, tp, rank)
        got = {"head_start": self.head_start, "part_n_hash_cols": self.part_n_hash_cols,
               "vocab_start_idx": self.vocab_start_idx, "vocab_end_idx": self.vocab_end_idx}
        problems = C.check_ranges(layout, layer_id, tp, rank, got, contract)
        if int(vlayout.num_embeddings[hash_index]) != layout.rows[layout.layer_index(layer_id)]:
            problems.append(f"layer {layer_id}: vLLM table has {vlayout.num_embeddings[hash_index]} rows, "
                            f"the manifest {layout.rows[layout.layer_index(layer_id)]}")
        if problems:
            _decline("; ".join(problems))
            return orig_alloc(self)
        max_tokens = int(vcfg.scheduler_config.max_num_batched_tokens)
        # vLLM builds the model on the current CUDA device; the CPU is for tests without a GPU
        device = (torch.device("cuda", torch.accelerator.current_device_index()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        self._dsv41 = RemoteRows(
            src, layer_id, head_start=self.head_start, part=self.part_n_hash_cols, n_hash_cols=self.n_hash_cols,
            vocab_start=self.vocab_start_idx, vocab_end=self.vocab_end_idx, dim=self.dim, block=self.block_size,
            max_tokens=max_tokens, device=device, dequant=vllm_dequant(module, self), rank=rank)
        self._weight_loader = _skip_weight  # set_weight_attrs reads it right after this returns
        log.info("dsv41 overlay rank %d layer %d: rows [%d, %d) from %s (fallback: %s); no vLLM host table "
                 "(%.2f GiB not pinned), %.1f MiB pinned staging", rank, layer_id, self.vocab_start_idx,
                 self.vocab_end_idx, src.url, "local shards" if src.local is not None else "none",
                 self.part_num_embeddings * ROW_BYTES / 2**30, self._dsv41.host_bytes / 2**20)
        scale_dim = self.dim // self.block_size
        return (torch.empty(0, self.dim, dtype=torch.float8_e4m3fn, device="cpu"),
                torch.empty(0, scale_dim, dtype=torch.uint8, device="cpu"))

    def lookup(self: Any, indices: Any, out: Any, background: bool = False) -> None:
        rows = getattr(self, "_dsv41", None)
        if rows is None:
            return orig_lookup(self, indices, out, background)
        if out.dtype != torch.bfloat16:
            raise OverlayRefused("dsv41 overlay: packed Engram lookups (Engram DP batches) are not supported")
        rows.start(indices, out)  # the worker fetches; _finish_prefetch joins

    def _finish_prefetch(self: Any, event: Any) -> None:
        rows = getattr(self.embed_tokens, "_dsv41", None)
        if rows is not None:
            rows.join()  # the host waits for this layer's hand-off only
        if orig_finish is not None:
            orig_finish(self, event)

    PEE._allocate_weights = _allocate_weights
    PEE.lookup = lookup
    Engram._create_embedding = _create_embedding
    if orig_finish is not None:
        # an eager break like vLLM's own: the hand-off wait re-runs at every PIECEWISE replay
        brk = getattr(module, "eager_break_during_capture", None)
        Engram._finish_prefetch = brk(_finish_prefetch) if brk is not None else _finish_prefetch
    module._dsv41_overlay = True
