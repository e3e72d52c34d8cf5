"""The launch sequences of :class:`dsv41.overlay.engram_rows.RemoteRows` on the current stream:
a one-piece job's launch and a multi-piece job's pieces in the C++ core's fixed piece layout
(copy the staged selectors and packed rows to the device, split, vLLM's kernel), which the launch
and piece graphs capture, and their capture on the launching thread.
"""

from __future__ import annotations

from typing import Any

from dsv41.overlay.engram_ops import ROW_BYTES


class Launches:
    """Base class of ``RemoteRows``: its launches. Uses the state ``RemoteRows.__init__`` sets
    (the host and device buffers ``h_buf``/``d_buf``/``d_w``/``d_s``/``d_dst``, ``dim``,
    ``max_rows``, ``dequant``, ``ops``, ``graphs``, ``pieces``, the pending captures, the job's
    ``_rows``/``_out``/``_stream``, ``done``, ``_lock`` and the hand-off ``_ho``)."""

    def _launch_one(self, rows: int, out: Any) -> None:
        """The launch of a one-piece job of ``rows`` selectors into ``out`` on the current
        stream, independent of how many rows were fetched (every row slot is copied and split;
        the kernel's bound is ``rows``, and every owned selector is below the fetch count): the
        sequence ``LaunchGraphs`` captures."""
        import torch

        b = rows * (4 + ROW_BYTES)
        self.d_buf[:b].copy_(self.h_buf[:b], non_blocking=self._cuda)
        d_rows = self.d_buf[rows * 4 : b].view(rows, ROW_BYTES)
        self.d_w[:rows].copy_(d_rows[:, : self.dim])
        self.d_s[:rows].copy_(d_rows[:, self.dim :])
        self.dequant(self.d_w, self.d_s, self.d_buf[: rows * 4].view(torch.int32), self.d_dst[:rows], out, rows, rows)

    def _capture_pending(self) -> None:
        """Launching thread, at the start after the job that first saw a size: capture that
        size's launch graph, or the piece graphs of a multi-piece job Python served (never while
        a CUDA-graph capture of vLLM is open). Not on the worker: a capture
        there, after the hand-off, could overlap a device-wide ``torch.cuda.synchronize()`` of
        the launching thread, which fails ("operation not permitted when stream is capturing")
        and invalidates the capture (seen on the GPU runs). Here the capture ends before this
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
        d_sel = self.d_buf[r0 * 4 : (r0 + m) * 4]
        d_sel.copy_(self.h_buf[r0 * 4 : (r0 + m) * 4], non_blocking=self._cuda)
        self.d_buf[a:b].copy_(self.h_buf[a:b], non_blocking=self._cuda)
        d_rows = self.d_buf[a:b].view(m, ROW_BYTES)
        self.d_w[r0 : r0 + m].copy_(d_rows[:, : self.dim])
        self.d_s[r0 : r0 + m].copy_(d_rows[:, self.dim :])
        self.dequant(self.d_w[r0:], self.d_s[r0:], d_sel.view(torch.int32), self.d_dst[r0 : r0 + m], out, m, m)

    def _launch_pieces(self, gen: int) -> bool:
        """Launch every piece of a multi-piece job the C++ core planned and fetched in the fixed
        piece layout (no graphs: the CPU) and the done event; False when the hand-off was refused
        meanwhile (nothing more launched)."""
        with self.ops.stream(self._stream):
            for key in self._piece_keys(self._rows):
                with self._lock:
                    if self._ho.is_abandoned(gen):
                        return False
                self._launch_piece(key, self._out)
            self.done.record(self._stream)
        return True
