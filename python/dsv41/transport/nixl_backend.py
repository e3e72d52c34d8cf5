"""NIXL backend of the row transport: one-sided READs of registered table memory.

Server side (``NixlExporter``): one NIXL agent registers each table's weight and scale regions
once and answers the control-channel handshake (``OP_NIXL_HELLO`` on the ``nixl://`` TCP port)
with its agent metadata and one strided descriptor list per table (weights: ``rows`` blocks of
256 B; scales: ``rows`` blocks of 8 B).  The server's CPU is not on the data path.

Client side (``NixlClient``): the handshake sends the identities the client expects; the server
refuses a mismatch before sharing any descriptor.  Lookups are bounds-checked locally before a
READ is posted, then READ straight into a registered staging slot (weights to bytes 0..255 and
scales to 256..263 of each 264 B staging row) and copied to the caller.  A READ still in flight
at its deadline keeps its staging slot quarantined until NIXL reports it finished or the
connection is torn down, so its late bytes can never land in a slot that is being reused.

NIXL is imported lazily (``nixl_cu12._api``; runs without torch).  UCX picks its transports from
the environment: ``UCX_TLS=tcp`` in tests, ``UCX_TLS=rc,tcp`` plus ``UCX_NET_DEVICES`` on RoCE.
"""

from __future__ import annotations

import base64
import itertools
import mmap
import os
import threading
import time
import uuid

import numpy as np

from dsv41 import envs, fileio
from dsv41.transport import protocol as P
from dsv41.transport.errors import Refused, TransportError, TransportTimeout
from dsv41.transport.tcp import TcpClient, check_segments
from dsv41.transport.url import Endpoint

_agent_seq = itertools.count(1)


def _nixl_api():
    try:
        from nixl_cu12 import _api
    except ImportError as exc:  # pragma: no cover - the venv pins nixl-cu12
        raise TransportError(f"NIXL is not installed ({exc}); install nixl-cu12 --no-deps") from None
    return _api


def _quiet_nixl_logs() -> None:
    import logging

    logging.getLogger("nixl_cu12").setLevel(logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("nixl"):
            logging.getLogger(name).setLevel(logging.WARNING)


# Progress-thread delay (us) of the server's agent (DSV41_NIXL_PROGRESS_DELAY_US).  nixl_cu12's Python wrapper hard-codes 0,
# which makes the UCX progress thread busy-spin a whole core even when idle (measured here: ~93%
# of a core, and 24-row lookups at ~8 ms p50 on the 2-core host).  With a delay (default 1000) the
# thread waits between polls and arriving data still wakes it: ~2% idle CPU, 24-row lookups
# ~1.1 ms p50 (10, 100 and 1000 us measured alike).  ``DSV41_NIXL_PROGRESS_DELAY_US=0`` restores
# spinning.
_agent_lock = threading.Lock()


class _BindWithDelay:
    """Stand-in for nixl_cu12's binding module while one agent is built: forwards everything,
    but sets the agent config's ``pthrDelay`` before the agent is created."""

    def __init__(self, real, delay_us: int) -> None:
        self._real, self._delay = real, delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, cfg):  # noqa: N802 - mirrors the binding's name
        cfg.pthrDelay = self._delay
        return self._real.nixlAgent(name, cfg)


def _agent(prefix: str, progress_thread: bool):
    api = _nixl_api()
    _quiet_nixl_logs()
    name = f"{prefix}-{os.getpid()}-{next(_agent_seq)}-{uuid.uuid4().hex[:8]}"
    delay_us = envs.parse().nixl_progress_delay_us if progress_thread else 0
    try:
        with _agent_lock:
            real = api.nixlBind
            if delay_us > 0:
                api.nixlBind = _BindWithDelay(real, delay_us)
            try:
                agent = api.nixl_agent(
                    name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
                )
            finally:
                api.nixlBind = real
    except Exception as exc:  # NIXL raises plain RuntimeError/nixlBind errors
        raise TransportError(f"cannot create a NIXL agent: {exc}") from None
    if "UCX" not in agent.backends:
        raise TransportError("NIXL has no UCX backend on this host")
    return agent


