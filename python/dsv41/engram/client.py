"""Client of the Engram table server: one-shot reads and the engine's ``RemoteRowSource``.

``RemoteRowSource`` implements the RowSource contract (docs/interfaces.md): on timeout,
transport error or refusal the same call returns the exact rows from the local reader and counts
a fallback. It is a circuit breaker: a failed request or connect, or a lent connection's failed
request (``lease_failed``), drops the connection, and until the background probe reconnects
(connect + HELLO, backoff 50 .. 500 ms jittered, so within about 0.75 s of the server's return)
every lookup goes straight to the local rows: no request, connect or timeout in the caller;
``required=True`` (qualification mode) raises instead of falling back, so an unavailable server
can never silently turn into a local-disk benchmark. The engine's whole-call deadline
(``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``) lives here too (``deadline_ms``): it bounds the wait for
the connection lock and every request of a call, on the calling thread (no helper thread).
The breaker's connection half (connect, retire, background reconnect) is
:class:`dsv41.engram.breaker.Breaker`.
"""

from __future__ import annotations

import threading
import time
from time import perf_counter as _perf
from typing import Any

import numpy as np

from dsv41.engram.breaker import (
    Breaker,
    DeadlineExceeded as DeadlineExceeded,
    RemoteUnavailable as RemoteUnavailable,
)
from dsv41.engram.reader import LocalRowReader
from dsv41.engram.rowsource import LocalRowSource, RowSource
from dsv41.errors import Dsv41Error
from dsv41.transport import Refused, TransportError, TransportTimeout, open_client, parse_url, protocol as P

#: Rows per transport request: a larger lookup is split so each request gets the full timeout.
CHUNK_ROWS = 16384
#: Largest per-request timeout accepted (10 minutes; ms).
MAX_TIMEOUT_MS = 600_000
#: Largest busy-poll budget accepted (us): a spin never outlasts its request's timeout.
MAX_SPIN_US = MAX_TIMEOUT_MS * 1000


def _manifest(manifest: Any):
    if hasattr(manifest, "tables"):
        return manifest
    from dsv41.engram.manifest import load_manifest

    return load_manifest(manifest)


def _check_rows(rows: Any, entry: Any) -> np.ndarray:
    """int64[N] of valid ids of ``entry``'s table (``shards.check_row_ids``; RowRangeError)."""
    from dsv41.engram.shards import check_row_ids

    return check_row_ids(rows, entry.rows, entry.layer_id)


def _fetch(
    client: Any, ident: bytes, rows: np.ndarray, out: np.ndarray, timeout_s: float, end: float | None = None
) -> None:
    """``rows`` of table ``ident`` into ``out`` in requests of ``CHUNK_ROWS`` rows, each within
    ``timeout_s`` and all by ``end`` (``time.monotonic()`` instant, None: no whole-call bound)."""
    if hasattr(client, "lookup_many"):  # TCP: pipelined requests of CHUNK_ROWS rows
        client.lookup_many(ident, rows.astype(np.uint64), out, timeout_s, chunk_rows=CHUNK_ROWS, end=end)
        return
    for s in range(0, rows.shape[0], CHUNK_ROWS):
        e = min(s + CHUNK_ROWS, rows.shape[0])
        t = timeout_s if end is None else min(timeout_s, end - time.monotonic())
        if t <= 0:
            raise DeadlineExceeded(f"{client.endpoint}: lookup deadline passed after {s} of {rows.shape[0]} rows")
        client.lookup_into(ident, rows[s:e].astype(np.uint64), [out[s:e]], t)


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


