"""Wire format of the dsv41 row transport (version 1), shared by the TCP data path and the NIXL
control channel.

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
"""

from __future__ import annotations

import struct

MAGIC = 0x45565344  # b"DSVE" little-endian
VERSION = 1
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