class NixlExporter:
    """Registers resident tables with NIXL once and answers handshakes.

    ``tables``: ``dsv41.transport.server.RowTable`` list (their arrays must outlive the
    exporter).  Raises ``TransportError`` when NIXL or UCX cannot be initialised.
    """

    def __init__(self, tables) -> None:
        # The server's progress thread answers READs over UCX's TCP emulation; on RDMA it idles.
        self.agent = _agent("dsv41-engram-server", progress_thread=True)
        self.tables = {t.identity: t for t in tables}
        regs = []
        for t in tables:
            regs.append((t.weight.ctypes.data, t.weight.nbytes, 0, ""))
            regs.append((t.scale.ctypes.data, t.scale.nbytes, 0, ""))
        try:
            self._reg = self.agent.register_memory(regs, "DRAM")
        except Exception as exc:
            raise TransportError(f"NIXL could not register the tables: {exc}") from None
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def handshake(self, identities: list[bytes]) -> bytes:
        """JSON reply for a client that expects ``identities`` (all already checked to exist):
        agent name and metadata, and per table the strided descriptors of its two regions."""
        out = []
        for ident in identities:
            t = self.tables[ident]
            out.append(
                {
                    "identity": ident.hex(),
                    "layer_id": t.layer_id,
                    "rows": t.rows,
                    "weight": [t.weight.ctypes.data, P.WEIGHT_BYTES, 0, P.WEIGHT_BYTES, t.rows],
                    "scale": [t.scale.ctypes.data, P.SCALE_BYTES, 0, P.SCALE_BYTES, t.rows],
                }
            )
        return fileio.dumps_json(
            {"version": P.VERSION, "agent": self.agent.name, "metadata": self._metadata, "tables": out}
        ).encode()

    def close(self) -> None:
        """Deregister the tables (call after the server stopped)."""
        try:
            self.agent.deregister_memory(self._reg)
        except Exception:
            pass