class RemoteRowSource(Breaker, RowSource):
    """RowSource reading rows from the rank's table server with exact local fallback.

    ``urls``: one URL per rank (list, or a comma-separated string), ``tcp://H:P[@LOCAL]`` or
    ``nixl://H:P[@LOCAL]``; this rank uses ``urls[rank]`` (a single URL serves every rank).
    ``manifest``: Manifest or path; ``timeout_ms``: per request of up to ``CHUNK_ROWS`` rows;
    ``required``: raise ``RemoteUnavailable`` instead of falling back; ``local``: a RowSource, or
    a LocalRowReader (wrapped in ``LocalRowSource``), giving the exact rows on fallback.
    ``deadline_ms``: the whole-call deadline of one ``lookup``/``lookup_layers`` (the engine's
    ``DSV41_ENGRAM_LOOKUP_DEADLINE_MS``): it bounds the wait for the connection lock and every
    request of the call (each request gets ``min(timeout_ms, what is left)``); past it the rows
    come from ``local``, counted in ``deadline_exceeded`` and ``fallbacks``; None: requests are
    bounded by ``timeout_ms`` only. ``fault_delay_ms`` (``DSV41_ENGRAM_FAULT_DELAY_MS``, drills
    only): every layer's rows arrive that much later, as from a slow server (inside the deadline
    and the request timeout; a delay past either is a timeout).
    ``spin_us``: the tcp client's busy-poll budget per reply (microseconds; the engine passes
    ``DSV41_TRANSPORT_CLIENT_SPIN_US``; None: that variable; 0: sleep in poll at once); it never
    runs past the request's timeout or the deadline.
    ``lookup`` raises ``RowRangeError`` for ids outside the table (like the local reader).
    Thread-safe; ``close()`` stops the reconnect thread.
    """

    def __init__(
        self,
        urls: Any,
        manifest: Any,
        rank: int,
        tp: int,
        timeout_ms: int = 100,
        required: bool = False,
        local: Any = None,
        deadline_ms: float | None = None,
        fault_delay_ms: float = 0.0,
        spin_us: float | None = None,
    ) -> None:
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        urls = list(urls)
        if not urls:
            raise Dsv41Error("RemoteRowSource needs at least one URL")
        if not isinstance(tp, int) or tp < 1 or not isinstance(rank, int) or not 0 <= rank < tp:
            raise Dsv41Error(f"rank {rank!r} must be in [0, tp={tp!r})")
        if len(urls) not in (1, tp):
            raise Dsv41Error(f"{len(urls)} URLs for tp={tp}: give one per rank")
        # beyond MAX_TIMEOUT_MS poll()/settimeout() overflow; the comparisons also refuse NaN
        for name, v, zero, top in (
            ("timeout_ms", timeout_ms, False, MAX_TIMEOUT_MS),
            ("deadline_ms", deadline_ms, False, MAX_TIMEOUT_MS),
            ("fault_delay_ms", fault_delay_ms, True, MAX_TIMEOUT_MS),
            ("spin_us", spin_us, True, MAX_SPIN_US),
        ):
            if v is not None and not (0 <= v <= top if zero else 0 < v <= top):
                raise Dsv41Error(f"{name} must be in {'[' if zero else '('}0, {top}], got {v}")
        self.spin_us = spin_us
        self.url = urls[rank] if len(urls) == tp else urls[0]
        self.endpoint = parse_url(self.url)
        self.manifest = _manifest(manifest)
        self.rank, self.tp = rank, tp
        self.timeout_s = timeout_ms / 1000
        self.deadline_s = None if deadline_ms is None else deadline_ms / 1000
        # Seconds a call may take in all; without a deadline the largest timeout (no None checks below)
        self._budget = MAX_TIMEOUT_MS / 1000 if deadline_ms is None else deadline_ms / 1000
        # The hot path takes the lock at once or not at all, so its request gets min(timeout, deadline)
        self._req_s = min(self.timeout_s, self._budget)
        self._req_cut = self._budget < self.timeout_s  # its timeout is the deadline itself
        self.fault_delay_s = fault_delay_ms / 1000
        self.required = bool(required)
        self.local: RowSource | None = LocalRowSource(local) if isinstance(local, LocalRowReader) else local
        self._entries = {t.layer_id: t for t in self.manifest.tables}
        self._idents = {t.layer_id: P.identity_bytes(t.identity) for t in self.manifest.tables}
        # The hot path's tables; empty under a fault delay (drills take the general path, which applies it)
        self._tabs = {} if self.fault_delay_s else {L: (self._idents[L], int(t.rows)) for L, t in self._entries.items()}
        # Guards the client, its one in-flight request, and the hot path's counters (no second lock)
        self._lock = threading.Lock()
        self._rlock = threading.Lock()  # guards starting the reconnect thread
        self._c = {
            "lookups": 0,
            "rows": 0,
            "fallbacks": 0,
            "transport_errors": 0,
            "refusals": 0,
            "reconnects": 0,
            "latency_sum_s": 0.0,
            "latency_count": 0,
            "remote_rows": 0,
            "connect_failures": 0,
            "deadline_exceeded": 0,
            "breaker_opens": 0,
        }
        # The other paths' counters: their own lock (a call past its deadline never waits to count)
        self._slock = threading.Lock()
        self._side = {
            "lookups": 0,
            "rows": 0,
            "fallbacks": 0,
            "remote_rows": 0,
            "latency_sum_s": 0.0,
            "latency_count": 0,
            "deadline_exceeded": 0,
        }
        self.last_error: str | None = None
        self._extra: list = []  # counters of requests on lent connections (add_counters)
        self._client = None
        self._retired: list = []  # failed clients, closed by the reconnect thread, never by a lookup
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

    def is_required(self) -> bool:
        """``required`` (the protocol's question: no fallback, a failed read raises)."""
        return self.required

    def lookup(self, layer_id: int, rows: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Packed rows uint8[N, 264] of global row ids ``rows`` (int[N]) of ``layer_id``.

        Remote first, within ``deadline_ms``; on failure exact rows from ``local`` (fallback
        counted).  ``out``: optional caller-owned C-contiguous uint8[N, 264] buffer to fill and
        return (the engine's or the vLLM overlay's staging buffer: no allocation per call).
        Raises ``RowRangeError`` for bad ids or layers, ``RemoteUnavailable`` when required or
        when there is no local reader, ``Dsv41Error`` for a bad ``out``.

        Hot path (int64/uint64 C-contiguous ids, at most ``CHUNK_ROWS``, a connected tcp or nixl
        client, the connection lock free): one ``lookup_segs`` call does every check in C++
        (tcp) and the counters are updated under the connection lock this call holds anyway.
        """
        t0 = _perf()
        tab = self._tabs.get(layer_id)
        if tab is not None and type(rows) is np.ndarray and rows.ndim == 1:
            lock = self._lock
            if not lock.acquire(False):  # contended: the general path waits within the deadline
                return self._lookup_general(layer_id, rows, out, t0)
            buf = np.empty((len(rows), P.ROW_BYTES), np.uint8) if out is None else out
            failure = None
            try:
                client = self._client
                if client is not None and len(buf):
                    try:
                        code, n, _ = client.lookup_segs(((tab[0], rows, tab[1], buf),), self._req_s, CHUNK_ROWS)
                    except (TransportTimeout, TransportError) as exc:  # ids and out passed the checks
                        code, failure = -1, exc
                        self._fail_locked(client, exc, self._req_cut and isinstance(exc, TransportTimeout))
                    if code == 0:
                        c = self._c
                        c["lookups"] += 1
                        c["rows"] += n
                        c["remote_rows"] += n
                        c["latency_sum_s"] += _perf() - t0
                        c["latency_count"] += 1
                        return buf
            finally:
                lock.release()
            if failure is not None:
                self._fall_back(failure, [(layer_id, rows, buf)])
                self._count([len(buf)], failure, t0)
                return buf
        return self._lookup_general(layer_id, rows, out, t0)

    def _lookup_general(self, layer_id: int, rows: Any, out: np.ndarray | None, t0: float) -> np.ndarray:
        """``lookup`` for every case the hot path does not take: id conversion and checks,
        large lookups (pipelined ``CHUNK_ROWS`` requests), a busy connection lock,
        disconnection, fault delay and fallback."""
        r = self._checked(layer_id, rows)
        n = r.shape[0]
        out = self._out(out, n)
        failure: BaseException | None = None
        if n:
            parts = [(layer_id, r, out)]
            failure = self._remote(parts, t0)
            if failure is not None:
                self._fall_back(failure, parts)
        self._count([n], failure, t0)
        return out

    def _remote(self, parts: list, t0: float) -> BaseException | None:
        """Read every ``(layer_id, ids, out)`` of ``parts`` (ids and outs checked) from the
        server within the call's deadline (``t0``: the call's ``perf_counter`` start); the
        failure, or None when every row was written."""
        if self._client is None:  # the breaker is open: the local rows at once, the probe reconnects
            return TransportError(f"not connected to {self.url}")
        budget = self._budget
        lock = self._lock
        if not (lock.acquire(False) or lock.acquire(True, max(0.0, budget - (_perf() - t0)))):
            with self._slock:
                self._side["deadline_exceeded"] += 1
            return DeadlineExceeded(
                f"{self.url}: the connection stayed busy past the {budget * 1e3:g} ms lookup deadline"
            )
        try:
            client = self._client
            if client is None:
                return TransportError(f"not connected to {self.url}")
            try:
                if self.fault_delay_s:
                    self._fault_wait(len(parts), t0)
                total = sum(p[1].shape[0] for p in parts)
                if len(parts) > 1 and client.multi_table and total <= CHUNK_ROWS:
                    t = min(self.timeout_s, budget - (_perf() - t0))
                    if t <= 0:
                        raise DeadlineExceeded(f"{self.url}: the {budget * 1e3:g} ms lookup deadline passed")
                    segs = tuple((self._idents[L], r, self._entries[L].rows, o) for L, r, o in parts)
                    code = client.lookup_segs(segs, t)[0]
                    if code:  # ids and buffers were checked by the caller
                        raise Dsv41Error(f"internal: lookup_segs returned {code} after checks")
                else:
                    end = time.monotonic() + budget - (_perf() - t0)
                    for L, r, o in parts:
                        if r.shape[0]:
                            _fetch(client, self._idents[L], r, o, self.timeout_s, end)
            except (TransportTimeout, TransportError) as exc:  # Refused is a TransportError
                self._fail_locked(client, exc, isinstance(exc, TransportTimeout) and _perf() - t0 >= budget)
                return exc
            return None
        finally:
            lock.release()

    def _fault_wait(self, layers: int, t0: float) -> None:
        """The drill's slow server: ``layers x fault_delay`` before the rows arrive, bounded by
        the request timeout and the call's deadline (TransportTimeout when it reaches either)."""
        want = self.fault_delay_s * layers
        t = min(self.timeout_s, self._budget - (_perf() - t0))
        if want >= t:
            time.sleep(max(t, 0.0))
            raise TransportTimeout(
                f"{self.url}: rows delayed {want * 1e3:g} ms (DSV41_ENGRAM_FAULT_DELAY_MS), "
                f"past the {max(t, 0.0) * 1e3:.0f} ms left to the request"
            )
        time.sleep(want)

    def lookup_layers(self, layer_ids: Any, rows: Any, outs: Any = None) -> list[np.ndarray]:
        """Rows of several layers (e.g. both Engram layers of a step) in one round trip.

        ``layer_ids``: sequence of layer ids; ``rows``: one int[N_i] array per layer; ``outs``:
        None or one caller-owned buffer (uint8[N_i, 264], or None) per layer.  Returns the list
        of uint8[N_i, 264] arrays.  Over tcp the layers travel as one ``OP_LOOKUP_MULTI``
        request when the server speaks protocol version 2 (else one request per layer); over
        nixl as one READ.  Same errors, deadline, counters (one lookup per layer) and fallback
        as ``lookup``: a failure falls back for every layer of the call.
        """
        t0 = _perf()
        if outs is not None and len(layer_ids) == len(rows) == len(outs) == 2:  # the decode step
            tabs = self._tabs
            a, b = tabs.get(layer_ids[0]), tabs.get(layer_ids[1])
            if a is not None and b is not None:
                lock = self._lock
                if not lock.acquire(False):  # contended: the general path waits within the deadline
                    return self._lookup_layers_general(layer_ids, rows, outs, t0)
                failure = None
                try:
                    client = self._client
                    if client is not None and client.multi_table:
                        try:
                            code, n, _ = client.lookup_segs(
                                ((a[0], rows[0], a[1], outs[0]), (b[0], rows[1], b[1], outs[1])),
                                self._req_s,
                                CHUNK_ROWS,
                            )
                        except (TransportTimeout, TransportError) as exc:  # ids and outs passed the checks
                            code, failure = -1, exc
                            self._fail_locked(client, exc, self._req_cut and isinstance(exc, TransportTimeout))
                        if code == 0 and n:
                            c = self._c
                            c["lookups"] += 2
                            c["rows"] += n
                            c["remote_rows"] += n
                            c["latency_sum_s"] += _perf() - t0
                            c["latency_count"] += 1
                            return list(outs)
                finally:
                    lock.release()
                if failure is not None:
                    parts = [(layer_ids[0], rows[0], outs[0]), (layer_ids[1], rows[1], outs[1])]
                    self._fall_back(failure, parts)
                    self._count([len(outs[0]), len(outs[1])], failure, t0)
                    return list(outs)
        return self._lookup_layers_general(layer_ids, rows, outs, t0)

    def _checked(self, layer_id: int, rows: Any) -> np.ndarray:
        """int64 ids of ``layer_id``'s table (RowRangeError for an unknown layer or a bad id)."""
        from dsv41.engram.shards import RowRangeError

        entry = self._entries.get(layer_id)
        if entry is None:
            raise RowRangeError(f"manifest has no table for layer {layer_id}")
        return _check_rows(rows, entry)

    def _lookup_layers_general(self, layer_ids: Any, rows: Any, outs: Any, t0: float) -> list[np.ndarray]:
        layer_ids = list(layer_ids)
        if len(rows) != len(layer_ids) or (outs is not None and len(outs) != len(layer_ids)):
            raise Dsv41Error("lookup_layers needs one row array (and one out, if given) per layer")
        if not 1 <= len(layer_ids) <= P.MAX_SEGMENTS:
            raise Dsv41Error(f"lookup_layers takes 1..{P.MAX_SEGMENTS} layers, got {len(layer_ids)}")
        parts = []
        for k, layer_id in enumerate(layer_ids):
            r = self._checked(layer_id, rows[k])
            parts.append((layer_id, r, self._out(None if outs is None else outs[k], r.shape[0])))
        failure: BaseException | None = None
        if sum(p[1].shape[0] for p in parts):
            failure = self._remote(parts, t0)
            if failure is not None:
                self._fall_back(failure, parts)
        self._count([p[1].shape[0] for p in parts], failure, t0)
        return [p[2] for p in parts]

    @staticmethod
    def _out(out: Any, n: int) -> np.ndarray:
        if out is None:
            return np.empty((n, P.ROW_BYTES), np.uint8)
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.shape != (n, P.ROW_BYTES)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise Dsv41Error(f"out must be a writable C-contiguous uint8[{n}, {P.ROW_BYTES}] array")
        return out

    def _fall_back(self, failure: BaseException, parts: list) -> None:
        """Fill every ``(layer_id, ids, out)`` of ``parts`` from the local reader, or raise."""
        if not isinstance(failure, DeadlineExceeded) or self._client is None:
            self._start_reconnect()  # a busy but healthy connection needs no reconnect
        if self.required:
            raise RemoteUnavailable(f"remote Engram {self.url} is required but failed: {failure}") from None
        if self.local is None:
            raise RemoteUnavailable(
                f"remote Engram {self.url} failed and there is no local reader: {failure}"
            ) from None
        for layer_id, r, out in parts:
            self.local.lookup(layer_id, r, out=out)

    def _count(self, ns: list[int], failure: BaseException | None, t0: float) -> None:
        n = sum(ns)
        with self._slock:  # never the connection lock: a call past its deadline must not wait
            c = self._side
            c["lookups"] += len(ns)
            c["rows"] += n
            c["latency_sum_s"] += _perf() - t0
            c["latency_count"] += 1
            if failure is not None:
                c["fallbacks"] += 1
            elif n:
                c["remote_rows"] += n

    # -- a lent connection (the vLLM overlay's C++ worker core) ----------------------------------
    def native_lease(self) -> dict | None:
        """A connection of the caller's own to this source's server, for requests made in C++
        without the GIL (``dsv41.overlay._core.EngramCore``), or None where this source cannot lend one
        (nixl, a fault delay, no C++ transport, the server unreachable now). Returns
        ``{"client", "fd", "gen", "version", "spin_ns", "timeout_ns", "tables"}``: the TcpClient
        (the caller closes it once it stopped using ``fd``), the request generation to start
        from, the peer's protocol version, the busy-poll budget, the per-request timeout (this
        source's ``min(timeout_ms, deadline_ms)``, as its hot path) and ``{layer_id: (identity
        bytes, table rows)}``. A failed request on it goes to ``lease_failed``."""
        if not self._tabs or self.endpoint.scheme != "tcp" or self._closed.is_set():
            return None
        try:
            client = self._connect()
        except TransportError as exc:
            self._note_connect_failure(exc)
            return None
        lend = getattr(client, "lend", None)
        if lend is None:
            client.close()
            return None
        try:
            fd, gen, version, spin_ns = lend()
        except TransportError:
            client.close()
            return None
        return {
            "client": client,
            "fd": fd,
            "gen": gen,
            "version": version,
            "spin_ns": spin_ns,
            "timeout_ns": int(self._req_s * 1e9),
            "tables": dict(self._tabs),
        }

    def native_tables(self) -> dict:
        """``{layer_id: (identity bytes, table rows)}`` a lease would name, where this source can
        lend connections (tcp, no fault delay), else ``{}``."""
        return dict(self._tabs) if self.endpoint.scheme == "tcp" and not self._closed.is_set() else {}

    def lease_failed(self, client: Any, failure: BaseException, parts: list, t0: float) -> None:
        """A request on a lent connection failed (``failure``: its ``TransportError``,
        ``TransportTimeout`` or ``Refused``): counted as this source's own failures are (and in
        ``fallbacks``), ``client`` closed, and every ``(layer_id, ids, out)`` of ``parts`` filled
        from the local reader; raises ``RemoteUnavailable`` in required mode or without one.
        Unless it was a refusal (the server answered), the source's own connection to the same
        server is dropped too (the breaker opens: lookups go local until the probe reconnects)."""
        with self._lock:
            c = self._c
            if isinstance(failure, TransportTimeout) and self._req_cut:
                c["deadline_exceeded"] += 1
            if isinstance(failure, Refused):
                c["refusals"] += 1
            else:
                c["transport_errors"] += 1
                own = self._client
                if own is not None:  # a dead or hung server fails this one's next request too
                    self._client = None
                    c["breaker_opens"] += 1
                    self._retired.append(own)  # closed by the reconnect thread (close() closes the rest)
        self.last_error = str(failure)
        client.close()
        self._fall_back(failure, parts)
        self._count([p[1].shape[0] for p in parts], failure, t0)

    def add_counters(self, fn: Any) -> None:
        """Add ``fn()``'s counts (``lookups``, ``rows``, ``remote_rows``, ``latency_sum_s``,
        ``latency_count``: requests made on a lent connection) to ``counters()``."""
        self._extra.append(fn)

    def counters(self) -> dict:
        """Counters: lookups, rows, fallbacks, transport_errors, refusals, reconnects,
        latency_sum_s, latency_count (+ remote_rows, connect_failures, deadline_exceeded
        (calls whose deadline passed; each is also a fallback), connected, source, url,
        deadline_ms, and fault_delay_ms when a fault delay is set).

        ``breaker_opens``: connections dropped after a failure. Read without a lock (a snapshot
        never waits for a request in flight; one may show a lookup partly counted)."""
        c = dict(self._c)
        for k, v in dict(self._side).items():
            c[k] += v
        for fn in list(self._extra):
            for k, v in fn().items():
                c[k] += v
        c.update(
            source=self.endpoint.scheme,
            url=self.url,
            connected=self._client is not None,
            deadline_ms=None if self.deadline_s is None else self.deadline_s * 1e3,
        )
        if self.fault_delay_s:
            c["fault_delay_ms"] = self.fault_delay_s * 1e3
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
        self._close_retired()
        if self.local is not None:
            self.local.close()
