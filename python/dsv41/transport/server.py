"""Row server core: serves rows of resident tables over the TCP framing (``protocol``).

Transport only: the tables (``RowTable``) are handed in already loaded and verified by
``dsv41.engram.server``.  One accept thread per listen address, one thread per client with its
own buffers, so a client's bad frame closes at most that client's connection.  ``stop()`` drains:
listeners close first, each client finishes the request it is serving, then its socket closes.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dsv41 import envs
from dsv41.transport import native as _native, protocol as P
from dsv41.transport.url import Endpoint

# Rows gathered per send while streaming a large reply: 16384 rows = 4.3 MB per client.
GATHER_CHUNK = 16384
# Latency histogram bucket upper bounds (seconds) of server-side request handling.
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0)


@dataclass
class RowTable:
    """One resident table.

    ``identity``: 32 raw bytes (sha256 from the manifest); ``weight``: uint8 ``[rows, 256]``;
    ``scale``: uint8 ``[rows, 8]`` (both C-contiguous, kept alive by the caller for the server's
    lifetime; NIXL registers their memory).
    """

    identity: bytes
    layer_id: int
    weight: np.ndarray
    scale: np.ndarray

    @property
    def rows(self) -> int:
        """Rows of the table (``weight.shape[0]``)."""
        return int(self.weight.shape[0])


@dataclass
class ServerStats:
    """Counters of a running server (read by the Prometheus collector; guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    rows: int = 0
    refusals: dict = field(default_factory=dict)  # reason -> count
    connections: int = 0
    connections_total: int = 0
    client_errors: int = 0
    nixl_handshakes: int = 0
    latency_buckets: list = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def observe(self, seconds: float, rows: int) -> None:
        """Count one served request of ``rows`` rows that took ``seconds`` (histogram bucket)."""
        with self.lock:
            self.requests += 1
            self.rows += rows
            self.latency_sum += seconds
            i = 0
            for i, b in enumerate(LATENCY_BUCKETS):  # noqa: B007 - index used after the loop
                if seconds <= b:
                    break
            else:
                i = len(LATENCY_BUCKETS)
            self.latency_buckets[i] += 1

    def refuse(self, reason: str) -> None:
        """Count one refusal under ``reason`` (``protocol.status_name``)."""
        with self.lock:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def snapshot(self) -> dict:
        """Consistent copy of every counter (dict; ``latency_buckets`` per LATENCY_BUCKETS + inf)."""
        with self.lock:
            return {
                "requests": self.requests,
                "rows": self.rows,
                "refusals": dict(self.refusals),
                "connections": self.connections,
                "connections_total": self.connections_total,
                "client_errors": self.client_errors,
                "nixl_handshakes": self.nixl_handshakes,
                "latency_buckets": list(self.latency_buckets),
                "latency_sum": self.latency_sum,
            }


class _Closed(Exception):
    pass


def _recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got, n = 0, len(mv)
    while got < n:
        r = sock.recv_into(mv[got:])
        if r == 0:
            raise _Closed
        got += r


class RowServer:
    """Serve ``tables`` on each endpoint of ``listens`` (``tcp://`` and ``nixl://``; port 0 =
    ephemeral, see ``addresses`` after ``start``).

    ``nixl_provider``: object with ``handshake(identities: list[bytes]) -> bytes`` (JSON reply),
    required when a ``nixl://`` endpoint is given (``dsv41.transport.nixl_backend.NixlExporter``).
    ``native``: use the C++ request loop (default: when built, see ``transport.native``).
    ``spin_us``: busy-poll budget (microseconds, int >= 0) of a client thread of the C++ loop
    waiting for that client's next request before it blocks; None: ``DSV41_TRANSPORT_SERVER_SPIN_US``
    (default 0: off).  A request that arrives inside the budget skips a thread wake-up; each
    request may cost up to that much CPU, and a client sharing the spinning thread's core waits
    it out (measured: docs/benchmarks.md; docs/remote-engram.md, "Busy-poll").  The pure-Python loop
    always blocks (it is the fallback, not the latency path).
    ``max_connections`` (default ``DSV41_TRANSPORT_SERVER_MAX_CONNECTIONS``): a connection past
    this many open ones, or past half of them from one client address, is closed at once
    (refusal ``connection_cap``); ``send_timeout_s`` (default
    ``DSV41_TRANSPORT_SERVER_SEND_TIMEOUT_S``): every client socket's SO_SNDTIMEO, so a client
    that stops reading its answer is disconnected after it (both loops). Together they bound the
    memory clients can hold.
    Raises ``OSError`` from ``start`` when an address cannot be bound, ``ValueError`` for a
    negative ``spin_us`` or a bad bound.
    """

    def __init__(
        self,
        tables: list[RowTable],
        listens: list[Endpoint],
        nixl_provider=None,
        native: bool | None = None,
        spin_us: int | None = None,
        max_connections: int | None = None,
        send_timeout_s: float | None = None,
    ) -> None:
        settings = envs.parse() if None in (spin_us, max_connections, send_timeout_s) else None
        if spin_us is None:
            spin_us = settings.transport_server_spin_us
        self.max_connections = settings.transport_server_max_connections if max_connections is None else max_connections
        self.send_timeout_s = settings.transport_server_send_timeout_s if send_timeout_s is None else send_timeout_s
        if self.max_connections < 1 or not self.send_timeout_s > 0:
            raise ValueError("max_connections must be >= 1 and send_timeout_s > 0")
        self.per_client = max(1, self.max_connections // 2)
        self._per_addr: collections.Counter = collections.Counter()
        if not spin_us >= 0:  # also refuses NaN
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        self.spin_us = spin_us
        self.tables = {t.identity: t for t in tables}
        if len(self.tables) != len(tables):
            raise ValueError("two tables share one identity")
        self.listens = list(listens)
        self.nixl_provider = nixl_provider
        self.stats = ServerStats()
        self.addresses: list[Endpoint] = []
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._clients: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._clients_lock = threading.Lock()
        self._stopping = threading.Event()
        self._hello = b"".join(P.TABLE_ENTRY.pack(t.identity, t.layer_id, t.rows, P.ROW_BYTES) for t in tables)
        self.native = _native.use_native(native)
        self._core = None
        if self.native:
            self._core = _native._fastrow.ServerCore()
            self._core.set_spin_ns(int(spin_us * 1000))
            for t in tables:
                self._core.add_table(t.identity, t.layer_id, t.weight, t.scale)

    def snapshot(self) -> dict:
        """Counters (``ServerStats.snapshot`` merged with the C++ loop's counters)."""
        snap = self.stats.snapshot()
        if self._core is not None:
            c = self._core.stats()
            snap["requests"] += c["requests"]
            snap["rows"] += c["rows"]
            snap["latency_sum"] += c["latency_sum"]
            snap["latency_buckets"] = [
                a + b for a, b in zip(snap["latency_buckets"], c["latency_buckets"], strict=False)
            ]
            for code, n in c["refusals"].items():
                name = P.status_name(int(code))
                snap["refusals"][name] = snap["refusals"].get(name, 0) + n
        return snap

    def nixl_reply(self, count: int, payload: bytes) -> tuple[int, bytes]:
        """Answer a NIXL handshake: ``(status, body)``.  Identities are checked before any
        descriptor or NIXL metadata is produced."""
        if self.nixl_provider is None:
            return P.ST_NOT_SUPPORTED, b""
        if count == 0 or count * P.IDENTITY_BYTES != len(payload):
            return P.ST_BAD_FRAME, b""
        wanted = [bytes(payload[i * 32 : (i + 1) * 32]) for i in range(count)]
        if any(w not in self.tables for w in wanted):
            return P.ST_WRONG_IDENTITY, b""
        body = self.nixl_provider.handshake(wanted)
        with self.stats.lock:
            self.stats.nixl_handshakes += 1
        return P.ST_OK, body

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> list[Endpoint]:
        """Bind and listen on every endpoint; returns the bound endpoints (ports resolved)."""
        try:
            for ep in self.listens:
                if ep.scheme == "nixl" and self.nixl_provider is None:
                    raise ValueError(f"{ep}: nixl listen address needs a NIXL exporter")
                fam = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
                s = socket.socket(fam, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((ep.host, ep.port))
                s.listen(64)
                self._listeners.append(s)
                self.addresses.append(Endpoint(ep.scheme, ep.host, s.getsockname()[1]))
        except BaseException:
            for s in self._listeners:
                s.close()
            self._listeners.clear()
            self.addresses.clear()
            raise
        for s, ep in zip(self._listeners, self.addresses, strict=False):
            t = threading.Thread(target=self._accept_loop, args=(s, ep), name=f"accept-{ep}", daemon=True)
            t.start()
            self._threads.append(t)
        return list(self.addresses)

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop accepting, let each client finish its current request, close everything."""
        self._stopping.set()
        if self._core is not None:
            self._core.set_stopping(True)
        for s in self._listeners:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(timeout=drain_timeout_s)
        with self._clients_lock:
            clients = list(self._clients.values())
        for sock, _ in clients:
            try:
                sock.shutdown(socket.SHUT_RD)  # wakes the handler's recv; its reply still goes out
            except OSError:
                pass
        deadline = time.monotonic() + drain_timeout_s
        for _, t in clients:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- threads ---------------------------------------------------------------------------
    def _accept_loop(self, lsock: socket.socket, ep: Endpoint) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = lsock.accept()
            except OSError:
                return  # listener closed by stop()
            if self._stopping.is_set():
                sock.close()
                return
            addr = str(peer[0]) if isinstance(peer, tuple) else "?"
            with self._clients_lock:
                full = len(self._clients) >= self.max_connections or self._per_addr[addr] >= self.per_client
                if not full:
                    self._per_addr[addr] += 1
            if full:
                self.stats.refuse("connection_cap")
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sec = int(self.send_timeout_s)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, int((self.send_timeout_s - sec) * 1e6))
            )
            t = threading.Thread(target=self._client_loop, args=(sock, ep.scheme == "nixl", addr), daemon=True)
            with self._clients_lock:
                self._clients[id(t)] = (sock, t)
            with self.stats.lock:
                self.stats.connections += 1
                self.stats.connections_total += 1
            t.start()

    def _client_loop(self, sock: socket.socket, nixl: bool, addr: str = "?") -> None:
        try:
            if self._core is not None:
                self._native_loop(sock, nixl)
            else:
                _Conn(self, sock, nixl).run()
        except (_Closed, OSError):
            pass
        except Exception:  # a bug must cost this client its connection, never the server
            with self.stats.lock:
                self.stats.client_errors += 1
        finally:
            sock.close()
            with self._clients_lock:
                self._clients.pop(id(threading.current_thread()), None)
                self._per_addr[addr] -= 1
                if self._per_addr[addr] <= 0:
                    del self._per_addr[addr]
            with self.stats.lock:
                self.stats.connections -= 1

    def _native_loop(self, sock: socket.socket, nixl: bool) -> None:
        conn = _native._fastrow.Connection(self._core, sock.fileno(), nixl)
        while True:
            handed = conn.run()  # GIL released while serving
            if handed is None:
                return
            op, rid, count, payload = handed  # only OP_NIXL_HELLO is handed back
            status, body = self.nixl_reply(count, payload)
            if not conn.reply(status, rid, count if status == P.ST_OK else 0, body):
                return


class _Conn:
    """Per-client state: its own header, payload and gather buffers."""

    def __init__(self, server: RowServer, sock: socket.socket, nixl: bool) -> None:
        self.srv = server
        self.sock = sock
        self.nixl = nixl
        self.hdr = bytearray(P.REQ.size)
        self.hdr_mv = memoryview(self.hdr)
        self.payload = bytearray(4096)
        self.gather = np.empty((0, P.ROW_BYTES), np.uint8)
        self.ver = P.VERSION  # version of the request being answered (replies echo it)

    def reply(self, status: int, rid: int, count: int = 0, payload=b"") -> None:
        self.sock.sendall(P.REP.pack(P.MAGIC, self.ver, status, rid, count, len(payload)) + bytes(payload))

    def refuse(self, status: int, rid: int) -> None:
        self.srv.stats.refuse(P.status_name(status))
        self.reply(status, rid)

    def run(self) -> None:
        srv = self.srv
        while True:
            try:
                _recv_exact(self.sock, self.hdr_mv)
            except _Closed:
                return
            t0 = time.perf_counter()
            magic, ver, op, rid, ident, count, plen = P.REQ.unpack(self.hdr)
            self.ver = P.VERSION
            if magic != P.MAGIC:
                self.refuse(P.ST_BAD_MAGIC, rid)
                return  # cannot resynchronise
            if ver not in P.VERSIONS:
                self.ver = P.MAX_VERSION  # the refusal tells the peer the newest version spoken here
                self.refuse(P.ST_BAD_VERSION, rid)
                return
            self.ver = ver
            if plen > P.MAX_PAYLOAD:
                self.refuse(P.ST_OVERSIZE, rid)
                return
            if plen > len(self.payload):
                self.payload = bytearray(plen)
            pmv = memoryview(self.payload)[:plen]
            _recv_exact(self.sock, pmv)
            if srv._stopping.is_set():
                self.refuse(P.ST_SHUTTING_DOWN, rid)
                continue
            if op == P.OP_LOOKUP:
                self.lookup(rid, ident, count, pmv, t0)
            elif op == P.OP_LOOKUP_MULTI and ver >= 2:  # a version-1 frame: unknown_op, as before
                self.lookup_multi(rid, count, pmv, t0)
            elif op == P.OP_HELLO:
                self.reply(P.ST_OK, rid, len(srv.tables), srv._hello)
            elif op == P.OP_PING:
                self.reply(P.ST_OK, rid)
            elif op == P.OP_NIXL_HELLO:
                self.nixl_hello(rid, count, pmv)
            else:
                self.refuse(P.ST_UNKNOWN_OP, rid)

    def lookup(self, rid: int, ident: bytes, count: int, pmv: memoryview, t0: float) -> None:
        table = self.srv.tables.get(ident)
        if table is None:
            self.refuse(P.ST_WRONG_IDENTITY, rid)
            return
        if count * 8 != len(pmv):
            self.refuse(P.ST_BAD_FRAME, rid)
            return
        rows = np.frombuffer(pmv, dtype="<u8", count=count)
        if count and int(rows.max()) >= table.rows:
            self.refuse(P.ST_OUT_OF_RANGE, rid)
            return
        self.serve(rid, [(table, rows)], t0)

    def lookup_multi(self, rid: int, nseg: int, pmv: memoryview, t0: float) -> None:
        """Version 2: ``nseg`` segment headers, then every segment's ids (protocol.py)."""
        if not 1 <= nseg <= P.MAX_SEGMENTS or len(pmv) < nseg * P.SEG.size:
            self.refuse(P.ST_BAD_FRAME, rid)
            return
        heads = [P.SEG.unpack_from(pmv, k * P.SEG.size) for k in range(nseg)]
        total = sum(h[1] for h in heads)
        if any(h[2] for h in heads) or nseg * P.SEG.size + 8 * total != len(pmv):
            self.refuse(P.ST_BAD_FRAME, rid)
            return
        segs, off = [], nseg * P.SEG.size
        for ident, n, _ in heads:
            table = self.srv.tables.get(ident)
            if table is None:
                self.refuse(P.ST_WRONG_IDENTITY, rid)
                return
            segs.append((table, np.frombuffer(pmv, dtype="<u8", count=n, offset=off)))
            off += 8 * n
        if any(r.size and int(r.max()) >= t.rows for t, r in segs):
            self.refuse(P.ST_OUT_OF_RANGE, rid)
            return
        self.serve(rid, segs, t0)

    def serve(self, rid: int, segs: list, t0: float) -> None:
        """OK header, then the rows of ``segs`` ([(RowTable, uint64 ids)], bounds checked) in
        order, gathered and sent ``GATHER_CHUNK`` rows at a time."""
        count = sum(int(r.shape[0]) for _, r in segs)
        self.sock.sendall(P.REP.pack(P.MAGIC, self.ver, P.ST_OK, rid, count, count * P.ROW_BYTES))
        step = min(count, GATHER_CHUNK)
        if self.gather.shape[0] < step:
            self.gather = np.empty((step, P.ROW_BYTES), np.uint8)
        for table, rows in segs:
            for s in range(0, rows.shape[0], GATHER_CHUNK):
                r = rows[s : s + GATHER_CHUNK]
                out = self.gather[: r.shape[0]]
                # mode="clip" skips numpy's own bounds buffering; bounds were checked above.
                np.take(table.weight, r, axis=0, out=out[:, : P.WEIGHT_BYTES], mode="clip")
                np.take(table.scale, r, axis=0, out=out[:, P.WEIGHT_BYTES :], mode="clip")
                self.sock.sendall(out)
        self.srv.stats.observe(time.perf_counter() - t0, count)

    def nixl_hello(self, rid: int, count: int, pmv: memoryview) -> None:
        if not self.nixl:
            self.refuse(P.ST_NOT_SUPPORTED, rid)
            return
        status, body = self.srv.nixl_reply(count, bytes(pmv))
        if status != P.ST_OK:
            self.refuse(status, rid)
        else:
            self.reply(P.ST_OK, rid, count, body)
