"""The rank's Engram row-fetch thread: takes ``RemoteRows`` jobs off the launching
thread, fetches both Engram layers of a step in one request, launches the H2D copy and vLLM's
kernel on the layer's stream and hands each layer off (``dsv41.overlay.engram`` for the whole;
``engram_handback`` for what the C++ core hands back after a fetch or a failure).
"""

from __future__ import annotations

import collections
import threading
import time
from time import perf_counter as _perf
from typing import Any

from dsv41.overlay.engram_handback import Handbacks
from dsv41.overlay.engram_ops import _NoEvent

#: Seconds the worker waits, once the first layer's ids are down, for the step's other Engram
#: layer when the last step had two (both in one request saves a round trip, ~0.1-0.3 ms on
#: loopback tcp; the other layer's start follows the first by tens of microseconds).
COALESCE_S = 0.0005
#: Seconds between two attempts of the lease probe (a thread of its own, never the worker's) to
#: lease a connection for the C++ core while it has none: the server's return is noticed within
#: about this long, and no step ever waits for a connect (the circuit breaker's recovery).
LEASE_RETRY_S = 0.5
#: Seconds the idle C++ core polls its queue (PAUSE loop, no system call) after the end of its
#: last job before it sleeps on its condition variable (``EngramCore.set_idle_spin``): a step's
#: job submitted within it is taken within microseconds whatever the host's wake-up latency
#: (which differs several-fold between otherwise equal hosts). While steps come
#: at least once a second the worker's core stays busy (one core per rank); idle, it costs nothing.
IDLE_SPIN_S = 1.0
#: Nanoseconds ``RemoteRows.join`` polls the hand-off flag before it sleeps on the condition
#: variable (``EngramSlot.wait``): a layer handed off by then costs no sleep and wake-up.
JOIN_SPIN_NS = 20_000
#: Seconds between two counter reports (log line + JSON file) of one rank.
REPORT_EVERY_S = 60.0
#: Rows of one piece of a lookup (plan, fetch, H2D, kernel): a decode step is one piece; a 32K
#: prefill chunk at TP2 (393,216 rows) six, whose copies and kernels overlap the next fetch.
PIECE_ROWS = 65536
#: Rows of piece 0 of a multi-piece job that the C++ core plans and requests first, alone: the
#: plan of a whole 65,536-row piece would otherwise precede the first request on the wire; the rest of piece 0 is planned by the planner thread while the head's
#: request is in flight and requested next (the same fetch list and rows as one request).
HEAD_ROWS = 8192
#: Rows of a multi-piece job's tail pieces, applied in turn to its last piece (its last ``t`` rows
#: a piece of their own where it is longer than ``t``; the C++ core's ``piece_layout``). What the
#: GPU does after the job's last reply, which layer 1 waits for, is the last piece's H2D copy and
#: kernel, so a short last piece keeps layer 1's wait within its bound; a second, shorter tail
#: piece hides the one before it: a 32K chunk at TP2 (393,216 rows) is five pieces of 65,536, then
#: 49,152, 14,336 and 2,048. The 14,336-row piece's copy and kernel run while the last 2,048 rows
#: are fetched (they take about as long), so only the 2,048 follow the reply (measurements:
#: docs/records/2026-12-07-numbers-from-code-comments.md).
TAIL_ROWS = (16384, 2048)

_workers: dict[int, EngramWorker] = {}
_workers_lock = threading.Lock()


