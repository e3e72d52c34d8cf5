"""Drafter wire protocol: versioned, little-endian frames (struct + numpy, torch-free).

Every message is one frame: a fixed 32-byte header followed by ``payload_len`` payload bytes.

Header (``<4sHHHHQII4x``, little-endian):

======  ======  ==============================================================
offset  type    field
======  ======  ==============================================================
0       4s      magic ``b"DSDR"``
4       u16     protocol version (:data:`VERSION`)
6       u16     message type (:class:`Msg`)
8       u16     status (:class:`Status`; 0 = OK)
10      u16     flags (reserved, 0)
12      u64     round id: the client's generation counter; a reply carries the id of the
                request it answers, so a late reply is recognised and dropped
20      u32     payload length in bytes (<= :data:`MAX_PAYLOAD`)
24      u32     CRC-32 (zlib) of the payload
28      4x      padding
======  ======  ==============================================================

Messages (payloads, all little-endian):

* ``HELLO_REQ`` (client -> worker): u16 n + client target identity (64 hex chars, may be empty),
  u16 n + client name.
* ``HELLO`` (worker -> client): 3 x 32 raw bytes (drafter, Markov head, target identity sha256),
  u32 max_batch, u32 max_k, u32 hidden_size, u32 vocab_size, u32 top_n, u32 max_context,
  u16 n + backend name.
* ``ROUND`` (client -> worker): u32 n_items, u32 hidden_size, u32 deadline_ms (0 = none), then per
  item: u16 id_len, u16 depth, u32 n_tokens, f32 temperature, u64 seed, u64 position (full
  context length; the tokens may be only its tail), id bytes (utf-8), int64[n_tokens] tokens,
  float32[hidden_size] hidden.
* ``DRAFTS`` (worker -> client): u32 n_items, u32 top_n, then per item: u32 k, int64[k] tokens,
  int32[k, top_n] top ids, float32[k, top_n] top probs.
* ``ERROR`` (either way): status in the header, payload = utf-8 message.

A frame that fails any check raises :class:`ProtocolError` carrying the :class:`Status` the
receiver replies with; the worker answers malformed frames with an ``ERROR`` frame (and closes
the connection when the header itself is unreadable, since the stream cannot be resynchronised).
"""

from __future__ import annotations

import enum
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from dsv41.engine.spec_decode import TOP_K
from dsv41.errors import Dsv41Error

MAGIC = b"DSDR"
VERSION = 1
HEADER = struct.Struct("<4sHHHHQII4x")
HEADER_SIZE = HEADER.size  # 32
#: Largest payload accepted (bytes). 64 MiB fits a 64-request batch of 16k-wide fp32 hidden
#: states with 4k tokens of context each many times over; anything bigger is refused as LENGTH.
MAX_PAYLOAD = 64 << 20
MAX_ID_LEN = 256
MAX_ITEMS = 1024
MAX_TOKENS_PER_ITEM = 1 << 20
MAX_DEPTH = 64
#: Largest HELLO_REQ / HELLO / hello-time ERROR payload (two 1 KiB strings plus the fixed
#: fields fit with room to spare); a peer that has not said hello cannot make us read more.
MAX_HELLO_PAYLOAD = 8192

_ROUND_HEAD = struct.Struct("<III")
_ITEM_HEAD = struct.Struct("<HHIfQQ")
_DRAFTS_HEAD = struct.Struct("<II")
_HELLO_LIMITS = struct.Struct("<IIIIII")


class Msg(enum.IntEnum):
    """Message types (header u16 at offset 6)."""

    HELLO_REQ = 1
    HELLO = 2
    ROUND = 3
    DRAFTS = 4
    ERROR = 5


class Status(enum.IntEnum):
    """Status codes carried in the header; non-zero only on ``ERROR`` frames."""

    OK = 0
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    BAD_LENGTH = 4
    BAD_CRC = 5
    MALFORMED = 6
    IDENTITY_MISMATCH = 7
    LIMIT = 8
    TIMEOUT = 9
    INTERNAL = 10
    NO_HELLO = 11
    UNAVAILABLE = 12  # proxy -> engine only: the worker could not be reached


class ProtocolError(Dsv41Error):
    """A frame failed validation; ``status`` is what the receiver reports back.

    ``fatal`` is True when the byte stream can no longer be trusted (bad header), so the
    connection must be closed after reporting.
    """

    def __init__(self, status: Status, message: str, *, fatal: bool = False) -> None:
        super().__init__(f"drafter protocol: {status.name}: {message}")
        self.status = status
        self.fatal = fatal


