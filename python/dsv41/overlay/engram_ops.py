"""Shared pieces of the overlay's Engram path (``dsv41.overlay.engram``): the id plan (C++ without
the GIL when ``dsv41.overlay._core`` is built, numpy otherwise), the stream/event operations
(CUDA through torch, or one program order on the CPU for tests), the per-size CUDA graph of a
one-piece launch, and the counter report.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dsv41.errors import Dsv41Error

log = logging.getLogger("dsv41.overlay")

#: Bytes of one packed Engram row: 256 e4m3 values + 8 e8m0 scales (dsv41/engram/layout.py).
ROW_BYTES = 264
#: Optional ``() -> bool``: vLLM's ``BreakableCUDAGraphCapture.is_active`` (set by ``engram.apply``).
_capture_active: Callable[[], bool] | None = None
#: Launch graphs kept per table (one per token count seen, least recently used dropped): vLLM
#: pads decode batches to its capture sizes, so a served model sees a few dozen counts.
MAX_GRAPHS = 64


#: Statuses of ``_core.EngramCore.next()`` (the enum of the C++ core): what the worker's Python
#: does with the batch it hands back (``engram_worker.EngramWorker._run_native``).
(
    CORE_RETIRED,
    CORE_PYTHON,
    CORE_FETCHED,
    CORE_FAILED,
    CORE_CUDA_FAILED,
    CORE_REPORT,
    CORE_PYTHON_IDS,
    CORE_PIECES_FETCHED,
    CORE_PIECES_FAILED,
    CORE_GJ_FAILED,
) = range(10)


class OverlayRefused(Dsv41Error):
    """vLLM's configuration cannot serve correct rows through the overlay."""


def _native_plan() -> Callable[..., int] | None:
    from dsv41.overlay import core

    return core._core.plan_rows if core.use_core() else None


def plan_into_numpy(
    ids: np.ndarray, lo: int, hi: int, sel: np.ndarray, fetch: np.ndarray, own: np.ndarray, tmp: np.ndarray
) -> int:
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


def plan_into(
    ids: np.ndarray,
    lo: int,
    hi: int,
    sel: np.ndarray,
    fetch: np.ndarray,
    own: np.ndarray,
    tmp: np.ndarray,
    native: Callable[..., int] | None = None,
) -> int:
    """``plan_into_numpy``'s result, through ``native`` (``_core.plan_rows``: one call, no
    GIL held, no scratch) when given. ``fetch`` needs room for ``len(ids)`` entries."""
    if not ids.size:
        return 0
    if native is not None:
        return int(native(ids, lo, hi, sel, fetch))
    return plan_into_numpy(ids, lo, hi, sel, fetch, own, tmp)


