"""The GPU-side join of a prefill chunk's Engram layer (docs/gpu.md, "The GPU-side join on
host-mapped flags"): ``RemoteRows.start`` queues the whole job on the prefetch stream, so
``_finish_prefetch`` waits on nothing on the host.

At ``start``, for a job of several pieces whose piece graphs exist (a size seen before), the
launching thread queues on the job's stream, after the ids' D2H copy into pinned memory:

* ``cuStreamWriteValue64_v2`` of the job's generation into the table's host-mapped **ids word**;
* for each piece of the fixed piece layout (``RemoteRows._piece_keys``): ``cuStreamWaitValue64_v2``
  (GEQ) on that piece's host-mapped **flag**, then the piece's captured graph (the H2D copy of its
  pinned staging and vLLM's kernel);
* the layer's done event, which ``join`` makes the current stream wait on (no host wait).

The worker (the C++ ``EngramCore``, GIL released) then makes **no CUDA call** for the job: it polls
the ids word, plans, fetches each piece into the pinned staging and release-stores the piece's
flag once its rows are in. The words live in 4 KiB of ``cuMemHostAlloc`` DEVICEMAP memory per
table. A device flag written by the worker's driver calls deadlocks behind a ``cudaFree`` on
the launching thread; a host-mapped word stored by the CPU released the stream in every case the
probe tried (``tests/gpu/memop_release_probe.py hostflag``).

Failures stay exact without the GIL and without the driver:

* no lent connection, a failed request (transport error, refusal, timeout; a killed server): the
  worker fills every piece not released yet from the exact local rows in C++ (the shard mapped
  read-only, a memcpy gather of ``weight_offset + id * 256`` and ``scale_offset + id * 8``, the
  bytes ``LocalRowReader.read`` packs) and stores the flags; counted (``gj_fallback_jobs``); a
  job filled for want of a connection stays in C++: the worker's lease probe (its own thread,
  ``EngramWorker._probe_loop``, every ``LEASE_RETRY_S``) offers the core a connection once the
  server answers, adopted before the next job (the lease is retried by Python, never by a step);
* a dead, retired, hung or busy worker: the C++ watchdog thread (one per process) claims a job
  still unclaimed ``WATCHDOG_S`` after it first saw the job's ids word, fills it from the local rows
  and stores the flags (``gj_takeovers``). A per-job compare-and-swap decides which of the two
  serves it, so exactly one fills and stores.

Only where it can be exact and bounded (``GpuJoin.for_rows``): ``DSV41_ENGRAM_GPU_JOIN=1``, a CUDA
table with the C++ slot, the driver's v2 stream memory operations (``_core.stream_mem_ops``),
not required mode, no fault delay, and the table's exact local rows (the row source's local
shard, its regions of 256 + 8 bytes, the rank's range inside the table). **Required mode**
(``DSV41_ENGRAM_REMOTE_REQUIRED=1``) always joins on the host: its contract is that the cause of
a failed remote read is raised at that step's ``_finish_prefetch``, and a GPU that already waits
could only learn of it after the step used the rows (which then must still be filled to release
the stream, i.e. local rows: what required mode forbids). Decode jobs (one piece) and a size's
first prefill chunk (no piece graphs yet) keep the host join.
"""

from __future__ import annotations

import time
from typing import Any

from dsv41.overlay.engram_ops import log

#: Seconds the watchdog gives the worker, from its first sight of a job's ids word (the GPU then
#: waits on the job's flags), to claim the job before it serves the job itself from the local rows.
#: The worker takes a job within microseconds unless it is busy with the job before (at most that
#: job's fetch, bounded by the lookup deadline, ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``, 1 s by default)
#: or dead; an early takeover costs time, never exactness.
WATCHDOG_S = 2.0
#: Seconds ``join`` waits on the host, after a partly queued job (a driver call failed in
#: ``gj_queue``), for the core to release it before it serves the job again on the host.
REDO_WAIT_S = 30.0


def local_table(source: Any, layer_id: int) -> tuple[str, int, int, int] | None:
    """``(shard path, weight_offset, scale_offset, rows)`` of ``layer_id``'s exact local rows
    behind ``source`` (a ``RemoteRowSource`` whose ``local`` is a ``LocalRowSource`` over a
    ``LocalRowReader``), or None where the C++ fallback cannot serve them exactly (no local
    reader, a fault delay, a row layout other than 256 + 8 bytes)."""
    if getattr(source, "fault_delay_s", 0) or getattr(source, "required", False):
        return None
    local = getattr(source, "local", None)
    if local is None or getattr(local, "fault_delay_s", 0):
        return None
    reader = getattr(local, "reader", None)
    tables = getattr(reader, "tables", None)
    if not isinstance(tables, dict) or layer_id not in tables:
        return None
    t = tables[layer_id]
    if (t.row_bytes, t.weight_bytes, t.scale_bytes) != (264, 256, 8):
        return None
    return str(reader.data_dir / t.file), int(t.weight_offset), int(t.scale_offset), int(t.rows)


def set_local(native: Any, loc: tuple[str, int, int, int], rows: Any) -> None:
    """The C++ slot ``native``'s exact local rows: ``loc`` (:func:`local_table`), read as ``rows``'
    ``local_reader`` says (``settings.LocalReader``; its defaults where ``rows`` has none).
    RuntimeError (unusable shard) or ValueError (bad options) from the extension."""
    from dsv41.overlay.settings import LocalReader

    opts = getattr(rows, "local_reader", None) or LocalReader()
    native.set_local(*loc, **opts.kwargs())