class EngramWorker(Handbacks):
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

    With the C++ extension (``dsv41.overlay._core.EngramCore``) the thread runs the core's
    ``next()`` with the GIL released: the wake-up, the ids wait, the coalescing, the plan, the
    request on a connection the row source lends (``RemoteRowSource.native_lease``), the launch
    graph and the hand-off of a captured size are C++, and so is a multi-piece (prefill) job whose
    piece graphs exist (plan in the fixed piece layout, one pipelined request and one graph launch
    per piece; pieces 1.. are planned by the core's planner thread while the requests before them
    are in flight, ``native_plan_ahead_s``, so planning never delays the wire; piece 0 goes as two
    requests, its first ``HEAD_ROWS`` rows planned and sent at once, the rest planned by the
    planner thread meanwhile); Python serves what the core hands back (no lease, a launch without
    a graph yet, a multi-piece job without piece graphs (the pipeline above, then their capture) or
    planned and fetched on the CPU (``_pieces_back``: Python launches the pieces), a failed request:
    ``lease_failed`` serves the exact local rows or raises in required mode (a multi-piece job is
    then served again whole), a failed CUDA call: graphs off, eager launches). The circuit
    breaker (no Python hop per job while the server is down): where the table's exact local shard can be mapped (``_register``), a job without a
    connection, or whose request failed, is filled from it in C++ (``native_local_jobs``; a
    failed request is then handed back only to close the connection and count it,
    ``local_fills_after_failure``), and the lease probe thread (``_probe_loop``, every
    ``LEASE_RETRY_S``) offers the core a new connection (``lease_probes_offered``,
    ``native_offers_adopted``). ``counters`` then also carries
    the core's ``native_*`` counts, and ``jobs``, ``requests``, ``wake_s``, ``ids_wait_s``,
    ``plan_s``, ``launch_s``, ``fetch_s``, ``host_s`` are the sums of both paths. Without the
    extension the thread is the Python loop above.
    """

    def __init__(self, source: Any, rank: int, ops: Any) -> None:
        from dsv41.engram.client import CHUNK_ROWS

        self.source, self.rank, self.ops = source, rank, ops
        self.chunk_rows = CHUNK_ROWS
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.retired = False
        # Layers started and not yet joined (launching thread); the largest such count of the
        # last step is how many jobs a step brings: both Engram layers start before either joins.
        self._open = self._burst = self._joins = 0
        self.expect = 1
        self._c = {
            "wake_s": 0.0,
            "ids_wait_s": 0.0,
            "coalesce_waits": 0,
            "coalesce_s": 0.0,
            "plan_s": 0.0,
            "launch_s": 0.0,
            "jobs": 0,
            "requests": 0,
            "multi_layer_requests": 0,
            "errors": 0,
            "fetch_s": 0.0,
            "host_s": 0.0,
        }
        self.core = _new_core(self.chunk_rows)
        self._tables: dict[int, Any] = {}  # EngramSlot key -> RemoteRows (native path)
        self._lease: dict | None = None  # lent to the core or offered to it (guarded by _llock)
        self._llock = threading.Lock()
        self._probe_wake = threading.Event()
        self.probe: threading.Thread | None = None
        if self.core is not None and hasattr(source, "add_counters"):
            source.add_counters(self.core.source_counters)
        run = self._run if self.core is None else self._run_native
        self.thread = threading.Thread(target=run, name=f"dsv41-engram-worker-{rank}", daemon=True)
        self.thread.start()

    @property
    def counters(self) -> dict:
        """The worker's counters (see the class); with the C++ core, both paths summed."""
        c = dict(self._c)
        if self.core is not None:
            n = self.core.counters()
            c.update(n)
            for k in ("jobs", "requests", "multi_layer_requests", "coalesce_waits"):
                c[k] += n[f"native_{k}"]
            for k in ("wake", "ids_wait", "coalesce", "plan", "launch", "fetch", "host"):
                c[f"{k}_s"] += n[f"native_{k}_s"]
        return c

    def alive(self) -> bool:
        """Whether the thread runs and was not retired."""
        return not self.retired and self.thread.is_alive()

    def submit(self, rows: Any, gen: int) -> None:
        """Queue one layer's job (``gen``: the job's generation, see ``RemoteRows.start``).
        Launching thread only (as ``joined``)."""
        self._open += 1
        self._burst = max(self._burst, self._open)
        if self.core is not None:
            slot = rows._slot
            if slot.key not in self._tables:
                self._register(rows)
            ops = rows.ops
            ev = getattr(ops, "event_handle", _no_handle)  # ops without raw handles: no CUDA
            st = getattr(ops, "stream_handle", _no_handle)
            # an ids event without a raw handle that may block (tests' stand-ins) is waited by Python
            py_wait = not rows._cuda and not isinstance(rows.ids_ready, _NoEvent)
            self.core.submit(
                slot.native,
                gen,
                rows._rows,
                rows._out.data_ptr(),
                st(rows._stream),
                ev(rows.ids_ready),
                ev(rows.done),
                rows._cuda,
                py_wait,
                self.expect,
                COALESCE_S,
            )
            return
        with self._cond:
            self._queue.append((rows, gen, time.perf_counter()))
            self._cond.notify()

    def submit_gj(self, rows: Any, gen: int, bound_s: float) -> int:
        """Queue a GPU-joined job (``engram_gpujoin``): ``EngramCore.submit_gj``
        checks the slot, queues the job's GPU side on its stream (``EngramSlot.gj_queue``) and hands
        it to the core and its watchdog (``bound_s``: the watchdog's bound, seconds). Returns 0
        (nothing queued: serve it on the host path), 1 (queued) or -1 (the GPU side queued in part:
        the core still releases it; serve it again after, ``GpuJoin.join``). Launching thread only."""
        slot = rows._slot
        if slot.key not in self._tables:
            self._register(rows)
        ops = rows.ops
        q = int(
            self.core.submit_gj(
                slot.native,
                gen,
                rows._rows,
                rows._out.data_ptr(),
                ops.stream_handle(rows._stream),
                ops.event_handle(rows.done),
                PIECE_ROWS,
                TAIL_ROWS,
                bound_s,
                self.expect,
            )
        )
        if q:
            self._open += 1
            self._burst = max(self._burst, self._open)
        return q

    def joined(self) -> None:
        """One started layer was joined; when none is open, the step's number of layers becomes
        the number the worker waits for (at most ``COALESCE_S``, and never past a join: the
        launching thread has then left the step's starts) before it fetches."""
        self._open -= 1
        if self._open <= 0:
            self._open, self.expect, self._burst = 0, self._burst, 0
        if self.core is not None:
            self.core.joined(self.expect)
            return
        with self._cond:  # a join means no more layers of this step are coming: stop waiting
            self._joins += 1
            self._cond.notify()

    def retire(self) -> None:
        """Stop taking jobs (a hung worker is replaced; it exits once its call returns)."""
        with self._cond:
            self.retired = True
            self._cond.notify()
        self._probe_wake.set()
        if self.core is not None:
            self.core.retire()

    def _register(self, rows: Any) -> None:
        """A table first seen by this worker (launching thread, before its first job reaches
        the core): its identity and range into its slot (from the source's manifest, the same a
        lease names), its exact local rows where the core can read them (``engram_gpujoin.
        local_table``: the fill without a connection, or after a failed request, stays in C++)
        and its key into the worker's map."""
        from dsv41.overlay.engram_gpujoin import local_table, set_local

        tables_fn = getattr(self.source, "native_tables", None)
        tables = tables_fn() if tables_fn is not None else {}
        if tables:
            rows._slot.set_table(tables)
        loc = local_table(self.source, rows.layer_id) if tables else None
        if loc is not None:
            try:
                set_local(rows._slot.native, loc, rows)
            except (RuntimeError, OSError, ValueError) as exc:
                from dsv41.overlay.engram_ops import log

                log.warning(
                    "dsv41 overlay layer %d: the local rows cannot be mapped for the core (%s); a step "
                    "without a connection is served by Python's local reader",
                    rows.layer_id,
                    exc,
                )
        self._tables[rows._slot.key] = rows

    def _new_lease(self) -> dict | None:
        lease_fn = getattr(self.source, "native_lease", None)
        return lease_fn() if lease_fn is not None else None

    def _first_lease(self) -> None:
        """The worker thread's lease at its start (the server is normally up), then the probe."""
        lease = self._new_lease()
        if lease is not None:
            with self._llock:
                self._lease = lease
            self.core.lend(lease["fd"], lease["gen"], lease["version"], lease["timeout_ns"], lease["spin_ns"])
        self.probe = threading.Thread(target=self._probe_loop, name=f"dsv41-engram-probe-{self.rank}", daemon=True)
        self.probe.start()

    def _probe_loop(self) -> None:
        """The circuit breaker's probe: while the core has no connection (never had one, or its
        request failed: the core fills from the local rows meanwhile), every ``LEASE_RETRY_S`` a
        lease is asked of the row source (a connect and HELLO, bounded by the source's timeout, on
        this thread) and offered to the core, which adopts it before its next job."""
        while not self.retired:
            self._probe_wake.wait(LEASE_RETRY_S)
            if self.retired:
                return
            with self._llock:
                if self._lease is not None:
                    continue
            lease = self._new_lease()
            if lease is None:
                continue
            with self._llock:
                if self.retired or self._lease is not None:
                    lease["client"].close()
                    continue
                self._lease = lease
                self.core.offer(lease["fd"], lease["gen"], lease["version"], lease["timeout_ns"], lease["spin_ns"])
            self._c["lease_probes_offered"] = self._c.get("lease_probes_offered", 0) + 1

    def _lost_lease(self) -> dict | None:
        """The lease whose request failed (the core dropped it): the probe may offer another."""
        with self._llock:
            lease, self._lease = self._lease, None
        return lease

    def _drop_lease(self) -> None:
        self.core.revoke()
        lease = self._lost_lease()
        if lease is not None:
            lease["client"].close()

    def _run_native(self) -> None:
        """The C++ core's loop (see the class): Python only for what the core hands back."""
        from dsv41.overlay.engram_ops import (
            CORE_CUDA_FAILED,
            CORE_FAILED,
            CORE_FETCHED,
            CORE_GJ_FAILED,
            CORE_PIECES_FAILED,
            CORE_PIECES_FETCHED,
            CORE_PYTHON,
            CORE_PYTHON_IDS,
            CORE_REPORT,
            CORE_RETIRED,
        )

        self.ops.bind_thread()
        core, tables, c = self.core, self._tables, self._c
        core.set_idle_spin(IDLE_SPIN_S)
        try:
            self._first_lease()
            while True:
                status, jobs, code, rcount = core.next()
                if status == CORE_RETIRED:
                    return
                batch = [(tables[key], gen, n) for key, gen, n in jobs]
                if code and status in (CORE_REPORT, CORE_FETCHED, CORE_CUDA_FAILED):
                    self._filled_after_failure(batch, code, rcount)  # the rows are local and exact already
                if status == CORE_REPORT:
                    for rows, _, _ in batch:
                        rows._maybe_report()
                elif status == CORE_PYTHON:
                    self._serve([(rows, gen) for rows, gen, _ in batch])
                elif status == CORE_PYTHON_IDS:  # as the Python loop: ids wait, then the step's others
                    rows, gen, _ = batch[0]
                    t0 = _perf()
                    rows._wait_ids()
                    t1 = _perf()
                    c["ids_wait_s"] += t1 - t0
                    more = [(tables[key], g) for key, g, _ in core.coalesce(rows._rows)]
                    c["coalesce_s"] += _perf() - t1
                    self._serve([(rows, gen)] + more)
                elif status in (CORE_PIECES_FETCHED, CORE_PIECES_FAILED):
                    self._pieces_back(status, batch[0], code, rcount)
                elif status == CORE_GJ_FAILED:
                    self._gj_failed(batch[0], code, rcount)
                else:
                    t0 = _perf()
                    try:
                        if status == CORE_FAILED:
                            batch = self._lease_failed(batch, code, rcount)
                        elif status == CORE_CUDA_FAILED:
                            c["errors"] += 1
                            for rows, _, _ in batch:
                                rows.graphs.disable("a graph launch or event record of the C++ core failed")
                        else:
                            assert status == CORE_FETCHED, status
                        self._launch_fetched(batch)
                    finally:
                        c["host_s"] += _perf() - t0
        finally:
            if self._lease is not None:
                self._drop_lease()

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
            self._c["wake_s"] += time.perf_counter() - t_sub
            batch = [(rows, gen)]
            t0 = time.perf_counter()
            rows._wait_ids()
            t1 = time.perf_counter()
            self._c["ids_wait_s"] += t1 - t0
            with cond:  # the step's other layers: queued meanwhile, or due within COALESCE_S
                if len(q) + 1 < self.expect and rows._rows <= self.chunk_rows:
                    self._c["coalesce_waits"] += 1
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
            self._c["coalesce_s"] += time.perf_counter() - t1
            self._serve(batch)

    def _serve(self, batch: list) -> None:
        t0 = time.perf_counter()
        fetch0 = self._c["fetch_s"]
        try:
            self._serve_batch(batch)
        finally:  # host work = the batch's time minus the row source's
            self._c["host_s"] += time.perf_counter() - t0 - (self._c["fetch_s"] - fetch0)

    def _serve_batch(self, batch: list) -> None:
        c = self._c
        ready = []
        for rows, gen in batch:
            try:
                rows._wait_ids()
                ready.append((rows, gen))
            except Exception as exc:  # noqa: BLE001 - handed to the launching thread
                c["errors"] += 1
                rows._handoff(gen, exc)
        c["jobs"] += len(ready)
        if len(ready) > 1 and sum(r._rows for r, _ in ready) <= self.chunk_rows:
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
        c = self._c
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
                    self.source.lookup_layers(
                        [r.layer_id for r, _, _ in fetched],
                        [r._fetch[:n] for r, _, n in fetched],
                        [r._packed(0, n) for r, _, n in fetched],
                    )
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
        self._launch_fetched(jobs)


def _no_handle(_obj: Any) -> int:
    return 0


def _new_core(chunk_rows: int) -> Any:
    """The C++ core (``dsv41.overlay._core.EngramCore``) where the extension is built, else None."""
    from dsv41.overlay import core

    if not core.use_core():
        return None
    return core._core.EngramCore(chunk_rows, PIECE_ROWS, REPORT_EVERY_S, HEAD_ROWS, TAIL_ROWS)


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