def plan_rows(
    ids: np.ndarray, vocab_start: int, vocab_end: int, sel_out: np.ndarray | None = None
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
    n = plan_into(ids, vocab_start, vocab_end, sel, fetch, own, tmp, _native_plan())
    return sel, fetch[:n]


class _NoEvent:
    """The CPU stand-in of a CUDA event: work on the CPU is done when it returns."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class HostOps:
    """Stream/event operations for a CPU ``device`` (tests without a GPU): one program order."""

    graphs = False  # no CUDA graphs on the CPU

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

    def event_handle(self, event: Any) -> int:
        """The raw ``CUevent`` of ``event`` for the C++ core (0: none, no CUDA)."""
        return 0

    def stream_handle(self, stream: Any) -> int:
        """The raw ``CUstream`` of ``stream`` for the C++ core (0: none, no CUDA)."""
        return 0


class CudaOps(HostOps):
    """Stream/event operations on a CUDA ``device`` (torch). ``capturing()`` is True inside a
    CUDA-graph capture, torch's or vLLM's breakable one (whose eager breaks run between capture
    segments: a worker thread's CUDA calls could then hit the capture's global error mode)."""

    graphs = True

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

    def event_handle(self, event: Any) -> int:
        return int(event.cuda_event)  # 0 until the event's first record creates it

    def stream_handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)


class Handoff:
    """One table's hand-off from the worker to the launching thread, by job generation:
    ``begin(gen)`` (launching thread, at start), ``handoff(gen)`` (worker: False when ``gen`` is
    stale or was abandoned), ``abandon(gen)`` (a refused hand-off: the worker neither launches nor
    hands it off), ``wait(timeout_s)`` / ``is_set()`` for the current generation. On the C++
    extension's ``EngramSlot`` (``native``, shared with ``EngramCore``, which hands off the layers
    it launches itself) where it is built, else a condition variable."""

    def __init__(self, native: Any = None, spin_ns: int = 0) -> None:
        self.native, self.spin_ns = native, spin_ns
        self._cond = threading.Condition()
        self._gen = self._handed = self._abandoned = 0

    def begin(self, gen: int) -> None:
        self._gen = gen
        if self.native is not None:
            self.native.begin(gen)

    def handoff(self, gen: int) -> bool:
        if self.native is not None:
            return self.native.handoff(gen)
        with self._cond:
            if gen != self._gen or gen == self._abandoned:
                return False
            self._handed = gen
            self._cond.notify_all()
            return True

    def abandon(self, gen: int) -> None:
        if self.native is not None:
            self.native.abandon(gen)
            return
        with self._cond:
            self._abandoned = gen

    def is_abandoned(self, gen: int) -> bool:
        if self.native is not None:
            return self.native.is_abandoned(gen)
        return gen == self._abandoned

    def is_set(self) -> bool:
        """Whether the current generation was handed off."""
        if self.native is not None:
            return self.native.handed() == self._gen
        return self._handed == self._gen

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the current generation's hand-off (C++: with the GIL
        released, polling ``spin_ns`` first)."""
        if self.native is not None:
            return self.native.wait(self._gen, timeout_s, self.spin_ns)
        with self._cond:
            return self._cond.wait_for(lambda: self._handed == self._gen, timeout_s)

    def wait_stream(self, timeout_s: float, stream: int, event: int, event2: int = 0) -> int:
        """``wait``, then, handed off, queue raw ``stream``'s wait on raw ``event`` (0: none) and
        then on ``event2`` (0: none) in C++ before the GIL is taken back (so the stream's wait never waits for the GIL). 0: not
        handed off within ``timeout_s``; else bit 1 (handed off) | 2 (``event`` queued) | 4
        (``event2`` queued); what is not queued is left to the caller."""
        if self.native is not None:
            return self.native.wait_stream(self._gen, timeout_s, self.spin_ns, stream, event, event2)
        return int(self.wait(timeout_s))


_cuda_driver: Any = None


def _graph_launcher() -> Callable[[int, int], int] | None:
    """``cuGraphLaunch(exec, stream)`` of the CUDA driver through ``ctypes.PyDLL``: the call keeps
    the GIL (a few microseconds), where ``torch.cuda.CUDAGraph.replay`` releases it and the worker
    then waits to take it back from the launching thread (0.19-0.24 ms per layer measured in the
    step benchmark, 2026-12-02). None where the driver library does not load."""
    global _cuda_driver
    if _cuda_driver is None:
        import ctypes

        try:
            lib = ctypes.PyDLL("libcuda.so.1")
            fn = lib.cuGraphLaunch
        except (OSError, AttributeError):
            _cuda_driver = False
        else:
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
            _cuda_driver = fn
    return _cuda_driver or None


