"""Wire format of the dsv41 row transport (versions 1 and 2), shared by the TCP data path and the
NIXL control channel.

All integers are little-endian.  One request, one reply, strictly in order per connection.

Request header (56 bytes, ``REQ``)::

    u32 magic 'DSVE' (0x45565344) | u16 version (1) | u16 op | u64 request id (generation)
    32 B table identity (raw sha256) | u32 count | u32 payload_len

followed by ``payload_len`` bytes.  For ``OP_LOOKUP`` the payload is ``count`` u64 global row ids
(``payload_len == 8*count``).  Reply header (24 bytes, ``REP``)::

    u32 magic | u16 version | u16 status | u64 request id (echoed) | u32 count | u32 payload_len

followed by ``payload_len`` bytes; for a successful lookup ``count`` rows of ``ROW_BYTES`` (264 =
256 B FP8 E4M3 weights + 8 B UE8M0 scales, docs engram-spec section 4) in request order.

A frame the server cannot resynchronise after (bad magic, bad version, oversize payload) gets a
status reply and the connection is closed; every other refusal keeps the connection open.

Version 2 adds ``OP_LOOKUP_MULTI`` (rows of several tables, e.g. both Engram layers of a decode
step, in one round trip) and nothing else: a version-2 server answers version-1 frames exactly as
before (replies echo the request's version), and ``OP_LOOKUP_MULTI`` in a version-1 frame is
``unknown_op``, as a version-1 server answers it.  A ``bad_version`` reply carries the newest
version the server speaks in its header (a version-1 server: 1), so a version-2 client that meets
a version-1 server learns it from the refusal of its version-2 ``HELLO`` (which closes that
connection), reconnects and keeps to version-1 frames (one ``OP_LOOKUP`` per table).
``OP_LOOKUP_MULTI`` request: header ``identity`` all zero, ``count`` = number of segments (1..16),
payload = ``count`` segment headers (``SEG``: 32 B identity | u32 rows | u32 reserved 0) then
every segment's u64 row ids in segment order; the reply is one ``ST_OK`` header with ``count`` =
total rows, then the rows in segment order.  Any bad segment refuses the whole request.
"""

from __future__ import annotations

import struct

MAGIC = 0x45565344  # b"DSVE" little-endian
VERSION = 1  # frames of the single-table ops (every peer speaks them)
MAX_VERSION = 2  # newest version this code speaks
VERSIONS = (1, 2)
ROW_BYTES = 264
WEIGHT_BYTES = 256
SCALE_BYTES = 8
IDENTITY_BYTES = 32

REQ = struct.Struct("<IHHQ32sII")
REP = struct.Struct("<IHHQII")
assert REQ.size == 56 and REP.size == 24

# ops
OP_LOOKUP = 1
OP_HELLO = 2  # reply: the table list (TABLE_ENTRY records)
OP_NIXL_HELLO = 3  # payload: expected identities; reply: JSON with NIXL metadata + descriptors
OP_PING = 4
OP_LOOKUP_MULTI = 5  # version 2: rows of up to MAX_SEGMENTS tables in one request

# statuses
ST_OK = 0
ST_BAD_MAGIC = 1
ST_BAD_VERSION = 2
ST_UNKNOWN_OP = 3
ST_WRONG_IDENTITY = 4
ST_OUT_OF_RANGE = 5
ST_OVERSIZE = 6
ST_BAD_FRAME = 7
ST_SHUTTING_DOWN = 8
ST_NOT_SUPPORTED = 9
ST_INTERNAL = 10

STATUS_NAMES = {
    ST_OK: "ok",
    ST_BAD_MAGIC: "bad_magic",
    ST_BAD_VERSION: "bad_version",
    ST_UNKNOWN_OP: "unknown_op",
    ST_WRONG_IDENTITY: "wrong_identity",
    ST_OUT_OF_RANGE: "out_of_range",
    ST_OVERSIZE: "oversize",
    ST_BAD_FRAME: "bad_frame",
    ST_SHUTTING_DOWN: "shutting_down",
    ST_NOT_SUPPORTED: "not_supported",
    ST_INTERNAL: "internal",
}

# Largest lookup one frame may carry: 1 Mi rows (277 MB of reply) - above a 32K-token prefill
# on one TP2 rank (786,432 rows).  Clients split larger lookups.
MAX_ROWS = 1 << 20
MAX_PAYLOAD = MAX_ROWS * 8

# OP_LOOKUP_MULTI segment header: identity, rows, reserved (0)
SEG = struct.Struct("<32sII")
MAX_SEGMENTS = 16
assert SEG.size == 40

# HELLO reply record: identity, layer_id, rows, row_bytes
TABLE_ENTRY = struct.Struct("<32sIQI")


def status_name(status: int) -> str:
    """Name of a reply status (``"status_<n>"`` for an unknown code)."""
    return STATUS_NAMES.get(status, f"status_{status}")


def identity_bytes(identity: str | bytes) -> bytes:
    """A table identity as the 32 raw bytes on the wire.

    ``identity``: 64 hex characters (manifest form) or 32 raw bytes.  Raises ``ValueError``
    otherwise.
    """
    if isinstance(identity, bytes | bytearray):
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"table identity must be 32 bytes, got {len(identity)}")
        return bytes(identity)
    try:
        raw = bytes.fromhex(identity)
    except ValueError:
        raise ValueError(f"table identity is not hex: {identity!r}") from None
    if len(raw) != IDENTITY_BYTES:
        raise ValueError(f"table identity must be 64 hex characters, got {len(identity)}")
    return raw
