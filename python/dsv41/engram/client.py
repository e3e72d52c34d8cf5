"""Client of the Engram table server: one-shot reads and the engine's ``RemoteRowSource``.

``RemoteRowSource`` implements the RowSource contract (docs/interfaces.md): on timeout,
transport error or refusal the same call returns the exact rows from the local reader and counts
a fallback; a background thread reconnects with exponential backoff (50 ms .. 2 s, jittered);
``required=True`` (qualification mode) raises instead of falling back, so an unavailable server
can never silently turn into a local-disk benchmark.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np

from dsv41.errors import Dsv41Error
from dsv41.transport import Refused, TransportError, TransportTimeout, open_client, parse_url
from dsv41.transport import protocol as P

#: Rows per transport request: a larger lookup is split so each request gets the full timeout.
CHUNK_ROWS = 16384
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 2.0
#: Largest per-request timeout accepted (10 minutes; ms).
MAX_TIMEOUT_MS = 600_000


class RemoteUnavailable(Dsv41Error):
    """Remote rows were required (``required=True`` or no local fallback) but could not be read."""


def _manifest(manifest: Any):
    if hasattr(manifest, "tables"):
        return manifest
    from dsv41.engram.manifest import load_manifest

    return load_manifest(manifest)


def _check_rows(rows: Any, entry: Any) -> np.ndarray:
    """int64[N] of valid ids of ``entry``'s table (``shards.check_row_ids``; RowRangeError)."""
    from dsv41.engram.shards import check_row_ids

    return check_row_ids(rows, entry.rows, entry.layer_id)


def _fetch(client: Any, ident: bytes, rows: np.ndarray, out: np.ndarray, timeout_s: float) -> None:
    if hasattr(client, "lookup_many"):  # TCP: pipelined requests of CHUNK_ROWS rows
        client.lookup_many(ident, rows.astype(np.uint64), out, timeout_s, chunk_rows=CHUNK_ROWS)
        return
    for s in range(0, rows.shape[0], CHUNK_ROWS):
        e = min(s + CHUNK_ROWS, rows.shape[0])
        client.lookup_into(ident, rows[s:e].astype(np.uint64), [out[s:e]], timeout_s)


def read_rows_remote(url: str, manifest: Any, layer_id: int, rows: Any, timeout_ms: int = 5000) -> np.ndarray:
    """Read packed rows of ``layer_id`` from the server at ``url`` (``tcp://`` or ``nixl://``).

    ``manifest``: Manifest or path (gives the table identity the server must hold);
    ``rows``: int[N] global row ids.  Returns uint8[N, 264] in request order.  Raises
    ``RowRangeError`` for ids outside the table, ``RemoteUnavailable`` when the server cannot be
    reached, refuses, or times out.
    """
    if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
        raise Dsv41Error(f"timeout_ms must be in (0, {MAX_TIMEOUT_MS}], got {timeout_ms}")
    m = _manifest(manifest)
    entry = m.table(layer_id)
    r = _check_rows(rows, entry)
    ident = P.identity_bytes(entry.identity)
    out = np.empty((r.shape[0], P.ROW_BYTES), np.uint8)
    def unavailable(exc: TransportError) -> RemoteUnavailable:
        msg = str(exc)  # transport messages usually name the endpoint already
        return RemoteUnavailable(msg if str(parse_url(url)) in msg else f"{url}: {msg}")

    try:
        client = open_client(url, [ident], timeout_ms / 1000)
    except TransportError as exc:
        raise unavailable(exc) from None
    try:
        if r.size:
            _fetch(client, ident, r, out, timeout_ms / 1000)
    except TransportError as exc:
        raise unavailable(exc) from None
    finally:
        client.close()
    return out