class LaunchGraphs:
    """One CUDA graph per (token count, output address) of a table's one-piece launch: the H2D
    copy of selectors + packed rows from the pinned staging buffer, the split into the kernel's
    weight/scale tables and vLLM's kernel into ``staged_rows``, replayed as one launch instead of
    five Python-level launches (each of which contends for the GIL with the launching thread
    while it replays the step's graphs).

    ``launch(rows, out)``: the eager sequence for ``rows`` selectors into ``out`` with every row
    slot copied (so the graph does not depend on how many rows a step fetched). The worker calls
    ``replay`` first; on a miss it runs ``launch`` eagerly (which also loads and specializes the
    kernel); at the table's next start the launching thread (``RemoteRows._capture_pending``;
    never the worker, whose capture could overlap a device-wide synchronize of
    the launching thread) calls ``capture``, which records the same sequence on a private stream
    in thread-local capture mode (the worker's CUDA calls meanwhile are not affected).
    A failed capture disables the graphs of this table (``failures``; the eager path stays exact).
    ``clear()`` drops them (the staging buffers were replaced). ``record(rows, out)``: returns an
    object whose ``replay()`` repeats the launch on the current stream (default: a
    ``torch.cuda.CUDAGraph``, ``cuda_graph``; tests on the CPU pass a recorder). Counters:
    ``replays``, ``captures``, ``failures``, ``capture_s``.
    """

    def __init__(
        self,
        device: Any,
        launch: Callable[[int, Any], None],
        enabled: bool,
        record: Callable[[int, Any], Any] | None = None,
        on_change: Callable[[list], None] | None = None,
    ) -> None:
        self.device, self._launch, self.enabled = device, launch, enabled
        self._on_change = on_change
        self._record = self.cuda_graph if record is None else record
        self._driver = _graph_launcher() if record is None and enabled else None
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._stream: Any = None
        self.counters = {"replays": 0, "captures": 0, "failures": 0, "capture_s": 0.0}

    @staticmethod
    def key(rows: int, out: Any) -> tuple[int, int, int]:
        return rows, out.data_ptr(), out.stride(0)

    def replay(self, rows: int, out: Any, stream: Any = None) -> bool:
        """Replay the graph of ``(rows, out)`` on ``stream`` (a torch stream, the current one);
        False when there is none, or when the driver refused the launch (then the graphs are
        off and the caller launches eagerly)."""
        key = self.key(rows, out)
        g = self._graphs.get(key) if self.enabled else None
        if g is None:
            return False
        self._graphs.move_to_end(key)
        graph, exec_ptr = g
        if exec_ptr is not None and stream is not None:
            rc = self._driver(exec_ptr, stream.cuda_stream)
            if rc != 0:
                self.disable(f"cuGraphLaunch returned CUDA error {rc}")
                return False
        elif stream is not None:  # torch's replay launches on the current stream
            import torch

            with torch.cuda.stream(stream):
                graph.replay()
        else:
            graph.replay()
        self.counters["replays"] += 1
        return True

    def wanted(self, rows: int, out: Any) -> bool:
        return self.enabled and self.key(rows, out) not in self._graphs

    def capture(self, rows: int, out: Any) -> None:
        """Record the launch of ``(rows, out)`` (launching thread, after an eager launch of it)."""
        t0 = time.perf_counter()
        try:
            g = self._record(rows, out)
        except Exception as exc:  # noqa: BLE001 - the eager path stays; one log line
            self.disable(f"cannot capture the Engram launch as a CUDA graph ({type(exc).__name__}: {exc})")
            return
        finally:
            self.counters["capture_s"] += time.perf_counter() - t0
        exec_ptr = None
        if self._driver is not None:
            try:  # torch >= 2.7; older: replay() through torch
                exec_ptr = int(g.raw_cuda_graph_exec()) or None
            except (AttributeError, RuntimeError):
                exec_ptr = None
        self._graphs[self.key(rows, out)] = (g, exec_ptr)
        self.counters["captures"] += 1
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        self._changed()

    def cuda_graph(self, rows: int, out: Any) -> Any:
        """The launch captured on a private stream (nothing runs; no other stream is captured)."""
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            g.capture_begin(capture_error_mode="thread_local")
            try:
                self._launch(rows, out)
            finally:
                g.capture_end()
        return g

    def clear(self) -> None:
        self._graphs.clear()
        self._changed()

    def disable(self, why: str) -> None:
        """Graphs off for this table (a failed capture or launch): counted, logged once, eager
        launches from now on."""
        self.enabled = False
        self._graphs.clear()
        self.counters["failures"] += 1
        log.error("dsv41 overlay: %s; eager launches from now on", why)
        self._changed()

    def launchable(self) -> list[tuple[int, int, int]]:
        """``(rows, staged_rows address, graph exec handle)`` of every graph the C++ core may
        launch itself; a (rows, address) seen with two strides is left to Python's ``replay``."""
        seen: dict[tuple[int, int], int] = {}
        for (rows, ptr, _stride), (_g, exec_ptr) in self._graphs.items():
            k = (rows, ptr)
            seen[k] = 0 if k in seen else (exec_ptr or 0)
        return [(r, p, e) for (r, p), e in seen.items() if e]

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.launchable() if self.enabled else [])


def report_counters(source: Any, rank: int, overlay: dict | None = None) -> dict:
    """Log the row source's counters (and ``overlay``: the pipeline's, ``RemoteRows.overlay_counters``)
    and write them to ``<tmp>/dsv41-overlay-rank<R>.json`` (read by the qualification steps:
    ``docker exec dsv41-serve cat ...``)."""
    c = dict(source.counters(), **(overlay or {}))
    log.info(
        "dsv41 overlay rank %d engram counters: %s",
        rank,
        " ".join(f"{k}={v}" for k, v in sorted(c.items()) if not isinstance(v, float)),
    )
    path = os.path.join(tempfile.gettempdir(), f"dsv41-overlay-rank{rank}.json")
    from dsv41 import fileio

    try:
        fileio.atomic_write_json(
            path, {"rank": rank, "time": time.time(), "counters": c}, indent=None, default=str, nonfinite="null"
        )
    except Dsv41Error as exc:  # a full /tmp must not break serving
        log.warning("dsv41 overlay: cannot write %s: %s", path, exc)
    return c
