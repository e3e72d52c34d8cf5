"""What the rank's Engram worker does with a job the C++ core hands back
(:class:`dsv41.overlay.engram_worker.EngramWorker`): a multi-piece job planned and fetched (or
failed), a GPU-joined job that failed, rows the core filled locally after a failed request, a
lease whose request failed, and the launch of fetched rows.
"""

from __future__ import annotations

from time import perf_counter as _perf


class Handbacks:
    """Base class of ``EngramWorker``: its hand-back handlers. Uses the state
    ``EngramWorker.__init__`` sets (``source``, ``core``, ``ops``, the counters ``_c``, the
    tables ``_tables``, the lease) and its ``_serve``/``_lost_lease``."""

    def _pieces_back(self, status: int, job: tuple, code: int, rcount: int) -> None:
        """A multi-piece job the core handed back: planned and fetched in the fixed piece layout
        (the CPU: Python launches the pieces and hands off), or failed (a request: counted as the
        source's failure, the cause handed off in required mode; a CUDA call: piece graphs off),
        then served again whole by Python (the row source's own connection, its exact local
        fallback; the core already waited for the pieces it had launched)."""
        from dsv41.overlay.engram_ops import CORE_PIECES_FETCHED

        rows, gen, _ = job
        c = self._c
        t0 = _perf()
        if status == CORE_PIECES_FETCHED:
            try:
                if rows._launch_pieces(gen):
                    rows._handoff(gen, None)
            except Exception as exc:  # noqa: BLE001 - handed to the launching thread
                c["errors"] += 1
                rows._handoff(gen, exc)
            finally:
                c["host_s"] += _perf() - t0
            rows._maybe_report()
            return
        c["errors"] += 1
        if code:
            client = self._lost_lease()["client"]  # the core had it lent: the request that failed
            try:
                self.source.lease_failed(client, client.native_failure(code, rcount), [], t0)
            except Exception as exc:  # noqa: BLE001 - required mode: the cause at the join
                rows._handoff(gen, exc)
                return
            finally:
                c["fetch_s"] += _perf() - t0
        else:
            rows.pieces.disable("a piece graph launch or event record of the C++ core failed")
        self._serve([(rows, gen)])

    def _gj_failed(self, job: tuple, code: int, rcount: int) -> None:
        """A GPU-joined job's request failed: the core already filled its rows
        from the exact local rows and released the GPU; here the lent connection is closed and the
        failure counted as the row source's (``lease_failed`` with no rows to fill)."""
        from dsv41.overlay.engram_ops import log

        rows, _gen, _ = job
        t0 = _perf()
        self._c["gj_failed_requests"] = self._c.get("gj_failed_requests", 0) + 1
        lease = self._lost_lease()
        if lease is None:
            return
        client = lease["client"]
        try:
            self.source.lease_failed(client, client.native_failure(code, rcount), [], t0)
        except Exception as exc:  # noqa: BLE001 - the rows are exact already; nothing waits for this
            log.error(
                "dsv41 overlay rank %d layer %d: counting a failed GPU-joined request raised %s: %s",
                self.rank,
                rows.layer_id,
                type(exc).__name__,
                exc,
            )
        finally:
            self._c["fetch_s"] += _perf() - t0
        rows._maybe_report()

    def _filled_after_failure(self, batch: list, code: int, rcount: int) -> None:
        """The core's request failed and it filled the batch from the exact local rows itself:
        the connection closed and the failure counted as the row source's (``lease_failed`` with no
        rows to fill, which opens the source's own breaker too)."""
        from dsv41.overlay.engram_ops import log

        t0 = _perf()
        self._c["local_fills_after_failure"] = self._c.get("local_fills_after_failure", 0) + 1
        lease = self._lost_lease()
        if lease is None:
            return
        client = lease["client"]
        try:
            self.source.lease_failed(client, client.native_failure(code, rcount), [], t0)
        except Exception as exc:  # noqa: BLE001 - the rows are exact already; nothing waits for this
            log.error(
                "dsv41 overlay rank %d: counting a failed request raised %s: %s", self.rank, type(exc).__name__, exc
            )
        finally:
            self._c["fetch_s"] += _perf() - t0
        for rows, _, _ in batch:
            rows._maybe_report()

    def _lease_failed(self, batch: list, code: int, rcount: int) -> list:
        """The core's request failed: the exact local rows (the row source's fallback) for every
        layer of the batch, or each layer's hand-off with the cause (required mode); returns the
        layers still to launch."""
        t0 = _perf()
        client = self._lost_lease()["client"]
        failure = client.native_failure(code, rcount)
        parts = [(rows.layer_id, rows._fetch[:n], rows._packed(0, n)) for rows, _, n in batch if n]
        try:
            self.source.lease_failed(client, failure, parts, t0)
        except Exception as exc:  # noqa: BLE001 - every layer of the request gets the cause
            self._c["errors"] += 1
            for rows, gen, _ in batch:
                rows._handoff(gen, exc)
            return []
        finally:
            self._c["fetch_s"] += _perf() - t0
        return batch

    def _launch_fetched(self, batch: list) -> None:
        """Launch (eagerly or by graph, ``RemoteRows._launch``) and hand off every layer of a
        batch the core planned and fetched (a size first seen is captured by the launching
        thread at that table's next start, ``RemoteRows._capture_pending``)."""
        c = self._c
        for rows, gen, n in batch:
            try:
                t0 = _perf()
                launched = rows._launch(0, rows._rows, 0, n, gen, last=True)
                c["launch_s"] += _perf() - t0
                if launched:
                    rows._handoff(gen, None)
            except Exception as exc:  # noqa: BLE001
                c["errors"] += 1
                rows._handoff(gen, exc)
            rows._maybe_report()
