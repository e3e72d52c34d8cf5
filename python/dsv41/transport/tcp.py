"""TCP client of the row transport: rows land straight in caller-owned buffers.

Latency design (docs/remote-engram.md): the socket is non-blocking; after sending, the client
busy-polls ``recv_into`` for up to ``spin_us`` (``DSV41_TRANSPORT_CLIENT_SPIN_US``, default 50; a
thread wake-up costs ~30 us on the target hosts) and then blocks in ``poll`` until the deadline;
the deadline is checked on every spin iteration too.  A request that misses its deadline tears
the connection down, so a late reply can never land in a buffer whose request already timed out;
every reply must also echo the request's generation (``request id``), else the connection is
dropped as a protocol error.
"""

from __future__ import annotations

import itertools
import select
import socket
import time

import numpy as np

from dsv41 import envs
from dsv41.transport import native as _native, protocol as P
from dsv41.transport.errors import Refused, TransportError, TransportTimeout
from dsv41.transport.url import Endpoint

MAX_DEST_RANGES = 16


def check_segments(segs: tuple) -> tuple[int, int, int]:
    """Python form of the C++ checks of ``TcpClient.lookup_segs`` (the pure path and NIXL):
    ``(0, 0, total_rows)`` or ``(2|3|4, k, i)`` as documented there.  ValueError for a wrong
    number of segments."""
    if not 1 <= len(segs) <= P.MAX_SEGMENTS:
        raise ValueError(f"1..{P.MAX_SEGMENTS} segments, got {len(segs)}")
    total = 0
    for k, (_, rows, limit, out) in enumerate(segs):
        if (
            not isinstance(rows, np.ndarray)
            or rows.ndim != 1
            or rows.dtype.kind not in "iu"
            or rows.dtype.itemsize != 8
            or not rows.flags.c_contiguous
        ):
            return 2, k, 0
        n = rows.shape[0]
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.shape != (n, P.ROW_BYTES)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            return 4, k, 0
        bad = np.flatnonzero(rows.view(np.uint64) >= np.uint64(limit))
        if bad.size:
            return 3, k, int(bad[0])
        total += n
    return 0, 0, total