@dataclass(frozen=True)
class Header:
    """A decoded frame header."""

    msg: Msg
    status: Status
    round_id: int
    length: int
    crc: int
    flags: int = 0


def pack_frame(msg: Msg, payload: bytes = b"", *, round_id: int = 0, status: Status = Status.OK) -> bytes:
    """Return header + payload for one frame.

    Raises :class:`ProtocolError` (LIMIT) when the payload exceeds :data:`MAX_PAYLOAD`.
    """
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(Status.LIMIT, f"payload {len(payload)} B > {MAX_PAYLOAD} B")
    head = HEADER.pack(
        MAGIC,
        VERSION,
        int(msg),
        int(status),
        0,
        round_id & 0xFFFFFFFFFFFFFFFF,
        len(payload),
        zlib.crc32(payload) & 0xFFFFFFFF,
    )
    return head + payload


def unpack_header(buf: bytes) -> Header:
    """Decode and validate a 32-byte header (magic, version, type, status, length).

    Raises :class:`ProtocolError` with ``fatal=True`` for anything unreadable.
    """
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(Status.BAD_LENGTH, f"header is {len(buf)} B, expected {HEADER_SIZE}", fatal=True)
    magic, version, msg, status, flags, round_id, length, crc = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(Status.BAD_MAGIC, f"magic {magic!r} != {MAGIC!r}", fatal=True)
    if version != VERSION:
        raise ProtocolError(Status.BAD_VERSION, f"version {version} != {VERSION}", fatal=True)
    try:
        msg_t = Msg(msg)
    except ValueError:
        raise ProtocolError(Status.BAD_TYPE, f"unknown message type {msg}", fatal=True) from None
    try:
        status_t = Status(status)
    except ValueError:
        raise ProtocolError(Status.MALFORMED, f"unknown status {status}", fatal=True) from None
    if length > MAX_PAYLOAD:
        raise ProtocolError(Status.BAD_LENGTH, f"payload length {length} > {MAX_PAYLOAD}", fatal=True)
    return Header(msg_t, status_t, round_id, length, crc, flags)


def check_payload(header: Header, payload: bytes) -> None:
    """Raise :class:`ProtocolError` (BAD_CRC, fatal) when the payload does not match the header."""
    if len(payload) != header.length:
        raise ProtocolError(Status.BAD_LENGTH, f"payload {len(payload)} B != header {header.length} B", fatal=True)
    if zlib.crc32(payload) & 0xFFFFFFFF != header.crc:
        raise ProtocolError(Status.BAD_CRC, "payload CRC-32 mismatch", fatal=True)


def decode_frame(buf: bytes) -> tuple[Header, bytes]:
    """Decode one complete frame held in ``buf`` (header + payload, nothing more)."""
    header = unpack_header(bytes(buf[:HEADER_SIZE]))
    payload = bytes(buf[HEADER_SIZE:])
    check_payload(header, payload)
    return header, payload


# ----------------------------------------------------------------------------------------------
# socket helpers


