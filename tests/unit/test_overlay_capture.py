"""No capture of the overlay overlaps a device-wide synchronize of the launching thread. A run on
the GPU failed when the worker thread captured a new size's launch graph (after
the hand-off) while the benchmark's launching thread called ``torch.cuda.synchronize()``: the
synchronize raised "operation not permitted when stream is capturing" and invalidated the capture.
On the CPU the capture window and the synchronize are emulated (``Window``): a record that holds
its capture open for ``hold_s`` and a synchronize that fails, as CUDA's does, while any capture is
open on another thread."""

from __future__ import annotations

import threading
import time

import torch

from dsv41.overlay import engram as E
from overlayutil import (  # noqa: F401
    Gate,
    StepOps,
    exact_rows as _exact,
    lookup_ids as _ids,
    poisoned as _poisoned,
    remote_rows as _rows,
    tabs,
)


class Window:
    """``graph_record`` whose capture stays open ``hold_s`` seconds (a real capture takes about
    a millisecond; the hold makes an overlap certain where one can happen), and ``synchronize``,
    the stand-in for ``torch.cuda.synchronize()``: it raises while a capture is open on another
    thread (CUDA: cudaErrorStreamCaptureUnsupported) and marks that capture invalidated."""

    def __init__(self, hold_s: float = 0.02) -> None:
        self.hold_s = hold_s
        self.rr = None
        self.open_on: threading.Thread | None = None
        self.invalidated = 0
        self.records: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def __call__(self, rows, out):
        with self.lock:
            self.open_on = threading.current_thread()
        try:
            time.sleep(self.hold_s)
            with self.lock:
                if self.invalidated:
                    raise RuntimeError("operation failed due to a previous error during capture")
        finally:
            with self.lock:
                self.open_on = None
        self.records.append((rows, threading.current_thread().name))
        rr = self.rr

        class Graph:
            def replay(self) -> None:
                rr._launch_one(rows, out)

        return Graph()

    def synchronize(self) -> None:
        with self.lock:
            if self.open_on is not None and self.open_on is not threading.current_thread():
                self.invalidated += 1
                raise RuntimeError("operation not permitted when stream is capturing")


def _workers():
    E.stop_workers()


def test_a_synchronize_right_after_each_sizes_steps_never_meets_a_capture(tabs) -> None:
    """Every size's first step launches eagerly; its graph is captured at the next start of that
    table, on the launching thread, before the job goes to the worker; a synchronize right after
    every join (the step benchmark's warm-up does one) never fails, no capture is invalidated,
    every size is captured once and replayed after, and the rows stay exact (both layers of a
    step started before either joins, as in vLLM)."""
    try:
        src = Gate(tabs)
        ops = StepOps()
        w1, w14 = Window(), Window()
        r1 = _rows(tabs, src, 1, ops=ops, graph_record=w1, max_tokens=96)
        r14 = _rows(tabs, src, 14, ops=ops, graph_record=w14, max_tokens=96)
        w1.rr, w14.rr = r1, r14
        buf1, buf14 = _poisoned(96, r1.part), _poisoned(96, r14.part)
        for step, t in enumerate((24, 24, 24, 48, 48, 96, 96, 96, 24)):
            ids1, ids14 = _ids(tabs, r1, t, 300 + step), _ids(tabs, r14, t, 400 + step)
            buf1.fill_(float("nan"))
            buf14.fill_(float("nan"))
            r1.start(torch.from_numpy(ids1), buf1[:t])
            r14.start(torch.from_numpy(ids14), buf14[:t])
            r1.join()
            w1.synchronize()
            w14.synchronize()
            r14.join()
            w1.synchronize()  # raises if a capture of either table is still open on another thread
            w14.synchronize()
            assert _exact(tabs, r1, ids1, buf1[:t]) and _exact(tabs, r14, ids14, buf14[:t]), step
        main = threading.main_thread().name
        for w, rr in ((w1, r1), (w14, r14)):
            assert w.invalidated == 0
            assert w.records == [(t * rr.part, main) for t in (24, 48, 96)]
            c = rr.overlay_counters()
            g = f"layer{rr.layer_id}_graph_"
            assert c[g + "captures"] == 3 and c[g + "failures"] == 0 and rr.graphs.enabled
            assert c[g + "replays"] == 6  # every step but each size's first (3 of 9)
    finally:
        _workers()


def test_the_worker_never_captures_even_when_the_next_start_never_comes(tabs) -> None:
    """A size seen once and never again: nothing is captured (no start follows), in particular
    not by the worker after its hand-off, so no capture window is left open behind a join."""
    try:
        src = Gate(tabs)
        w = Window(hold_s=0.05)
        rr = _rows(tabs, src, 14, ops=StepOps(), graph_record=w)
        w.rr = rr
        ids = _ids(tabs, rr, 24, 7)
        out = _poisoned(24, rr.part)
        rr.lookup(torch.from_numpy(ids), out)
        for _ in range(10):  # 50 ms: a worker capture after the hand-off would be open meanwhile
            w.synchronize()
            time.sleep(0.005)
        assert w.records == [] and w.invalidated == 0 and _exact(tabs, rr, ids, out)
        assert rr._capture is not None  # pending: the next start captures it
    finally:
        _workers()
