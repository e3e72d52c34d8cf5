"""Shared-memory ring and host flags between the engine and the async proxy (torch-free).

One ``multiprocessing.shared_memory`` segment per proxy incarnation (a respawned proxy gets a
fresh segment, so no stale slot survives a crash). Layout, little-endian:

Header (512 bytes)::

    0   u32 magic 'DSRG'      4  u32 version (1)     8  u32 n_slots      12 u32 slot_size
    16  u32 proxy pid         20 u32 proxy state (ProxyState)
    24  u64 proxy heartbeat (CLOCK_MONOTONIC ns, written every proxy loop; before a call that
            may block, the time by which the proxy will beat again, i.e. in the future)
    32  u64 engine heartbeat (CLOCK_MONOTONIC ns, written by every engine call)
    40  u32 stop flag (engine -> proxy)
    44  u32 proxy memory locking (dsv41.drafter.memlock.MemlockState; 0 until the proxy reports)
    48  u64 x 8 proxy counters (PROXY_COUNTERS order)
    112 u16 n + 398 B last error message (utf-8)

Slot ``i`` at ``512 + i * (32 + slot_size)``: a 32-byte slot header then ``slot_size`` data bytes::

    0 u32 state (FREE, REQUEST, TAKEN, REPLY)   4 u32 status (protocol Status)
    8 u64 sequence (round generation)          16 u32 length   20 u32 crc32 of data[:length]
    24 u64 submit time (CLOCK_MONOTONIC ns)

The writer fills data, length, crc and sequence before it stores the state word; the reader
re-checks the CRC-32 after seeing the state, and treats a mismatch as "not ready yet", so a
torn or reordered write is never consumed (CLOCK_MONOTONIC is system-wide on Linux, so the
heartbeats of the two processes are comparable).
"""

from __future__ import annotations

import enum
import struct
import time
import zlib
from multiprocessing import shared_memory

from dsv41.errors import Dsv41Error

MAGIC = 0x47525344  # b"DSRG" little-endian
VERSION = 1
HEADER_SIZE = 512
SLOT_HEADER = struct.Struct("<IIQIIQ")  # 32 bytes
PROXY_COUNTERS = (
    "rounds",
    "rounds_ok",
    "timeouts",
    "refusals",
    "identity_refusals",
    "reconnects",
    "unavailable",
    "late_dropped",
)
_CREATED: set[str] = set()  # segments this process created (and its resource tracker owns)
_ERR_OFF = 112
_ERR_MAX = 398


class RingCorrupt(Dsv41Error):
    """The ring holds values no dsv41 writer produces (a state word outside its enum): the peer
    is broken or something else wrote into the segment; the engine treats it like a dead proxy."""


class SlotState(enum.IntEnum):
    """Slot life cycle: engine FREE -> REQUEST, proxy -> TAKEN -> REPLY, engine -> FREE."""

    FREE = 0
    REQUEST = 1
    TAKEN = 2
    REPLY = 3


class ProxyState(enum.IntEnum):
    """The proxy's connection state, published in the host flags (offset 20)."""

    STARTING = 0
    CONNECTED = 1
    DISCONNECTED = 2
    REFUSED = 3  # identity mismatch: the proxy will not draft with that worker
    STOPPED = 4


def _enum(kind, v: int, what: str):
    try:
        return kind(v)
    except ValueError:
        raise RingCorrupt(f"drafter ring: {what} {v:#x} is not a valid {kind.__name__}") from None