#: Payload bytes read per ``recv`` call: the receive buffer grows with the bytes that actually
#: arrived, so a header that announces a large payload costs no memory until it is sent.
_RECV_CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly ``n`` bytes, growing the buffer as data arrives (never ``n`` up front).

    ``deadline`` (``time.monotonic()`` seconds): the whole read must finish by then, so a peer
    that trickles bytes (slowloris) cannot hold the reader; None = the socket's own timeout per
    ``recv``. Raises ConnectionError on EOF, ``socket.timeout`` on timeout.
    """
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(buf)} of {n} B received before the deadline")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(buf), _RECV_CHUNK))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def read_frame(
    sock: socket.socket, *, deadline: float | None = None, max_length: int = MAX_PAYLOAD
) -> tuple[Header, bytes]:
    """Read one frame from a blocking socket.

    ``deadline``: monotonic time by which the whole frame must have arrived (None: the socket's
    timeout applies per ``recv``). ``max_length``: largest payload this reader accepts (at most
    :data:`MAX_PAYLOAD`; checked before any payload byte is read).

    Raises ConnectionError on EOF, ``socket.timeout`` on timeout, :class:`ProtocolError` on a
    malformed frame (BAD_LENGTH, fatal, when the payload exceeds ``max_length``).
    """
    header = unpack_header(_recv_exact(sock, HEADER_SIZE, deadline))
    if header.length > max_length:
        raise ProtocolError(
            Status.BAD_LENGTH, f"payload length {header.length} > {max_length} allowed here", fatal=True
        )
    payload = _recv_exact(sock, header.length, deadline) if header.length else b""
    check_payload(header, payload)
    return header, payload


def send_frame(
    sock: socket.socket, msg: Msg, payload: bytes = b"", *, round_id: int = 0, status: Status = Status.OK
) -> None:
    """Send one frame (blocking, ``sendall``)."""
    sock.sendall(pack_frame(msg, payload, round_id=round_id, status=status))


# ----------------------------------------------------------------------------------------------
# HELLO


def _pack_str(s: str, limit: int = 1024) -> bytes:
    b = s.encode("utf-8")
    if len(b) > limit:
        raise ProtocolError(Status.LIMIT, f"string of {len(b)} B > {limit}")
    return struct.pack("<H", len(b)) + b


def _unpack_str(buf: bytes, off: int) -> tuple[str, int]:
    if off + 2 > len(buf):
        raise ProtocolError(Status.MALFORMED, "truncated string length")
    (n,) = struct.unpack_from("<H", buf, off)
    off += 2
    if off + n > len(buf):
        raise ProtocolError(Status.MALFORMED, "truncated string")
    try:
        s = buf[off : off + n].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(Status.MALFORMED, "string is not utf-8") from None
    return s, off + n


@dataclass(frozen=True)
class HelloRequest:
    """What the client says first: the target identity it serves (hex sha256 or "")."""

    target_identity: str
    client: str = "spark"

    def encode(self) -> bytes:
        """HELLO_REQ payload; :class:`ProtocolError` (LIMIT) for a string over 1 KiB."""
        return _pack_str(self.target_identity) + _pack_str(self.client)

    @classmethod
    def decode(cls, buf: bytes) -> HelloRequest:
        """Parse a HELLO_REQ payload; :class:`ProtocolError` (MALFORMED) when truncated,
        trailing, not utf-8, or the identity is neither empty nor 64 lowercase hex digits."""
        ident, off = _unpack_str(buf, 0)
        client, off = _unpack_str(buf, off)
        if off != len(buf):
            raise ProtocolError(Status.MALFORMED, f"{len(buf) - off} trailing bytes in HELLO_REQ")
        if ident and not _is_hex64(ident):
            raise ProtocolError(Status.MALFORMED, "target identity is not 64 hex digits")
        return cls(ident, client)


def _is_hex64(s: str) -> bool:
    return len(s) == 64 and all(c in "0123456789abcdef" for c in s)


@dataclass(frozen=True)
class Hello:
    """The worker's identities (hex sha256) and limits."""

    drafter_identity: str
    markov_identity: str
    target_identity: str
    max_batch: int
    max_k: int
    hidden_size: int
    vocab_size: int
    top_n: int
    max_context: int
    backend: str

    def encode(self) -> bytes:
        """HELLO payload (identities as 3 x 32 raw bytes, then the limits and backend name)."""
        ids = b"".join(bytes.fromhex(x) for x in (self.drafter_identity, self.markov_identity, self.target_identity))
        return (
            ids
            + _HELLO_LIMITS.pack(
                self.max_batch, self.max_k, self.hidden_size, self.vocab_size, self.top_n, self.max_context
            )
            + _pack_str(self.backend)
        )

    @classmethod
    def decode(cls, buf: bytes) -> Hello:
        """Parse a HELLO payload; :class:`ProtocolError` (MALFORMED) when short or trailing."""
        need = 96 + _HELLO_LIMITS.size
        if len(buf) < need:
            raise ProtocolError(Status.MALFORMED, f"HELLO of {len(buf)} B < {need}")
        ids = [buf[i * 32 : (i + 1) * 32].hex() for i in range(3)]
        lim = _HELLO_LIMITS.unpack_from(buf, 96)
        backend, off = _unpack_str(buf, need)
        if off != len(buf):
            raise ProtocolError(Status.MALFORMED, "trailing bytes in HELLO")
        return cls(ids[0], ids[1], ids[2], *lim, backend)


# ----------------------------------------------------------------------------------------------
# ROUND / DRAFTS