class NixlClient:
    """Client of a ``nixl://`` endpoint: handshake over TCP, then one-sided READs.

    ``identities``: the tables this client expects (raw 32 B each); a server lacking any of them
    refuses (``Refused`` with reason ``wrong_identity``) before sharing descriptors.
    ``staging_rows``: rows per staging slot (a larger lookup is READ in chunks);
    ``slots``: staging slots (quarantined slots wait here until their READ finishes).
    Raises ``TransportError`` / ``TransportTimeout`` when the server cannot be reached.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        identities: list[bytes],
        timeout_s: float = 2.0,
        staging_rows: int = 16384,
        slots: int = 4,
    ) -> None:
        self.endpoint = endpoint
        self.staging_rows = staging_rows
        self.nslots = slots
        self.ctrl = TcpClient(endpoint, connect_timeout_s=timeout_s)
        self.agent = None
        self._closed = False
        self._lock = threading.Lock()
        try:
            ids = [P.identity_bytes(i) for i in identities]
            count, body = self.ctrl.request(P.OP_NIXL_HELLO, bytes(32), len(ids), b"".join(ids), timeout_s)
            try:
                info = fileio.loads_json(body)
                md = base64.b64decode(info["metadata"])
                tables = info["tables"]
            except (ValueError, KeyError, TypeError):
                raise TransportError(f"{endpoint} sent a malformed NIXL handshake") from None
            if len(tables) != len(ids) or [bytes.fromhex(t["identity"]) for t in tables] != ids:
                raise TransportError(f"{endpoint} answered the NIXL handshake for other tables")
            # No progress thread on the client: polling the transfer drives progress, and a
            # second thread waking up costs milliseconds on a loaded host (measured).
            self.agent = _agent("dsv41-engram-client", progress_thread=False)
            self.remote = self.agent.add_remote_agent(md)
            # Remote descriptor list: per table, [weights (rows blocks), scales (rows blocks)].
            self.tables: dict[bytes, tuple[int, int, int]] = {}  # identity -> (rows, wbase, sbase)
            strided, base = [], 0
            for t in tables:
                rows = int(t["rows"])
                strided.append([int(x) for x in t["weight"]])
                strided.append([int(x) for x in t["scale"]])
                self.tables[bytes.fromhex(t["identity"])] = (rows, base, base + rows)
                base += 2 * rows
            if base > np.iinfo(np.int32).max:
                # prepped-transfer indices are int32: a larger descriptor list would wrap to wrong rows
                raise TransportError(f"{endpoint}: {base} row descriptors exceed NIXL's int32 indices")
            self.remote_dlist = self.agent.prep_xfer_dlist(self.remote, np.array(strided, dtype=np.uint64), "DRAM")
            total = staging_rows * slots
            self._staging_mem = mmap.mmap(-1, total * P.ROW_BYTES)
            self.staging = np.frombuffer(self._staging_mem, np.uint8).reshape(total, P.ROW_BYTES)
            addr = self.staging.ctypes.data
            self._reg = self.agent.register_memory([(addr, self.staging.nbytes, 0, "")], "DRAM")
            self.local_dlist = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                np.array(
                    [
                        [addr, P.WEIGHT_BYTES, 0, P.ROW_BYTES, total],
                        [addr + P.WEIGHT_BYTES, P.SCALE_BYTES, 0, P.ROW_BYTES, total],
                    ],
                    dtype=np.uint64,
                ),
                "DRAM",
            )
            self._total = total
            # Local descriptor indices of each slot, weight and scale of a row side by side, so
            # the first 2k entries serve a k-row READ (built once, not per lookup).
            loc = np.arange(total, dtype=np.int32)
            self._li = np.empty(2 * total, np.int32)
            self._li[0::2], self._li[1::2] = loc, loc + total
            self._free = list(range(slots))
            self._quarantine: dict[int, object] = {}  # slot -> in-flight xfer handle
            # UCX wires its endpoint up lazily on the first transfer, which can take longer than
            # a lookup's deadline (100 ms) on a loaded host: pay it here, under the connect
            # timeout, so the first real lookup does not time out and fall back.
            self._warm_up(timeout_s)
        except BaseException:
            self.close()
            raise

    def _warm_up(self, timeout_s: float) -> None:
        """READ row 0 of the first table once (raises like ``lookup_into``)."""
        _, wbase, sbase = next(iter(self.tables.values()))
        slot = self._free.pop()
        li, ri = self._indices(slot, [(np.zeros(1, np.int64), wbase, sbase)])
        self._read(slot, li, ri, time.monotonic() + timeout_s)  # a timeout leaves the slot quarantined
        self._free.append(slot)

    def _indices(self, slot: int, parts: list) -> tuple[np.ndarray, np.ndarray]:
        """Descriptor indices of one READ into staging ``slot``: ``parts`` = [(ids int64/uint64[k],
        weight base, scale base)] of at most ``staging_rows`` rows in all, in staging order.
        Returns int32 ``(local, remote)`` of 2 per row (weight, scale); O(rows requested),
        whatever the table size (the remote list is the server's strided regions)."""
        k = sum(p[0].shape[0] for p in parts)
        ri = np.empty(2 * k, np.int32)
        o = 0
        for ids, wbase, sbase in parts:
            m = ids.shape[0]
            ids = ids.view(np.int64) if ids.dtype == np.uint64 else ids  # checked < rows < 2**31
            np.add(ids, wbase, out=ri[2 * o : 2 * (o + m) : 2], casting="unsafe")
            np.add(ids, sbase, out=ri[2 * o + 1 : 2 * (o + m) : 2], casting="unsafe")
            o += m
        b = 2 * slot * self.staging_rows
        return self._li[b : b + 2 * k], ri

    #: ``lookup_segs`` reads several tables in one NIXL transfer (no server protocol involved).
    multi_table = True

    def lookup_segs(self, segs: tuple, timeout_s: float, max_rows: int = P.MAX_ROWS) -> tuple[int, int, int]:
        """Rows of 1..16 tables, ``segs`` and return codes as ``TcpClient.lookup_segs``; when
        they fit one staging slot, every segment's rows go in one READ (one transfer to post
        and poll), else one table after another through ``lookup_into``.  Raises like
        ``lookup_into``."""
        code, a, total = check_segments(segs)
        if code:
            return code, a, total
        if total > max_rows:
            return 2, 0, 0
        if total > self.staging_rows or len(segs) == 1:
            for ident, rows, _, out in segs:
                self.lookup_into(ident, rows, [out], timeout_s)
            return 0, total, 0
        with self._lock:
            if self._closed or self.agent is None:
                raise TransportError(f"not connected to {self.endpoint}")
            parts = []
            for ident, rows, _, _ in segs:
                entry = self.tables.get(ident)
                if entry is None:
                    raise Refused(P.ST_WRONG_IDENTITY, "wrong_identity")
                nrows, wbase, sbase = entry
                if rows.shape[0] and int(rows.view(np.uint64).max()) >= nrows:
                    raise Refused(P.ST_OUT_OF_RANGE, "out_of_range")  # checked before any READ
                parts.append((rows, wbase, sbase))
            deadline = time.monotonic() + timeout_s
            self._reap()
            if not self._free:
                raise TransportError(f"{self.endpoint}: every NIXL staging slot is quarantined")
            slot = self._free.pop()
            base = slot * self.staging_rows
            try:
                li, ri = self._indices(slot, parts)
                self._read(slot, li, ri, deadline)
            except TransportTimeout:
                raise  # the slot stays quarantined
            except BaseException:
                self._free.append(slot)
                raise
            o = base
            for _, rows, _, out in segs:
                out[...] = self.staging[o : o + rows.shape[0]]
                o += rows.shape[0]
            self._free.append(slot)
        return 0, total, 0

    @property
    def quarantined(self) -> int:
        """Number of staging slots held by abandoned READs."""
        return len(self._quarantine)

    def _reap(self) -> None:
        for slot, h in list(self._quarantine.items()):
            try:
                st = self.agent.check_xfer_state(h)
            except Exception:
                st = "ERR"
            if st != "PROC":
                try:
                    h.release()
                except Exception:
                    pass
                del self._quarantine[slot]
                self._free.append(slot)

    def lookup_into(self, identity: bytes, rows: np.ndarray, dests: list[np.ndarray], timeout_s: float) -> None:
        """READ ``rows`` (uint64[N], global ids) of table ``identity`` into ``dests``
        (C-contiguous uint8 ``[n_i, 264]``, 1..16 ranges, ``sum(n_i) == N``).

        Raises ``Refused`` (unknown identity / out of range; nothing posted),
        ``TransportTimeout`` (slot quarantined) or ``TransportError``.
        """
        with self._lock:
            if self._closed or self.agent is None:
                raise TransportError(f"not connected to {self.endpoint}")
            entry = self.tables.get(identity)
            if entry is None:
                raise Refused(P.ST_WRONG_IDENTITY, "wrong_identity")
            nrows, wbase, sbase = entry
            rows = np.ascontiguousarray(rows, dtype=np.uint64)
            n = rows.shape[0]
            if sum(d.shape[0] for d in dests) != n or not 1 <= len(dests) <= 16:
                raise ValueError("destinations must hold exactly the requested rows in 1..16 ranges")
            if n and int(rows.max()) >= nrows:
                raise Refused(P.ST_OUT_OF_RANGE, "out_of_range")  # checked before any READ
            deadline = time.monotonic() + timeout_s
            self._reap()
            if not self._free:
                raise TransportError(f"{self.endpoint}: every NIXL staging slot is quarantined")
            slot = self._free.pop()
            try:
                flat = np.concatenate(dests) if len(dests) > 1 else dests[0]
                for s in range(0, n, self.staging_rows):
                    r = rows[s : s + self.staging_rows]
                    k = r.shape[0]
                    li, ri = self._indices(slot, [(r, wbase, sbase)])
                    self._read(slot, li, ri, deadline)
                    flat[s : s + k] = self.staging[slot * self.staging_rows : slot * self.staging_rows + k]
                if len(dests) > 1:
                    o = 0
                    for d in dests:
                        d[...] = flat[o : o + d.shape[0]]
                        o += d.shape[0]
            except TransportTimeout:
                raise  # the slot stays quarantined
            except BaseException:
                self._free.append(slot)
                raise
            self._free.append(slot)

    def _read(self, slot: int, li: np.ndarray, ri: np.ndarray, deadline: float) -> None:
        try:
            h = self.agent.make_prepped_xfer("READ", self.local_dlist, li, self.remote_dlist, ri)
            st = self.agent.transfer(h)
        except Exception as exc:
            raise TransportError(f"NIXL READ from {self.endpoint} failed to post: {exc}") from None
        spins = 0
        while st == "PROC":
            if time.monotonic() >= deadline:
                self._quarantine[slot] = h
                raise TransportTimeout(f"NIXL READ from {self.endpoint} timed out")
            spins += 1
            if spins > 2000:
                time.sleep(50e-6)  # stop hogging a core once the READ is clearly slow
            try:
                st = self.agent.check_xfer_state(h)
            except Exception:
                st = "ERR"
        try:
            h.release()
        except Exception:
            pass
        if st != "DONE":
            raise TransportError(f"NIXL READ from {self.endpoint} failed")

    def close(self) -> None:
        """Tear down: abandon quarantined READs, deregister staging, drop the remote agent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.ctrl is not None:
                self.ctrl.close()
            agent = self.agent
            if agent is None:
                return
            for h in list(getattr(self, "_quarantine", {}).values()):
                try:
                    h.release()
                except Exception:
                    pass
            for attr in ("local_dlist", "remote_dlist"):
                d = getattr(self, attr, None)
                if d is not None:
                    try:
                        d.release()
                    except Exception:
                        pass
            if getattr(self, "_reg", None) is not None:
                try:
                    agent.deregister_memory(self._reg)
                except Exception:
                    pass
            if getattr(self, "remote", None):
                try:
                    agent.remove_remote_agent(self.remote)
                except Exception:
                    pass
            self.agent = None
