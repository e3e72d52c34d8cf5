"""Row-transport frame fuzzing shared by the CI fuzzer (tests/unit/test_transport_fuzz.py) and the
long campaign (tests/fuzz, ``make fuzz``): the fuzzed table, frame fields drawn with
``random.Random``, their wire bytes, and the reply reader that checks every OK lookup's rows."""

from __future__ import annotations

import hashlib
import socket

import numpy as np

from dsv41.transport import protocol as P
from dsv41.transport.server import RowTable

ROWS = 300


def _table():
    """ROWS random rows (seed 11) of a table whose identity is sha256(b"fuzz")."""
    rng = np.random.default_rng(11)
    return RowTable(
        hashlib.sha256(b"fuzz").digest(),
        1,
        rng.integers(0, 256, (ROWS, 256), dtype=np.uint8),
        rng.integers(0, 256, (ROWS, 8), dtype=np.uint8),
    )


TABLE = _table()
CHECKED: list[int] = []  # OK lookup replies whose rows were compared (test_transport_fuzz checks some were)


def read_replies(s: socket.socket, sent_rows: list[np.ndarray | None], table: RowTable | None = None) -> int:
    """Read every reply there is; any OK lookup reply must hold exactly the right rows (of
    ``table``, default ``TABLE``). Returns the number of row replies compared."""
    table = TABLE if table is None else table
    compared = 0
    buf = b""
    s.settimeout(2.0)  # the server closes after EOF, which ends the loop early
    try:
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    pos = 0
    while pos + P.REP.size <= len(buf):
        magic, ver, status, rid, count, plen = P.REP.unpack_from(buf, pos)
        assert magic == P.MAGIC and ver in P.VERSIONS  # replies echo the request's version
        assert status in P.STATUS_NAMES
        pos += P.REP.size
        body = buf[pos : pos + plen]
        pos += plen
        if status == P.ST_OK and plen and rid < len(sent_rows) and sent_rows[rid] is not None:
            r = sent_rows[rid].astype(np.int64)
            want = np.concatenate([table.weight[r], table.scale[r]], axis=1).tobytes()
            assert body == want[: len(body)], f"wrong rows in the reply to request {rid}"
            CHECKED.append(len(body))
            compared += 1
    return compared


BREAKS = [None, None, None, "magic", "version", "op", "ident", "count", "plen", "trunc", "junk"]


def random_frame(rng, ops=(None,)) -> dict:
    """One frame's fields drawn with ``random.Random`` ``rng``: the same shape and ranges as
    ``frame_fields`` (the long campaign, ``make fuzz``, draws this way: hypothesis is too slow for
    10^5 frames). ``ops``: op codes a broken ``op`` field is drawn from (``None``: any 16-bit)."""
    op = rng.choice(ops)
    return {
        "break": rng.choice(BREAKS),
        "magic": rng.getrandbits(32),
        "version": rng.getrandbits(16),
        "op": rng.getrandbits(16) if op is None else op,
        "ident": rng.randbytes(32),
        "rows": [rng.randrange(ROWS) if rng.random() < 0.7 else rng.getrandbits(64) for _ in range(rng.randrange(41))],
        "count_delta": rng.randint(-3, 3),
        "plen_delta": rng.randint(-16, 16) if rng.random() < 0.9 else 2**31,
        "trunc": rng.randrange(401),
        "junk": rng.randbytes(rng.randint(1, 64)),
    }


def build_frames(frames, identity: bytes) -> tuple[bytes, list]:
    """Wire bytes of ``frames`` (field dicts; request ids 0..n-1) and, per frame, the rows a
    correct server answers (``None`` for a frame it must refuse or may never reach)."""
    sent_rows: list[np.ndarray | None] = []
    data = b""
    for i, f in enumerate(frames):
        b = f["break"]
        rows = np.array(f["rows"], dtype=np.uint64)
        magic = f["magic"] if b == "magic" else P.MAGIC
        version = f["version"] if b == "version" else P.VERSION
        op = f["op"] if b == "op" else P.OP_LOOKUP
        ident = f["ident"] if b == "ident" else identity
        count = max(0, len(rows) + f["count_delta"]) if b == "count" else len(rows)
        payload = rows.tobytes()
        plen = max(0, min(2**32 - 1, len(payload) + f["plen_delta"])) if b == "plen" else len(payload)
        frame = P.REQ.pack(magic, version, op, i, ident, count, plen) + payload
        if b == "trunc":
            frame = frame[: f["trunc"]]
        if b == "junk":
            frame += f["junk"]
        ok = (
            op == P.OP_LOOKUP
            and count == len(rows)
            and plen == len(payload)
            and ident == identity
            and version in P.VERSIONS
        )
        sent_rows.append(rows if ok else None)
        data += frame
    return data, sent_rows