@dataclass
class RoundItem:
    """One request of a drafting round.

    ``tokens``: int64[L] context (the last ``max_context`` tokens are enough); ``hidden``:
    float32[H] target hidden state at the tap layer; ``depth``: drafts wanted (0..MAX_DEPTH);
    ``temperature`` 0 = greedy drafts (argmax), > 0 = drafts sampled from the drafter's top-32
    distribution with a counter-based generator keyed by ``seed`` and the context length.
    """

    request_id: str
    tokens: np.ndarray
    hidden: np.ndarray
    depth: int
    temperature: float = 0.0
    seed: int = 0
    position: int = 0  # full context length (0 = len(tokens)); tokens may be a tail

    @property
    def context_len(self) -> int:
        """Full context length in tokens (``position``, or the tokens sent when it is 0)."""
        return self.position or int(np.asarray(self.tokens).size)


@dataclass
class Round:
    """A batch of :class:`RoundItem`; ``deadline_ms`` lets the worker skip work nobody awaits."""

    items: list[RoundItem]
    hidden_size: int
    deadline_ms: int = 0

    def encode(self) -> bytes:
        """ROUND payload; :class:`ProtocolError` for an id over :data:`MAX_ID_LEN` bytes, a
        hidden state not of ``hidden_size`` values, or a depth outside 0..:data:`MAX_DEPTH`."""
        parts = [_ROUND_HEAD.pack(len(self.items), self.hidden_size, self.deadline_ms)]
        for it in self.items:
            rid = it.request_id.encode("utf-8")
            if len(rid) > MAX_ID_LEN:
                raise ProtocolError(Status.LIMIT, f"request id of {len(rid)} B > {MAX_ID_LEN}")
            toks = np.ascontiguousarray(it.tokens, dtype="<i8").reshape(-1)
            hid = np.ascontiguousarray(it.hidden, dtype="<f4").reshape(-1)
            if hid.size != self.hidden_size:
                raise ProtocolError(Status.MALFORMED, f"hidden of {hid.size} values != {self.hidden_size}")
            if not 0 <= it.depth <= MAX_DEPTH:
                raise ProtocolError(Status.LIMIT, f"depth {it.depth} outside 0..{MAX_DEPTH}")
            parts.append(
                _ITEM_HEAD.pack(
                    len(rid), it.depth, toks.size, float(it.temperature), it.seed & 0xFFFFFFFFFFFFFFFF, it.context_len
                )
            )
            parts += [rid, toks.tobytes(), hid.tobytes()]
        return b"".join(parts)

    @classmethod
    def decode(cls, buf: bytes, *, max_items: int = MAX_ITEMS, hidden_size: int | None = None) -> Round:
        """Parse a ROUND payload; every count is bounds-checked before any allocation."""
        if len(buf) < _ROUND_HEAD.size:
            raise ProtocolError(Status.MALFORMED, "truncated ROUND header")
        n, hsize, deadline = _ROUND_HEAD.unpack_from(buf, 0)
        if n > max_items:
            raise ProtocolError(Status.LIMIT, f"{n} items > limit {max_items}")
        if hidden_size is not None and hsize != hidden_size:
            raise ProtocolError(Status.MALFORMED, f"hidden size {hsize} != worker's {hidden_size}")
        if hsize == 0 or hsize > (1 << 16):
            raise ProtocolError(Status.MALFORMED, f"hidden size {hsize} out of range")
        off = _ROUND_HEAD.size
        items = []
        for _ in range(n):
            if off + _ITEM_HEAD.size > len(buf):
                raise ProtocolError(Status.MALFORMED, "truncated item header")
            id_len, depth, ntok, temp, seed, position = _ITEM_HEAD.unpack_from(buf, off)
            off += _ITEM_HEAD.size
            if id_len > MAX_ID_LEN or depth > MAX_DEPTH or ntok > MAX_TOKENS_PER_ITEM:
                raise ProtocolError(Status.LIMIT, f"item limits exceeded (id {id_len}, depth {depth}, tokens {ntok})")
            if position < ntok:
                raise ProtocolError(Status.MALFORMED, f"position {position} < {ntok} tokens sent")
            if not np.isfinite(temp) or temp < 0:
                raise ProtocolError(Status.MALFORMED, f"temperature {temp} invalid")
            end = off + id_len + 8 * ntok + 4 * hsize
            if end > len(buf):
                raise ProtocolError(Status.MALFORMED, "truncated item body")
            try:
                rid = buf[off : off + id_len].decode("utf-8")
            except UnicodeDecodeError:
                raise ProtocolError(Status.MALFORMED, "request id is not utf-8") from None
            off += id_len
            toks = np.frombuffer(buf, dtype="<i8", count=ntok, offset=off).astype(np.int64)
            off += 8 * ntok
            hid = np.frombuffer(buf, dtype="<f4", count=hsize, offset=off).astype(np.float32)
            off += 4 * hsize
            if not np.all(np.isfinite(hid)):
                raise ProtocolError(Status.MALFORMED, f"request {rid!r}: non-finite hidden state")
            items.append(RoundItem(rid, toks, hid, depth, float(temp), seed, position))
        if off != len(buf):
            raise ProtocolError(Status.MALFORMED, f"{len(buf) - off} trailing bytes in ROUND")
        return cls(items, hsize, deadline)


