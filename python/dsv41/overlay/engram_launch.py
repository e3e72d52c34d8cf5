"""The launches of one Engram table's job (``RemoteRows``, ``dsv41.overlay.engram_rows``): the
one-piece launch (eager, or the size's launch graph), the fixed piece layout of a multi-piece job
and its pieces, the capture of their graphs on the launching thread, and the worker's lock around
each launch (the check that the job was not refused, taken by the GPU-side join's watchdog or
made stale meanwhile, the launch, the done event and the device flag's write: ``_job_lock``).
"""

from __future__ import annotations

from typing import Any

from dsv41.overlay.engram_ops import ROW_BYTES


class Launches:
    """``RemoteRows``' launch methods (a base class: the state is the table's)."""

    def _launch_fixed(self, key: tuple[int, int], gen: int | None, last: bool) -> bool:
        """``_launch_piece`` of ``key`` on the job's stream (and the done event after the ``last``
        piece); False (nothing launched) when the job's hand-off was refused meanwhile."""
        with self._job_lock(gen) as live:  # the watchdog takes a job under the lock
            if not live:
                return False
            with self.ops.stream(self._stream):
                self._launch_piece(key, self._out)
                if last:
                    self.done.record(self._stream)
            if last:
                self._release(gen)
        return True

    def _launch(self, r0: int, r1: int, f0: int, n: int, gen: int | None, last: bool) -> bool:
        """A one-piece job's launch (``r0`` 0, ``r1`` its rows, ``f0`` 0, ``last``): H2D of the
        selectors + the ``n`` fetched rows in one copy, split, vLLM's kernel on the job's stream,
        the done event; on the worker the size's launch graph (captured at the table's start
        after its first eager launch, ``_capture_pending``). False (nothing launched) when the job's hand-off was refused meanwhile."""
        assert r0 == 0 and f0 == 0 and last, (r0, f0, last)  # several pieces: _launch_fixed
        with self._job_lock(gen) as live:  # the watchdog takes a job under the lock
            if not live:
                return False
            self._launch_locked(r1, n, gen)
            self._release(gen)
        return True

    def _job_lock(self, gen: int | None) -> Any:
        """The worker's launch of job ``gen`` (None: inline, no lock): held across the check
        that it was not refused or taken meanwhile and its launches; yields whether it may launch."""
        return _JobLock(self, gen)

    def _launch_locked(self, r1: int, n: int, gen: int | None) -> None:
        import torch

        if gen is not None and self.graphs.enabled:
            # one graph launch (captured after the first eager one) on the job's stream by its
            # handle: no stream context (two set_stream calls) around it
            if not self.graphs.replay(r1, self._out, self._stream):
                with self.ops.stream(self._stream):
                    self._launch_one(r1, self._out)
                if self.graphs.wanted(r1, self._out):
                    self._capture = (r1, self._out)
            self.done.record(self._stream)
            return
        b = self._rows * 4 + n * ROW_BYTES
        with self.ops.stream(self._stream):
            d_sel = self.d_buf[: r1 * 4]
            self.d_buf[:b].copy_(self.h_buf[:b], non_blocking=self._cuda)  # selectors and rows in one copy
            if n:
                d_rows = self.d_buf[r1 * 4: b].view(n, ROW_BYTES)
                self.d_w[:n].copy_(d_rows[:, : self.dim])
                self.d_s[:n].copy_(d_rows[:, self.dim:])
            self.dequant(self.d_w, self.d_s, d_sel.view(torch.int32), self.d_dst[:r1], self._out, n, r1)
            self.done.record(self._stream)

    def _launch_one(self, rows: int, out: Any) -> None:
        """The launch of a one-piece job of ``rows`` selectors into ``out`` on the current
        stream, independent of how many rows were fetched (every row slot is copied and split;
        the kernel's bound is ``rows``, and every owned selector is below the fetch count): the
        sequence ``LaunchGraphs`` captures."""
        import torch

        b = rows * (4 + ROW_BYTES)
        self.d_buf[:b].copy_(self.h_buf[:b], non_blocking=self._cuda)
        d_rows = self.d_buf[rows * 4: b].view(rows, ROW_BYTES)
        self.d_w[:rows].copy_(d_rows[:, : self.dim])
        self.d_s[:rows].copy_(d_rows[:, self.dim:])
        self.dequant(self.d_w, self.d_s, self.d_buf[: rows * 4].view(torch.int32), self.d_dst[:rows], out, rows, rows)

    def _capture_pending(self) -> None:
        """Launching thread, at the start after the job that first saw a size: capture that
        size's launch graph, or the piece graphs of a multi-piece job Python served (never while
        a CUDA-graph capture of vLLM is open). Not on the worker (issue 23 pass L): a capture
        there, after the hand-off, could overlap a device-wide ``torch.cuda.synchronize()`` of
        the launching thread, which fails ("operation not permitted when stream is capturing")
        and invalidates the capture (pass K's run K1). Here the capture ends before this
        table's next job is submitted, so no capture of the overlay overlaps anything the
        launching thread does after a join; it costs that start the capture once per size
        (``graph_capture_s``)."""
        pending, self._capture = self._capture, None
        pieces, self._capture_pieces = self._capture_pieces, None
        if self.ops.capturing():
            return
        buf = self.h_buf
        if pending is not None:
            self.graphs.capture(*pending)
        if pieces is not None:
            for key in self._piece_keys(pieces[0]):
                if self.pieces.wanted(key, pieces[1]):
                    self.pieces.capture(key, pieces[1])
        if self.h_buf is not buf:  # replaced meanwhile (a hung worker retired): they read the old one
            self.graphs.clear()
            self.pieces.clear()

    def _launch_piece(self, key: tuple[int, int], out: Any) -> None:
        """One piece of a multi-piece job in the fixed piece layout the C++ core plans into
        (``key`` = (first row r0, rows m)): selectors (relative to the piece) at row r0 of the
        selector part, the piece's packed rows from ``max_rows*4 + r0*264`` (every row slot
        copied, so the launch does not depend on how many were fetched), split, vLLM's kernel
        into ``out`` rows r0..r0+m on the current stream: the sequence a piece graph captures."""
        import torch

        r0, m = key
        a = self.max_rows * 4 + r0 * ROW_BYTES
        b = a + m * ROW_BYTES
        d_sel = self.d_buf[r0 * 4: (r0 + m) * 4]
        d_sel.copy_(self.h_buf[r0 * 4: (r0 + m) * 4], non_blocking=self._cuda)
        self.d_buf[a:b].copy_(self.h_buf[a:b], non_blocking=self._cuda)
        d_rows = self.d_buf[a:b].view(m, ROW_BYTES)
        self.d_w[r0: r0 + m].copy_(d_rows[:, : self.dim])
        self.d_s[r0: r0 + m].copy_(d_rows[:, self.dim:])
        self.dequant(self.d_w[r0:], self.d_s[r0:], d_sel.view(torch.int32), self.d_dst[r0: r0 + m], out, m, m)

    def _launch_pieces(self, gen: int) -> bool:
        """Launch every piece of a multi-piece job the C++ core planned and fetched in the fixed
        piece layout (no graphs: the CPU) and the done event; False when the hand-off was refused
        meanwhile (nothing more launched)."""
        with self.ops.stream(self._stream):
            for key in self._piece_keys(self._rows):
                with self._job_lock(gen) as live:
                    if not live:
                        return False
                    self._launch_piece(key, self._out)
            with self._job_lock(gen) as live:
                if not live:
                    return False
                self.done.record(self._stream)
                self._release(gen)
        return True


class _JobLock:
    """``RemoteRows._job_lock``: the table's lock held (for a worker's job) and the job's liveness."""

    def __init__(self, rows: Any, gen: int | None) -> None:
        self.rows, self.gen = rows, gen

    def __enter__(self) -> bool:
        if self.gen is None:
            return True
        self.rows._lock.acquire()
        return not self.rows._ho.is_abandoned(self.gen)

    def __exit__(self, *exc: Any) -> None:
        if self.gen is not None:
            self.rows._lock.release()