class Ring:
    """A shared-memory ring of request/reply slots plus host flags.

    ``Ring.create(n_slots, slot_size)`` (engine side; owns and unlinks the segment) or
    ``Ring.attach(name)`` (proxy side). Raises :class:`Dsv41Error` for a missing or foreign
    segment.
    """

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self.shm = shm
        self.buf = shm.buf
        self.owner = owner
        magic, version, self.n_slots, self.slot_size = struct.unpack_from("<IIII", self.buf, 0)
        if magic != MAGIC or version != VERSION:
            raise Dsv41Error(
                f"shared memory {shm.name}: not a dsv41 drafter ring (magic {magic:#x}, version {version})"
            )
        self.stride = SLOT_HEADER.size + self.slot_size
        need = HEADER_SIZE + self.n_slots * self.stride
        if not 1 <= self.n_slots <= 256 or not 64 <= self.slot_size <= (256 << 20) or shm.size < need:
            # a corrupt header must not let slot offsets run past the segment
            raise Dsv41Error(
                f"shared memory {shm.name}: ring header ({self.n_slots} slots of {self.slot_size} B) "
                f"does not fit its {shm.size} B"
            )

    @classmethod
    def create(cls, n_slots: int = 4, slot_size: int = 1 << 20) -> Ring:
        """Create a fresh segment (``n_slots`` in 1..256, ``slot_size`` bytes in 64..256 MiB) owned
        by this process; :class:`Dsv41Error` out of range, OSError when /dev/shm is full."""
        if not 1 <= n_slots <= 256 or not 64 <= slot_size <= (256 << 20):
            raise Dsv41Error(f"drafter ring: n_slots {n_slots} / slot_size {slot_size} out of range")
        size = HEADER_SIZE + n_slots * (SLOT_HEADER.size + slot_size)
        shm = shared_memory.SharedMemory(create=True, size=size)
        _CREATED.add(shm.name)
        shm.buf[: HEADER_SIZE + n_slots * SLOT_HEADER.size] = b"\0" * (HEADER_SIZE + n_slots * SLOT_HEADER.size)
        struct.pack_into("<IIII", shm.buf, 0, MAGIC, VERSION, n_slots, slot_size)
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str, *, untrack: bool | None = None) -> Ring:
        """Attach to the segment ``name`` (not owned: never unlinked by this side, except by an
        orphaned proxy). :class:`Dsv41Error` when missing, unnamable, foreign or inconsistent."""
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            raise Dsv41Error(f"drafter ring: shared memory {name!r} does not exist") from None
        except (OSError, ValueError) as exc:  # "", "/", a name with a slash, no permission
            raise Dsv41Error(f"drafter ring: cannot attach shared memory {name!r}: {exc}") from None
        # The engine owns the segment: on Python < 3.13 attaching registers it with this
        # process's resource tracker, which would unlink it when the proxy exits.
        try:
            from multiprocessing import resource_tracker

            if untrack is None:  # the creating process attaching to its own segment keeps it tracked
                untrack = shm.name not in _CREATED
            if untrack:
                resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - no public API before 3.13
        except Exception:  # pragma: no cover - tracker absent or already unregistered
            pass
        if shm.size < HEADER_SIZE:
            shm.close()
            raise Dsv41Error(f"drafter ring: shared memory {name!r} is too small")
        try:
            return cls(shm, owner=False)
        except Dsv41Error:
            shm.close()
            raise

    @property
    def name(self) -> str:
        """The segment's name as ``SharedMemory`` reports it (no leading slash)."""
        return self.shm.name

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self.buf is None:
            return
        self.buf = None
        try:
            self.shm.close()
        except BufferError:  # a memoryview still exported; the OS frees it at exit
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:  # an orphaned proxy removed it already: just forget it
                try:
                    from multiprocessing import resource_tracker

                    resource_tracker.unregister(self.shm._name, "shared_memory")  # noqa: SLF001
                except Exception:  # pragma: no cover
                    pass

    # ------------------------------------------------------------------ host flags

    def _u32(self, off: int) -> int:
        return struct.unpack_from("<I", self.buf, off)[0]

    def _set_u32(self, off: int, v: int) -> None:
        struct.pack_into("<I", self.buf, off, v)

    def _u64(self, off: int) -> int:
        return struct.unpack_from("<Q", self.buf, off)[0]

    def _set_u64(self, off: int, v: int) -> None:
        struct.pack_into("<Q", self.buf, off, v)

    proxy_pid = property(lambda s: s._u32(16), lambda s, v: s._set_u32(16, v))
    proxy_memlock = property(lambda s: s._u32(44), lambda s, v: s._set_u32(44, int(v)))
    proxy_state = property(lambda s: _enum(ProxyState, s._u32(20), "proxy state"), lambda s, v: s._set_u32(20, int(v)))
    proxy_heartbeat = property(lambda s: s._u64(24), lambda s, v: s._set_u64(24, v))
    engine_heartbeat = property(lambda s: s._u64(32), lambda s, v: s._set_u64(32, v))
    stop = property(lambda s: bool(s._u32(40)), lambda s, v: s._set_u32(40, int(bool(v))))

    def beat_proxy(self) -> None:
        """Store CLOCK_MONOTONIC ns as the proxy heartbeat."""
        self.proxy_heartbeat = time.monotonic_ns()

    def beat_engine(self) -> None:
        """Store CLOCK_MONOTONIC ns as the engine heartbeat."""
        self.engine_heartbeat = time.monotonic_ns()

    def counters(self) -> dict:
        """The proxy's counters ({name: int}, :data:`PROXY_COUNTERS`)."""
        vals = struct.unpack_from(f"<{len(PROXY_COUNTERS)}Q", self.buf, 48)
        return dict(zip(PROXY_COUNTERS, vals, strict=False))

    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to proxy counter ``name`` (proxy side only: single writer)."""
        off = 48 + 8 * PROXY_COUNTERS.index(name)
        self._set_u64(off, self._u64(off) + n)

    @property
    def error(self) -> str:
        """The proxy's last error message (utf-8, at most 398 bytes; set to "" when healthy)."""
        (n,) = struct.unpack_from("<H", self.buf, _ERR_OFF)
        return bytes(self.buf[_ERR_OFF + 2 : _ERR_OFF + 2 + min(n, _ERR_MAX)]).decode("utf-8", "replace")

    @error.setter
    def error(self, msg: str) -> None:
        b = msg.encode("utf-8")[:_ERR_MAX]
        self.buf[_ERR_OFF + 2 : _ERR_OFF + 2 + len(b)] = b
        struct.pack_into("<H", self.buf, _ERR_OFF, len(b))

    # ------------------------------------------------------------------ slots

    def _slot_off(self, i: int) -> int:
        if not 0 <= i < self.n_slots:
            raise IndexError(f"slot {i} outside 0..{self.n_slots - 1}")
        return HEADER_SIZE + i * self.stride

    def slot_header(self, i: int) -> tuple[SlotState, int, int, int, int, int]:
        """(state, status, seq, length, crc, submit_ns) of slot ``i``."""
        st, status, seq, length, crc, t = SLOT_HEADER.unpack_from(self.buf, self._slot_off(i))
        return _enum(SlotState, st, f"slot {i} state"), status, seq, length, crc, t

    def slot_state(self, i: int) -> SlotState:
        """State word of slot ``i``; :class:`RingCorrupt` when it is not a :class:`SlotState`."""
        return _enum(SlotState, self._u32(self._slot_off(i)), f"slot {i} state")

    def set_state(self, i: int, state: SlotState) -> None:
        """Store slot ``i``'s state word alone (hand-over without new data)."""
        self._set_u32(self._slot_off(i), int(state))

    def write(self, i: int, state: SlotState, seq: int, data: bytes, status: int = 0) -> None:
        """Fill slot ``i`` with ``data`` and publish it as ``state`` (state word written last).

        Raises :class:`Dsv41Error` when ``data`` does not fit the slot.
        """
        if len(data) > self.slot_size:
            raise Dsv41Error(f"drafter ring: {len(data)} B do not fit a {self.slot_size} B slot")
        off = self._slot_off(i)
        d0 = off + SLOT_HEADER.size
        self.buf[d0 : d0 + len(data)] = data
        struct.pack_into(
            "<IQIIQ", self.buf, off + 4, status, seq, len(data), zlib.crc32(data) & 0xFFFFFFFF, time.monotonic_ns()
        )
        self._set_u32(off, int(state))

    def read(self, i: int) -> tuple[int, int, bytes] | None:
        """(seq, status, data) of slot ``i``, or None while its CRC does not match yet."""
        _, status, seq, length, crc, _ = SLOT_HEADER.unpack_from(self.buf, self._slot_off(i))
        if length > self.slot_size:
            return None
        d0 = self._slot_off(i) + SLOT_HEADER.size
        data = bytes(self.buf[d0 : d0 + length])
        if zlib.crc32(data) & 0xFFFFFFFF != crc:
            return None
        return seq, status, data

    def find(self, state: SlotState) -> list[int]:
        """Slots in ``state``, oldest sequence first (a slot with a corrupt state word never matches)."""
        hits = []
        for i in range(self.n_slots):
            st, _, seq, *_ = SLOT_HEADER.unpack_from(self.buf, self._slot_off(i))
            if st == int(state):
                hits.append((seq, i))
        return [i for _, i in sorted(hits)]