def available(device_index: int) -> bool:
    """Whether the C++ extension is built and the driver has the v2 stream memory operations on
    CUDA device ``device_index``."""
    from dsv41.overlay import core

    f = core._core if core.use_core() else None
    return bool(f is not None and hasattr(f, "stream_mem_ops") and f.stream_mem_ops(device_index))


class GpuJoin:
    """One table's GPU-side join (see the module): ``start(worker, gen)`` at ``RemoteRows.start``,
    ``join(then)`` at its ``join``; counters in ``rows.counters`` (``gpu_joins``,
    ``gpu_join_redos``) and the C++ slot's (``counters()``: ``gj_jobs``, ``gj_fallback_jobs``,
    ``gj_fallback_rows``, ``gj_takeovers``, ``gj_bad_pieces``)."""

    def __init__(self, rows: Any, watchdog_s: float = WATCHDOG_S) -> None:
        self.rows = rows
        self.native = rows._slot.native
        self.watchdog_s = float(watchdog_s)
        self._ready: bool | None = None  # None: set up at the first eligible start
        self._redo = False
        self._gen = 0
        rows.counters.setdefault("gpu_joins", 0)
        rows.counters.setdefault("gpu_join_redos", 0)

    @classmethod
    def for_rows(cls, rows: Any, enabled: bool) -> GpuJoin | None:
        """The table's GPU-side join where it can run (see the module), else None."""
        if not enabled or rows.required or rows._slot is None or not rows._cuda or not rows.ops.graphs:
            return None
        index = rows.device.index if rows.device.index is not None else 0
        if not available(index):
            log.warning(
                "dsv41 overlay layer %d: DSV41_ENGRAM_GPU_JOIN=1 but the driver has no v2 stream memory "
                "operations (or the C++ extension is not built): joins wait on the host",
                rows.layer_id,
            )
            return None
        if local_table(rows.source, rows.layer_id) is None:
            log.warning(
                "dsv41 overlay layer %d: DSV41_ENGRAM_GPU_JOIN=1 but the row source has no exact local rows "
                "the C++ fallback can read: joins wait on the host",
                rows.layer_id,
            )
            return None
        return cls(rows)

    def _setup(self) -> bool:
        """Once, on the launching thread (the CUDA context current): the host-mapped words, the
        local rows' mapping, the watchdog's thread."""
        from dsv41.overlay import core

        rows = self.rows
        try:
            loc = local_table(rows.source, rows.layer_id)
            ok = loc is not None and bool(self.native.gj_setup()) and bool(core._core.gj_watch_start())
            if ok:
                set_local(self.native, loc, rows)
        except (RuntimeError, OSError, ValueError) as exc:
            log.error(
                "dsv41 overlay layer %d: the GPU-side join cannot be set up (%s); joins wait on the host",
                rows.layer_id,
                exc,
            )
            ok = False
        if not ok:
            log.warning(
                "dsv41 overlay layer %d: the GPU-side join is off (no host-mapped memory, local rows or "
                "watchdog thread); joins wait on the host",
                rows.layer_id,
            )
        return ok

    def start(self, worker: Any, gen: int) -> bool:
        """Queue job ``gen`` (``rows``' current job: its ids' D2H copy already queued on its stream)
        on the GPU and hand it to the worker's core; False (nothing queued) when it cannot be:
        no piece graphs for the size yet, the slot not ready (no lease named the table yet), the
        core missing. Launching thread only."""
        rows = self.rows
        core = getattr(worker, "core", None)
        if core is None or not hasattr(core, "submit_gj"):
            return False
        if self._ready is None:
            self._ready = self._setup()
        if not self._ready or not self.native.gj_ready():
            return False
        # checks, the GPU side and the hand-off to the core in one C++ call: once the stream waits
        # on the job's flags, the core (or its watchdog) has the job and releases them
        q = worker.submit_gj(rows, gen, self.watchdog_s)
        if q == 0:
            return False
        self._gen = gen
        self._redo = q < 0
        if self._redo:
            rows.counters["gpu_join_redos"] += 1
            log.error(
                "dsv41 overlay layer %d: queueing the GPU-side join failed part way; this job is served again "
                "on the host and the GPU-side join is off",
                rows.layer_id,
            )
            self._ready = False
        rows.counters["gpu_joins"] += 1
        return True

    def join(self, then: Any = None) -> bool:
        """The current stream waits for the job's done event (and ``then``, vLLM's event, when
        given): True when the wait on ``then`` was queued. A partly queued job is waited for on
        the host (its flags released by the core), then served again on the host, exactly."""
        rows, ops = self.rows, self.rows.ops
        cur = ops.current_stream()
        if self._redo:
            self._redo = False
            end = time.monotonic() + REDO_WAIT_S
            while self.native.gj_done() < self._gen and time.monotonic() < end:
                time.sleep(0.0005)
            rows._stream.synchronize()
            rows._serve_inline()
            cur.wait_event(rows.done)
            return False
        ev2 = ops.event_handle(then) if then is not None else 0
        bits = self.native.gj_stream_waits(ops.stream_handle(cur), ops.event_handle(rows.done), ev2)
        if not bits:
            cur.wait_event(rows.done)
            return False
        return bool(bits & 4)

    def counters(self) -> dict:
        """The C++ slot's GPU-join counters (see the class)."""
        return dict(self.native.gj_counters())