@dataclass
class Drafts:
    """Per-item drafts: ``tokens`` int64[k], ``top_ids`` int64[k, top_n], ``top_probs``
    float32[k, top_n] (the drafter's probabilities, descending)."""

    tokens: list[np.ndarray]
    top_ids: list[np.ndarray]
    top_probs: list[np.ndarray]
    top_n: int = TOP_K
    extra: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        """DRAFTS payload (top ids as int32, probabilities as float32, little-endian)."""
        parts = [_DRAFTS_HEAD.pack(len(self.tokens), self.top_n)]
        for t, i, p in zip(self.tokens, self.top_ids, self.top_probs, strict=True):
            k = int(t.size)
            parts += [
                struct.pack("<I", k),
                np.ascontiguousarray(t, "<i8").tobytes(),
                np.ascontiguousarray(i, "<i4").reshape(k, self.top_n).tobytes(),
                np.ascontiguousarray(p, "<f4").reshape(k, self.top_n).tobytes(),
            ]
        return b"".join(parts)

    @classmethod
    def decode(cls, buf: bytes, *, max_items: int = MAX_ITEMS) -> Drafts:
        """Parse a DRAFTS payload; every count is bounds-checked before use; non-finite or
        negative probabilities are MALFORMED."""
        if len(buf) < _DRAFTS_HEAD.size:
            raise ProtocolError(Status.MALFORMED, "truncated DRAFTS header")
        n, top_n = _DRAFTS_HEAD.unpack_from(buf, 0)
        if n > max_items or top_n == 0 or top_n > 1024:
            raise ProtocolError(Status.LIMIT, f"DRAFTS n={n} top_n={top_n} out of range")
        off = _DRAFTS_HEAD.size
        toks, ids, probs = [], [], []
        for _ in range(n):
            if off + 4 > len(buf):
                raise ProtocolError(Status.MALFORMED, "truncated draft count")
            (k,) = struct.unpack_from("<I", buf, off)
            off += 4
            if k > MAX_DEPTH:
                raise ProtocolError(Status.LIMIT, f"{k} drafts > {MAX_DEPTH}")
            end = off + 8 * k + 8 * k * top_n
            if end > len(buf):
                raise ProtocolError(Status.MALFORMED, "truncated drafts")
            toks.append(np.frombuffer(buf, "<i8", k, off).astype(np.int64))
            off += 8 * k
            ids.append(np.frombuffer(buf, "<i4", k * top_n, off).astype(np.int64).reshape(k, top_n))
            off += 4 * k * top_n
            p = np.frombuffer(buf, "<f4", k * top_n, off).astype(np.float32).reshape(k, top_n)
            off += 4 * k * top_n
            if not np.all(np.isfinite(p)) or np.any(p < 0):
                raise ProtocolError(Status.MALFORMED, "draft probabilities not finite/non-negative")
            probs.append(p)
        if off != len(buf):
            raise ProtocolError(Status.MALFORMED, f"{len(buf) - off} trailing bytes in DRAFTS")
        return cls(toks, ids, probs, top_n)


def parse_url(url: str, *, listen: bool = False) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); port 0 (ephemeral) only when ``listen``.

    Raises :class:`Dsv41Error` otherwise."""
    if not url.startswith("tcp://"):
        raise Dsv41Error(f"drafter URL {url!r}: only tcp://HOST:PORT is supported")
    rest = url[len("tcp://") :].split("@", 1)[0].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if listen else 1) <= int(port) < 65536:
        raise Dsv41Error(f"drafter URL {url!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)