class RemoteRowSource:
    """RowSource reading rows from the rank's table server with exact local fallback.

    ``urls``: one URL per rank (list, or a comma-separated string), ``tcp://H:P[@LOCAL]`` or
    ``nixl://H:P[@LOCAL]``; this rank uses ``urls[rank]`` (a single URL serves every rank).
    ``manifest``: Manifest or path; ``timeout_ms``: per request of up to ``CHUNK_ROWS`` rows;
    ``required``: raise ``RemoteUnavailable`` instead of falling back; ``local``: a RowSource
    (``lookup``) or LocalRowReader (``read``) giving the exact rows on fallback.
    ``lookup`` raises ``RowRangeError`` for ids outside the table (like the local reader).
    Thread-safe; ``close()`` stops the reconnect thread.
    """

    def __init__(self, urls: Any, manifest: Any, rank: int, tp: int, timeout_ms: int = 100,
                 required: bool = False, local: Any = None) -> None:
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        urls = list(urls)
        if not urls:
            raise Dsv41Error("RemoteRowSource needs at least one URL")
        if not isinstance(tp, int) or tp < 1 or not isinstance(rank, int) or not 0 <= rank < tp:
            raise Dsv41Error(f"rank {rank!r} must be in [0, tp={tp!r})")
        if len(urls) not in (1, tp):
            raise Dsv41Error(f"{len(urls)} URLs for tp={tp}: give one per rank")
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:  # beyond it poll()/settimeout() overflow
            raise Dsv41Error(f"timeout_ms must be in (0, {MAX_TIMEOUT_MS}], got {timeout_ms}")
        self.url = urls[rank] if len(urls) == tp else urls[0]
        self.endpoint = parse_url(self.url)
        self.manifest = _manifest(manifest)
        self.rank, self.tp = rank, tp
        self.timeout_s = timeout_ms / 1000
        self.required = bool(required)
        self.local = local
        self._entries = {t.layer_id: t for t in self.manifest.tables}
        self._idents = {t.layer_id: P.identity_bytes(t.identity) for t in self.manifest.tables}
        self._lock = threading.Lock()  # guards the client and one in-flight request
        self._clock = threading.Lock()  # guards counters
        self._rlock = threading.Lock()  # guards starting the reconnect thread
        self._c = {"lookups": 0, "rows": 0, "fallbacks": 0, "transport_errors": 0, "refusals": 0,
                   "reconnects": 0, "latency_sum_s": 0.0, "latency_count": 0, "remote_rows": 0,
                   "connect_failures": 0}
        self.last_error: str | None = None
        self._client = None
        self._ever_connected = False
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self._client = self._connect()
            self._ever_connected = True
        except TransportError as exc:
            self._note_connect_failure(exc)
            if self.required:
                raise RemoteUnavailable(f"remote Engram {self.url} is required but unavailable: {exc}") from None
            self._start_reconnect()

    # -- connection management ---------------------------------------------------------------
    def _connect(self):
        return open_client(self.endpoint, list(self._idents.values()), max(self.timeout_s, 0.5))

    def _note_error(self, exc: BaseException) -> None:
        with self._clock:
            if isinstance(exc, Refused):
                self._c["refusals"] += 1
            else:
                self._c["transport_errors"] += 1
        self.last_error = str(exc)

    def _note_connect_failure(self, exc: BaseException) -> None:
        # Failed (re)connect attempts are counted apart from lookup failures, which they would
        # otherwise inflate while a server is down.
        with self._clock:
            self._c["connect_failures"] += 1
        self.last_error = str(exc)

    def _start_reconnect(self) -> None:
        with self._rlock:  # one reconnect thread at most, even when lookups fail concurrently
            if self._closed.is_set():
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._reconnect_loop, name=f"engram-reconnect-{self.rank}",
                                                daemon=True)
                self._thread.start()

    def _reconnect_loop(self) -> None:
        delay = RECONNECT_MIN_S
        while not self._closed.is_set():
            self._wake.wait(delay * (0.5 + random.random()))
            if self._closed.is_set():
                return
            try:
                client = self._connect()
            except TransportError as exc:
                self._note_connect_failure(exc)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    return
                self._client = client
            with self._clock:
                if self._ever_connected:
                    self._c["reconnects"] += 1
            self._ever_connected = True
            return

    @property
    def connected(self) -> bool:
        """Whether a connection to the server is currently up."""
        return self._client is not None

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until connected or ``timeout_s`` passed (tests, start-up scripts)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self._client is not None:
                return True
            time.sleep(0.01)
        return self._client is not None

    # -- RowSource -----------------------------------------------------------------------------
    def lookup(self, layer_id: int, rows: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Packed rows uint8[N, 264] of global row ids ``rows`` (int[N]) of ``layer_id``.

        Remote first; on failure exact rows from ``local`` (fallback counted).  ``out``: optional
        caller-owned C-contiguous uint8[N, 264] buffer to fill and return (a staging buffer
        reused across calls skips populating fresh memory for every lookup).  Raises
        ``RowRangeError`` for bad ids or layers, ``RemoteUnavailable`` when required or when
        there is no local reader, ``Dsv41Error`` for a bad ``out``.
        """
        t0 = time.perf_counter()
        from dsv41.engram.shards import RowRangeError

        entry = self._entries.get(layer_id)
        if entry is None:
            raise RowRangeError(f"manifest has no table for layer {layer_id}")
        r = _check_rows(rows, entry)
        n = r.shape[0]
        if out is None:
            out = np.empty((n, P.ROW_BYTES), np.uint8)
        elif (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (n, P.ROW_BYTES)
              or not out.flags.c_contiguous or not out.flags.writeable):
            raise Dsv41Error(f"out must be a writable C-contiguous uint8[{n}, {P.ROW_BYTES}] array")
        failure: BaseException | None = None
        if n:
            with self._lock:
                client = self._client
                if client is None:
                    failure = TransportError(f"not connected to {self.url}")
                else:
                    try:
                        _fetch(client, self._idents[layer_id], r, out, self.timeout_s)
                    except (TransportTimeout, TransportError) as exc:  # Refused is a TransportError
                        failure = exc
                        self._note_error(exc)
                        client.close()
                        self._client = None
            if failure is not None:
                self._start_reconnect()
                if self.required:
                    raise RemoteUnavailable(f"remote Engram {self.url} is required but failed: {failure}") from None
                if self.local is None:
                    raise RemoteUnavailable(f"remote Engram {self.url} failed and there is no local reader: {failure}") from None
                if hasattr(self.local, "lookup"):
                    out[...] = self.local.lookup(layer_id, r)
                else:
                    self.local.read(layer_id, r, out=out)
        dt = time.perf_counter() - t0
        with self._clock:
            self._c["lookups"] += 1
            self._c["rows"] += n
            self._c["latency_sum_s"] += dt
            self._c["latency_count"] += 1
            if failure is not None:
                self._c["fallbacks"] += 1
            elif n:
                self._c["remote_rows"] += n
        return out

    def counters(self) -> dict:
        """Counters: lookups, rows, fallbacks, transport_errors, refusals, reconnects,
        latency_sum_s, latency_count (+ remote_rows, connect_failures, connected, source, url)."""
        with self._clock:
            c = dict(self._c)
        c.update(source=self.endpoint.scheme, url=self.url, connected=self._client is not None)
        return c

    def close(self) -> None:
        """Stop reconnecting and close the connection (the local reader is closed too)."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.local is not None and hasattr(self.local, "close"):
            self.local.close()