class TcpClient:
    """One connection to a row server (``tcp://`` or a ``nixl://`` control channel).

    ``connect_timeout_s``: bound on connect; ``spin_us``: busy-poll budget (microseconds, >= 0)
    of each receive before it sleeps in poll, never past the request's timeout; None:
    ``DSV41_TRANSPORT_CLIENT_SPIN_US``; 0: sleep at once.  ``native``: C++ lookup path (default:
    when built, see ``transport.native``).
    Not thread-safe: one in-flight request at a time (callers lock).
    Raises ``TransportError`` when the server cannot be reached.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        connect_timeout_s: float = 1.0,
        spin_us: float | None = None,
        native: bool | None = None,
    ) -> None:
        if spin_us is None:
            spin_us = envs.parse().transport_client_spin_us
        if not spin_us >= 0:  # also refuses NaN
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        self.endpoint = endpoint
        self.native = _native.use_native(native)
        self._fast = _native._fastrow.client_lookup_segs if self.native else None
        self.spin_us = spin_us
        self.spin_s = spin_us / 1e6
        self._spin_ns = int(spin_us * 1000)
        #: Protocol version of the peer as far as this client knows (``negotiate`` raises it to 2).
        self.version = P.VERSION
        self._gen = itertools.count(1)
        self._hdr = bytearray(P.REP.size)
        self._hdr_mv = memoryview(self._hdr)
        self.sock: socket.socket | None = None
        try:
            fam = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if endpoint.local_host:
                    s.bind((endpoint.local_host, endpoint.local_port))
                s.settimeout(connect_timeout_s)
                s.connect((endpoint.host, endpoint.port))
                s.setblocking(False)
            except BaseException:
                s.close()
                raise
        except OSError as exc:
            raise TransportError(f"cannot connect to {endpoint}: {exc.strerror or exc}") from None
        self.sock = s
        self._poll = select.poll()
        self._poll.register(s.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)

    @property
    def connected(self) -> bool:
        """Whether the socket is open (False after ``close`` or any transport error)."""
        return self.sock is not None

    @property
    def multi_table(self) -> bool:
        """Whether ``lookup_segs`` may carry several tables in one request (peer speaks v2)."""
        return self.version >= 2

    def close(self) -> None:
        """Close the connection (idempotent; a lent one too: the borrower must be done with it)."""
        s, self.sock = self.sock, None
        if s is None:
            s, self._lent_sock = getattr(self, "_lent_sock", None), None
        if s is not None:
            try:
                self._poll.unregister(s.fileno())
            except (KeyError, ValueError, OSError):
                pass
            s.close()

    # -- low level -------------------------------------------------------------------------
    def _fail(self, exc: TransportError) -> TransportError:
        self.close()
        return exc

    def _send_all(self, bufs: list, deadline: float) -> None:
        s = self.sock
        views = [memoryview(b).cast("B") for b in bufs if len(memoryview(b).cast("B"))]
        while views:
            try:
                n = s.sendmsg(views)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                raise self._fail(TransportError(f"send to {self.endpoint} failed: {exc}")) from None
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0
            if views:
                rem = deadline - time.monotonic()
                if rem <= 0:
                    raise self._fail(TransportTimeout(f"send to {self.endpoint} timed out"))
                select.select([], [s], [], rem)

    def _recv_into(self, mv: memoryview, deadline: float) -> None:
        s = self.sock
        got, n = 0, len(mv)
        spin_until = time.monotonic() + self.spin_s
        while got < n:
            try:
                r = s.recv_into(mv[got:])
                if r == 0:
                    raise self._fail(TransportError(f"{self.endpoint} closed the connection"))
                got += r
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise self._fail(TransportError(f"receive from {self.endpoint} failed: {exc}")) from None
            t = time.monotonic()
            if t >= deadline:
                raise self._fail(TransportTimeout(f"request to {self.endpoint} timed out"))
            if t < spin_until:
                continue
            self._poll.poll(max(1, int((deadline - t) * 1000 + 0.999)))

    def _discard(self, n: int, deadline: float) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 16)))
        while n:
            k = min(n, len(scratch))
            self._recv_into(scratch[:k], deadline)
            n -= k

    def _reply_header(self, gen: int, deadline: float, version: int = P.VERSION) -> tuple[int, int, int]:
        self._recv_into(self._hdr_mv, deadline)
        magic, ver, status, rid, count, plen = P.REP.unpack(self._hdr)
        # a bad_version refusal carries the server's newest version instead of ours
        if magic != P.MAGIC or (ver != version and status != P.ST_BAD_VERSION):
            raise self._fail(TransportError(f"{self.endpoint} sent a malformed reply header"))
        if rid != gen:
            # Generation mismatch: a reply that is not ours must never reach a caller buffer.
            raise self._fail(TransportError(f"{self.endpoint} replied to request {rid}, expected {gen}"))
        return status, count, plen

    def _refusal(self, status: int, plen: int, deadline: float) -> Refused:
        if plen > 4096:
            return self._fail(Refused(status, P.status_name(status)))
        self._discard(plen, deadline)
        return Refused(status, P.status_name(status))

    def request(
        self, op: int, identity: bytes, count: int, payload: bytes, timeout_s: float, version: int = P.VERSION
    ) -> tuple[int, bytes]:
        """Send one control request in a ``version`` frame; return ``(count, payload)`` of an OK
        reply.

        Raises ``Refused`` (connection kept; ``bad_version``: closed by the server),
        ``TransportTimeout`` or ``TransportError`` (connection closed).  Replies are limited to
        16 MiB.
        """
        if self.sock is None:
            raise TransportError(f"not connected to {self.endpoint}")
        deadline = time.monotonic() + timeout_s
        gen = next(self._gen)
        hdr = P.REQ.pack(P.MAGIC, version, op, gen, identity, count, len(payload))
        self._send_all([hdr, payload], deadline)
        status, rcount, plen = self._reply_header(gen, deadline, version)
        if status == P.ST_BAD_VERSION:
            self.close()  # the server closes after it
            raise Refused(
                status,
                P.status_name(status),
                f"{self.endpoint} does not speak protocol version {version} (its newest: {P.REP.unpack(self._hdr)[1]})",
            )
        if status != P.ST_OK:
            raise self._refusal(status, plen, deadline)
        if plen > (16 << 20):
            raise self._fail(TransportError(f"{self.endpoint} sent an oversize control reply"))
        buf = bytearray(plen)
        self._recv_into(memoryview(buf), deadline)
        return rcount, bytes(buf)

    def hello(self, timeout_s: float = 1.0, version: int = P.VERSION) -> list[dict]:
        """The server's tables: ``[{identity (hex), layer_id, rows, row_bytes}]``, asked in a
        ``version`` frame (``Refused`` ``bad_version`` from a server that does not speak it; on a
        successful version-2 HELLO ``self.version`` becomes 2)."""
        count, data = self.request(P.OP_HELLO, bytes(32), 0, b"", timeout_s, version)
        self.version = max(self.version, version)
        if len(data) != count * P.TABLE_ENTRY.size:
            raise self._fail(TransportError(f"{self.endpoint} sent a malformed table list"))
        out = []
        for i in range(count):
            ident, layer, rows, rb = P.TABLE_ENTRY.unpack_from(data, i * P.TABLE_ENTRY.size)
            out.append({"identity": ident.hex(), "layer_id": layer, "rows": rows, "row_bytes": rb})
        return out

    def lookup_into(self, identity: bytes, rows: np.ndarray, dests: list[np.ndarray], timeout_s: float) -> None:
        """Fetch ``rows`` (uint64[N], global ids) of table ``identity`` into ``dests``.

        ``dests``: 1..16 C-contiguous uint8 ``[n_i, 264]`` arrays with ``sum(n_i) == N``; rows are
        written in request order across them.  ``N <= MAX_ROWS``.  Raises ``Refused`` (wrong
        identity, out of range...; no destination byte written), ``TransportTimeout`` or
        ``TransportError`` (connection closed; destinations may hold partial data of this request
        only).
        """
        if self.sock is None:
            raise TransportError(f"not connected to {self.endpoint}")
        n = int(rows.shape[0])
        if not 1 <= len(dests) <= MAX_DEST_RANGES:
            raise ValueError(f"1..{MAX_DEST_RANGES} destination ranges, got {len(dests)}")
        total = 0
        for d in dests:
            if d.dtype != np.uint8 or d.ndim != 2 or d.shape[1] != P.ROW_BYTES or not d.flags.c_contiguous:
                raise ValueError("destinations must be C-contiguous uint8[n, 264] arrays")
            if not d.flags.writeable:
                raise ValueError("destination is read-only")
            total += d.shape[0]
        if total != n:
            raise ValueError(f"destinations hold {total} rows, request has {n}")
        if n > P.MAX_ROWS:
            raise ValueError(f"at most {P.MAX_ROWS} rows per request, got {n}")
        if rows.dtype != np.dtype("<u8") or not rows.flags.c_contiguous:
            rows = np.ascontiguousarray(rows, dtype="<u8")
        gen = next(self._gen)
        if self.native:
            self._native_lookup(identity, gen, rows, dests, timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        hdr = P.REQ.pack(P.MAGIC, P.VERSION, P.OP_LOOKUP, gen, identity, n, 8 * n)
        self._send_all([hdr, rows], deadline)
        status, rcount, plen = self._reply_header(gen, deadline)
        if status != P.ST_OK:
            raise self._refusal(status, plen, deadline)
        if rcount != n or plen != n * P.ROW_BYTES:
            raise self._fail(TransportError(f"{self.endpoint} sent {rcount} rows, expected {n}"))
        for d in dests:
            if d.shape[0]:
                self._recv_into(memoryview(d).cast("B"), deadline)

    def lookup_segs(self, segs: tuple, timeout_s: float, max_rows: int = P.MAX_ROWS) -> tuple[int, int, int]:
        """Rows of one or more tables in one request, straight into caller buffers (the engine's
        decode path; checks cost O(1) Python on the C++ path).

        ``segs``: tuple of 1..16 ``(identity (32 B), rows, row_limit, out)``; ``rows`` a 1-D
        C-contiguous int64/uint64 array, ``out`` a writable C-contiguous uint8 ``[len(rows), 264]``
        array; several segments need ``self.version >= 2`` (one ``OP_LOOKUP_MULTI``), one is a
        version-1 ``OP_LOOKUP``.  At most ``MAX_ROWS`` rows in all.  Returns ``(0, total, 0)``
        when the rows were written; without sending anything: ``(2, k, 0)`` when segment k's
        rows are not such an array, ``(3, k, i)`` when its id i is outside ``[0, row_limit)``,
        ``(4, k, 0)`` for a bad ``out``, ``(2, 0, 0)`` for more than ``max_rows`` rows in all
        (the caller's large-lookup path).  Raises ``Refused`` (connection kept),
        ``TransportTimeout`` or ``TransportError`` (connection closed).
        """
        if self.sock is None:
            raise TransportError(f"not connected to {self.endpoint}")
        gen = next(self._gen)
        if self._fast is not None:
            if len(segs) > 1 and self.version < 2:
                raise ValueError(f"{self.endpoint} speaks protocol version 1: one table per request")
            code, a, b = self._fast(
                self.sock.fileno(),
                gen,
                self.version,
                segs,
                int(timeout_s * 1e9),
                self._spin_ns,
                min(max_rows, P.MAX_ROWS),
            )
            if code == 0 or code >= 2:
                return code, a, b
            if code == 1:
                raise Refused(a, P.status_name(a))
            self._native_error(code)
        return self._lookup_segs_py(gen, segs, timeout_s, min(max_rows, P.MAX_ROWS))

    def _lookup_segs_py(self, gen: int, segs: tuple, timeout_s: float, max_rows: int) -> tuple[int, int, int]:
        if len(segs) > 1 and self.version < 2:
            raise ValueError(f"{self.endpoint} speaks protocol version 1: one table per request")
        code, a, total = check_segments(segs)
        if code:
            return code, a, total
        if total > max_rows:
            return 2, 0, 0
        deadline = time.monotonic() + timeout_s
        if len(segs) == 1:
            ver, op, ident, count = P.VERSION, P.OP_LOOKUP, segs[0][0], total
            bufs = [P.REQ.pack(P.MAGIC, ver, op, gen, ident, count, 8 * total), segs[0][1]]
        else:
            ver, op, count = self.version, P.OP_LOOKUP_MULTI, len(segs)
            heads = b"".join(P.SEG.pack(s[0], s[1].shape[0], 0) for s in segs)
            bufs = [P.REQ.pack(P.MAGIC, ver, op, gen, bytes(32), count, len(heads) + 8 * total), heads]
            bufs += [s[1] for s in segs]
        self._send_all(bufs, deadline)
        status, rcount, plen = self._reply_header(gen, deadline, ver)
        if status != P.ST_OK:
            raise self._refusal(status, plen, deadline)
        if rcount != total or plen != total * P.ROW_BYTES:
            raise self._fail(TransportError(f"{self.endpoint} sent {rcount} rows, expected {total}"))
        for s in segs:
            if s[1].shape[0]:
                self._recv_into(memoryview(s[3]).cast("B"), deadline)
        return 0, total, 0

    def lookup_many(
        self,
        identity: bytes,
        rows: np.ndarray,
        out: np.ndarray,
        timeout_s: float,
        chunk_rows: int = 16384,
        window: int = 4,
        end: float | None = None,
    ) -> None:
        """Fetch any number of rows into ``out`` (C-contiguous uint8 ``[N, 264]``) as requests of
        ``chunk_rows`` rows; on the C++ path up to ``window`` requests are in flight at once
        (the server gathers the next piece while this client receives the previous one).
        Each reply must arrive within ``timeout_s`` of the previous one, and all of them by
        ``end`` (a ``time.monotonic()`` instant: the caller's whole-call deadline; None: no such
        bound).  Raises like ``lookup_into`` (``TransportTimeout`` once either bound passes);
        after any error the connection is closed.
        """
        if self.sock is None:
            raise TransportError(f"not connected to {self.endpoint}")
        n = int(rows.shape[0])
        if out.dtype != np.uint8 or out.shape != (n, P.ROW_BYTES) or not out.flags.c_contiguous:
            raise ValueError("out must be a C-contiguous uint8[N, 264] array")
        if not 1 <= chunk_rows <= P.MAX_ROWS:
            raise ValueError(f"chunk_rows must be in 1..{P.MAX_ROWS}")
        rows = np.ascontiguousarray(rows, dtype="<u8")
        if n == 0:
            return
        if not self.native:
            try:
                for s in range(0, n, chunk_rows):
                    t = timeout_s if end is None else min(timeout_s, end - time.monotonic())
                    if t <= 0:
                        raise self._fail(TransportTimeout(f"request to {self.endpoint} missed the lookup deadline"))
                    self.lookup_into(identity, rows[s : s + chunk_rows], [out[s : s + chunk_rows]], t)
            except Refused:
                self.close()  # same contract as the pipelined path
                raise
            return
        nchunks = -(-n // chunk_rows)
        gen0 = next(self._gen)
        self._gen = itertools.count(gen0 + nchunks)
        code, status, _ = _native._fastrow.client_lookup_many(
            self.sock.fileno(),
            gen0,
            identity,
            rows,
            out,
            chunk_rows,
            window,
            int(timeout_s * 1e9),
            int(self.spin_s * 1e9),
            0 if end is None else max(1, int(end * 1e9)),  # time.monotonic() is CLOCK_MONOTONIC, as the C++ now_ns()
        )
        if code == 0:
            return
        if code == 1:
            # other pipelined requests may still be in flight: the stream cannot be reused
            raise self._fail(Refused(status, P.status_name(status)))
        self._native_error(code)

    def lend(self) -> tuple[int, int, int, int]:
        """Hand the connection's requests to a C++ caller (the vLLM overlay's worker core,
        ``dsv41.overlay._core.EngramCore``): returns ``(fd, next_generation, version, spin_ns)``; from then on
        this client sends nothing (its lookups raise ``TransportError``) and only ``close`` is
        called, after the caller stopped using the socket. Raises ``TransportError`` when the
        client is closed or has no C++ path."""
        if self.sock is None or self._fast is None:
            raise TransportError(f"cannot lend the connection to {self.endpoint}: closed or no C++ path")
        gen = next(self._gen)
        fd = self.sock.fileno()
        # the socket stays open (the borrower's fd) until close(); this object's own requests see
        # no socket and raise "not connected"
        self._lent_sock, self.sock = self.sock, None
        return fd, gen, self.version, self._spin_ns

    def native_failure(self, code: int, status: int) -> TransportError:
        """The exception of a C++ request's code (``client_lookup_segs``' codes; 1: refused with
        ``status``) made on a lent connection; closes this client unless refused."""
        if code == 1:
            return Refused(status, P.status_name(status))
        try:
            self._native_error(code)
        except TransportError as exc:
            return exc
        return TransportError(f"connection to {self.endpoint} failed")  # not reached: _native_error raises

    def _native_error(self, code: int) -> None:
        if code == -1:
            raise self._fail(TransportTimeout(f"request to {self.endpoint} timed out"))
        if code == -3:
            raise self._fail(TransportError(f"{self.endpoint} replied to another request (generation mismatch)"))
        if code == -4:
            raise self._fail(TransportError(f"{self.endpoint} sent a malformed reply"))
        raise self._fail(TransportError(f"connection to {self.endpoint} failed"))

    def _native_lookup(self, identity: bytes, gen: int, rows: np.ndarray, dests: list, timeout_s: float) -> None:
        code, a, _ = _native._fastrow.client_lookup(
            self.sock.fileno(), gen, identity, rows, dests, int(timeout_s * 1e9), int(self.spin_s * 1e9)
        )
        if code == 0:
            return
        if code == 1:
            raise Refused(a, P.status_name(a))
        self._native_error(code)
