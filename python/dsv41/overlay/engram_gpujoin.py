"""The GPU-side join of an Engram layer (issue 23 pass N): ``RemoteRows.join`` of a layer the
worker has not handed off yet queues, on the current stream, a wait until the table's device
flag holds the job's generation (``cuStreamWaitValue64``, GEQ) and the wait on vLLM's event, and
returns at once: the launching thread does not wait on the host. The worker queues the flag's
write (``cuStreamWriteValue64``) on the prefetch stream after the layer's last copy and kernel
(the C++ core right after the hand-off, so a host join does not wait for it; Python's launches
just before), so the GPU itself releases the main stream when the rows are written.

Only where it can be right: ``RemoteRows.gpu_join`` (``DSV41_ENGRAM_GPU_JOIN``, default 1), not
in required mode (``DSV41_ENGRAM_REMOTE_REQUIRED=1``: the join waits on the host so that the cause
of a failure is raised on the launching thread at ``_finish_prefetch``), a job the worker took
(not one served inline), the C++ slot and the driver's 64-bit stream memory operations
(``_fastrow.stream_mem_ops``, ``CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS``; a refused
first wait turns it off for the table). A layer already handed off (decode) joins on the host
as before.

Failure: a worker that dies or hangs must not hang the GPU. Every deferred join is watched
(``Watchdog``, one thread per process, started at the first deferred join): a job whose worker
died (noticed within ``WATCH_POLL_S``) or did not hand it off within ``handoff_timeout_s`` is
taken from the worker (``Handoff.take``: it launches nothing more of it) and its exact rows are
served by the thread that noticed, as ``join``'s refusal does (the row source: remote, or its
local fallback; counted as a refusal: ``worker_refusals`` / ``handoff_timeouts``,
``refused_inline``, plus ``watchdog_served``), on a stream of its own that first waits for what
the worker had queued, and then that stream writes the flag. A job handed off with an error is
served the same way and its error is raised at the table's next ``start`` on the launching
thread; a job handed off without its flag write (a path that could not queue it) gets the flag
written after its done event. The table's next ``start`` settles the deferred job first (on the
launching thread: the worker's hand-off, or the watchdog's serve), so it sees the refusal state as
``join``'s refusal leaves it (no worker: a new one is started), and no buffer is reused while
the job may still read it. The flag only grows: a late write of an older generation releases no
later wait, and a taken job is never launched by its worker (the check under the slot's lock).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dsv41.overlay.engram_ops import log

#: Seconds between two looks of the watchdog at the deferred joins (a dead worker is noticed
#: within this; ``engram_rows.ALIVE_POLL_S`` of the host join).
WATCH_POLL_S = 0.05
#: Seconds the watchdog waits for a worker that is inside a launch of the job it takes.
LAUNCH_LOCK_S = 1.0
#: Seconds a hand-off just seen is given for its flag write (queued by the C++ core right after it).
FLAG_LAG_S = 0.002

OPEN, SERVING, DONE = range(3)


class DeviceFlag:
    """8 bytes of device memory of one table (a zeroed int64 tensor on the rows' device) and the
    C++ slot's stream memory operations on it: ``wait(stream, gen, then)`` (the join),
    ``write(stream, gen)`` (the worker, the watchdog), ``written()`` (the highest generation whose
    write was queued)."""

    def __init__(self, rows: Any) -> None:
        import torch

        self.ops, self.native = rows.ops, rows._slot.native
        self.tensor = torch.zeros(1, dtype=torch.int64, device=rows.device)
        self.native.set_flag(self.tensor.data_ptr())

    @classmethod
    def for_rows(cls, rows: Any) -> "DeviceFlag | None":
        """The flag of ``rows`` where the GPU-side join can run (the C++ slot, a CUDA device
        whose driver has the 64-bit stream memory operations), else None."""
        from dsv41.transport import native

        if rows._slot is None or native._fastrow is None or not hasattr(native._fastrow, "stream_mem_ops"):
            return None
        index = rows.device.index if rows.device.index is not None else 0
        if not native._fastrow.stream_mem_ops(index):
            return None
        return cls(rows)

    def wait(self, stream: Any, gen: int, then: Any = None) -> int:
        """Queue ``stream``'s wait until the flag is >= ``gen``, then on ``then``: 0 not queued,
        1 the flag wait queued, 1 | 4 and the wait on ``then``."""
        ev = self.ops.event_handle(then) if then is not None else 0
        return int(self.native.flag_wait(self.ops.stream_handle(stream), gen, ev))

    def write(self, stream: Any, gen: int) -> bool:
        return bool(self.native.flag_write(self.ops.stream_handle(stream), gen))

    def written(self) -> int:
        return int(self.native.flag_written())

    def set_release_event(self, event: Any) -> None:
        """Record ``event`` (a created CUDA event) right after every flag write (the step
        benchmark's ``ret_gpu_to_b``); None: no more."""
        self.native.set_release_event(0 if event is None else self.ops.event_handle(event))


class Deferred:
    """One deferred join: the table, the job's generation, the worker it went to, the deadline
    of its hand-off; ``state`` OPEN, SERVING (a thread serves it), DONE (``done`` set);
    ``error``: raised at the table's next ``start``; ``kind``: how it ended (``handed``, ``dead``,
    ``timeout``, ``error``, ``flag``)."""

    def __init__(self, rows: Any, gen: int, worker: Any, deadline: float) -> None:
        self.rows, self.gen, self.worker, self.deadline = rows, gen, worker, deadline
        self.lock = threading.Lock()
        self.state = OPEN
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.kind = ""


def can_defer(rows: Any) -> bool:
    """Whether the launching thread's join of ``rows``' started job may wait on the GPU."""
    return (rows.gpu_join and not rows.required and rows._flag is not None and rows._submitted
            and not rows._ho.is_set())


def defer(rows: Any, then: Any) -> bool | None:
    """Queue the current stream's waits on the flag and on ``then`` and hand the job to the
    watchdog; True when the wait on ``then`` was queued, False when the caller waits on it, None
    when the flag wait was not queued (the caller joins on the host; the flag is then off)."""
    cur = rows.ops.current_stream()
    q = rows._flag.wait(cur, rows._gen, then)
    if not q & 1:
        log.error("dsv41 overlay rank %d layer %d: the GPU-side join's stream wait was refused; the joins of "
                  "this table wait on the host from now on", rows.rank, rows.layer_id)
        rows._flag = None
        return None
    rec = Deferred(rows, rows._gen, rows._worker, time.monotonic() + rows.handoff_timeout_s)
    rows._pending = rec
    rows.counters["deferred_joins"] += 1
    watchdog().watch(rec)
    return bool(q & 4)


def settle(rows: Any) -> None:
    """Launching thread, at the table's next ``start``: wait until the deferred job is done (the
    worker's hand-off, or the rows served by whichever thread noticed a failure first) and raise
    its error, if any."""
    rec = rows._pending
    t0 = time.monotonic()
    try:
        while not resolve(rec):
            if rec.state == SERVING:
                rec.done.wait()
                break
            rows._ho.wait(min(WATCH_POLL_S, max(rec.deadline - time.monotonic(), 0.0)))
    finally:
        rows._pending = None
        rows.counters["handoff_wait_s"] += time.monotonic() - t0
    if rec.error is not None:
        err, rec.error = rec.error, None
        raise err


def resolve(rec: Deferred) -> bool:
    """Whether the deferred job is done; serves it here when its worker died, its hand-off is
    overdue, it was handed off with an error or without its flag write (see the module)."""
    rows = rec.rows
    with rec.lock:
        if rec.state != OPEN:
            return rec.state == DONE
        if rows._ho.handed_gen() == rec.gen:
            with rows._lock:
                err, rows._error = (rows._error, None) if rows._gen == rec.gen else (None, rows._error)
            if err is None and rows._flag is not None and _written(rows._flag, rec.gen):
                rec.kind, rec.state = "handed", DONE
                rows.counters["handoffs"] += 1
                rec.done.set()
                return True
            rec.kind, rec.error = ("error", err) if err is not None else ("flag", None)
        else:
            w = rec.worker
            dead = w is None or not w.thread.is_alive()
            if not dead and time.monotonic() < rec.deadline:
                return False
            locked = rows._lock.acquire(timeout=LAUNCH_LOCK_S)  # the worker launches under it
            try:
                if not rows._ho.take(rec.gen):
                    return False  # handed off meanwhile: the next look sees it
            finally:
                if locked:
                    rows._lock.release()
            rec.kind = "dead" if dead else "timeout"
        rec.state = SERVING
    try:
        _serve(rec)
    finally:
        with rec.lock:
            rec.state = DONE
            rec.done.set()
    return True


def _written(flag: DeviceFlag, gen: int) -> bool:
    """Whether ``gen``'s flag write was queued; the C++ core queues it right after the hand-off,
    so a hand-off just seen is given ``FLAG_LAG_S`` for it."""
    end = time.monotonic() + FLAG_LAG_S
    while flag.written() < gen:
        if time.monotonic() >= end:
            return False
        time.sleep(0)
    return True


def _serve(rec: Deferred) -> None:
    """Serve a failed deferred job's exact rows on a stream of its own (after what the worker
    queued), then release the main stream by the flag's write on that stream; the job's stream
    then waits for that stream (the table's next job reuses the device buffers it reads)."""
    rows, ops = rec.rows, rec.rows.ops
    job, side = rows._stream, None
    try:
        ops.bind_thread()
        side = rows._side_stream()
        if side is not None:
            ev = ops.event()
            ev.record(job)  # after whatever the worker queued for the job
            side.wait_event(ev)
        if rec.kind == "flag":  # rows written, the flag's write missing: after the done event
            if side is not None:
                side.wait_event(rows.done)
            return
        if rec.kind in ("dead", "timeout"):
            cause = rows._refusal(rec.worker)
        else:
            cause = f"the rank's Engram worker handed the job off with an error ({type(rec.error).__name__})"
            rows.counters["deferred_errors"] += 1
        log.error("dsv41 overlay rank %d layer %d: %s; serving this step's rows on thread %s (GPU-side join)",
                  rows.rank, rows.layer_id, cause, threading.current_thread().name)
        rows.counters["refused_inline"] += 1
        rows.counters["watchdog_served"] += 1
        rows._stream = side if side is not None else job
        rows._wait_ids()
        rows._serve(None, rows.counters)
    except Exception as exc:  # noqa: BLE001 - raised at the table's next start; the GPU is released
        log.error("dsv41 overlay rank %d layer %d: serving a deferred join's rows failed (%s: %s); the error is "
                  "raised at the next start", rows.rank, rows.layer_id, type(exc).__name__, exc)
        if rec.error is None:
            rec.error = exc
    finally:
        rows._stream = job
        flag = rows._flag
        if flag is None or not flag.write(side if side is not None else job, rec.gen):
            log.error("dsv41 overlay rank %d layer %d: cannot write the GPU-side join's flag", rows.rank,
                      rows.layer_id)
        if side is not None and job is not None:
            try:
                ev = ops.event()
                ev.record(side)
                job.wait_event(ev)
            except Exception as exc:  # noqa: BLE001 - logged; the flag is written
                log.error("dsv41 overlay: the job's stream cannot wait for the watchdog's (%s)", exc)


class Watchdog:
    """The process's watcher of deferred joins: a daemon thread that looks at every open one
    each ``WATCH_POLL_S`` (``resolve``) and forgets those done."""

    def __init__(self) -> None:
        self._open: list[Deferred] = []
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="dsv41-engram-watchdog", daemon=True)
        self.thread.start()

    def watch(self, rec: Deferred) -> None:
        with self._lock:
            self._open.append(rec)

    def pending(self) -> int:
        with self._lock:
            return len(self._open)

    def look(self) -> None:
        """One look at every open deferred join (the thread's loop; tests call it directly)."""
        with self._lock:
            recs = list(self._open)
        done = []
        for rec in recs:
            try:
                if resolve(rec):
                    done.append(rec)
            except Exception:  # noqa: BLE001 - the watchdog never dies
                log.exception("dsv41 overlay: the Engram watchdog failed on a deferred join")
        with self._lock:
            self._open = [r for r in self._open if r not in done and r.state != DONE]

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_POLL_S)
            self.look()


_watchdog: Watchdog | None = None
_watchdog_lock = threading.Lock()


def watchdog() -> Watchdog:
    """The process's watchdog (started at the first deferred join)."""
    global _watchdog
    with _watchdog_lock:
        if _watchdog is None or not _watchdog.thread.is_alive():
            _watchdog = Watchdog()
        return _watchdog
