"""Hypothesis fuzzer: malformed frames thrown at a live server never crash it, never produce
wrong rows, and never disturb a well-behaved client (both implementations)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dsv41.transport import native, parse_url, protocol as P
from dsv41.transport.server import RowServer
from dsv41.transport.tcp import TcpClient
from framefuzz import CHECKED, ROWS, TABLE, build_frames, read_replies


@pytest.fixture(scope="module", params=[True, False], ids=["cpp", "python"])
def server(request):
    if request.param and native._fastrow is None:
        pytest.fail("C++ extension not built")
    srv = RowServer([TABLE], [parse_url("tcp://127.0.0.1:0")], native=request.param)
    ep = srv.start()[0]
    yield srv, ep
    srv.stop(2)


# A frame starts valid (a lookup of in-range or out-of-range rows) and gets at most one field
# broken, so well-formed lookups keep coming between the malformed ones.
frame_fields = st.fixed_dictionaries(
    {
        "break": st.sampled_from(
            [None, None, None, "magic", "version", "op", "ident", "count", "plen", "trunc", "junk"]
        ),
        "magic": st.integers(0, 2**32 - 1),
        "version": st.integers(0, 2**16 - 1),
        "op": st.integers(0, 2**16 - 1),
        "ident": st.binary(min_size=32, max_size=32),
        "rows": st.lists(st.one_of(st.integers(0, ROWS - 1), st.integers(0, 2**64 - 1)), max_size=40),
        "count_delta": st.integers(-3, 3),
        "plen_delta": st.one_of(st.integers(-16, 16), st.just(2**31)),
        "trunc": st.integers(0, 400),
        "junk": st.binary(min_size=1, max_size=64),
    }
)


def _frame(brk=None, rows=(0, 5, ROWS - 1)):
    return {
        "break": brk,
        "magic": 1,
        "version": 9,
        "op": 77,
        "ident": bytes(32),
        "rows": list(rows),
        "count_delta": 2,
        "plen_delta": 8,
        "trunc": 30,
        "junk": b"\x00junk",
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(frame_fields, min_size=1, max_size=4))
# fixed examples: good lookups around a broken frame, so row replies are always compared too
@example(frames=[_frame(), _frame("op"), _frame(rows=(7, 7, 3)), _frame("junk")])
@example(frames=[_frame("count"), _frame(rows=range(40))])
@example(frames=[_frame(rows=(1, 2**64 - 1)), _frame(), _frame("magic"), _frame()])
def test_malformed_frames(server, frames):
    srv, ep = server
    s = socket.create_connection((ep.host, ep.port), timeout=2)
    data, sent_rows = build_frames(frames, TABLE.identity)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # server closed on a fatal frame before reading everything
    read_replies(s, sent_rows)
    s.close()
    # the server still answers a good client with exact rows
    c = TcpClient(ep)
    out = np.empty((3, 264), np.uint8)
    c.lookup_into(TABLE.identity, np.array([0, ROWS - 1, 7], np.uint64), [out], 2.0)
    r = np.array([0, ROWS - 1, 7])
    np.testing.assert_array_equal(out, np.concatenate([TABLE.weight[r], TABLE.scale[r]], axis=1))
    c.close()
    assert srv.snapshot()["client_errors"] == 0


MULTI_CHECKED: list[int] = []

multi_fields = st.fixed_dictionaries(
    {
        "segs": st.lists(
            st.tuples(
                st.booleans(), st.lists(st.one_of(st.integers(0, ROWS - 1), st.integers(0, 2**64 - 1)), max_size=12)
            ),
            min_size=0,
            max_size=18,
        ),
        "count_delta": st.sampled_from([0, 0, 0, -1, 1]),
        "seg_delta": st.sampled_from([0, 0, 0, -1, 1]),
        "reserved": st.sampled_from([0, 0, 0, 1, 2**32 - 1]),
        "plen_delta": st.sampled_from([0, 0, 0, -8, 8, -1]),
        "version": st.sampled_from([2, 2, 2, 1]),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(multi_fields, min_size=1, max_size=4))
@example(
    frames=[
        {
            "segs": [(True, [0, 5]), (True, [ROWS - 1])],
            "count_delta": 0,
            "seg_delta": 0,
            "reserved": 0,
            "plen_delta": 0,
            "version": 2,
        }
    ]
)
def test_malformed_multi_frames(server, frames):
    """Version-2 OP_LOOKUP_MULTI frames with broken segment tables, counts, reserved fields,
    lengths or a version-1 header: refusals or exact rows, never a crash."""
    srv, ep = server
    s = socket.create_connection((ep.host, ep.port), timeout=2)
    data = b""
    valid: dict[int, np.ndarray] = {}
    for i, f in enumerate(frames):
        heads, ids = b"", []
        for k, (known, rows) in enumerate(f["segs"]):
            n = len(rows) + (f["seg_delta"] if k == 0 else 0)
            heads += P.SEG.pack(TABLE.identity if known else bytes(32), max(0, n), f["reserved"] if k == 0 else 0)
            ids += rows
        payload = heads + np.array(ids, np.uint64).tobytes()
        nseg = max(0, len(f["segs"]) + f["count_delta"])
        plen = max(0, len(payload) + f["plen_delta"])
        data += P.REQ.pack(P.MAGIC, f["version"], P.OP_LOOKUP_MULTI, i, bytes(32), nseg, plen) + payload[:plen]
        if plen > len(payload):
            data += b"\0" * (plen - len(payload))
        ok = (
            f["version"] == 2
            and 1 <= len(f["segs"]) <= P.MAX_SEGMENTS
            and f["count_delta"] == 0
            and f["seg_delta"] == 0
            and f["reserved"] == 0
            and f["plen_delta"] == 0
            and all(known for known, _ in f["segs"])
            and all(r < ROWS for r in ids)
        )
        if ok:
            valid[i] = np.array(ids, np.int64)
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    buf = b""
    s.settimeout(2.0)
    try:
        while chunk := s.recv(1 << 20):
            buf += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    s.close()
    pos = 0
    while pos + P.REP.size <= len(buf):
        magic, ver, status, rid, count, plen = P.REP.unpack_from(buf, pos)
        assert magic == P.MAGIC and ver in P.VERSIONS and status in P.STATUS_NAMES
        body = buf[pos + P.REP.size : pos + P.REP.size + plen]
        pos += P.REP.size + plen
        if rid in valid:
            assert status == P.ST_OK and count == len(valid[rid])
            r = valid[rid]
            assert body == np.concatenate([TABLE.weight[r], TABLE.scale[r]], axis=1).tobytes()[: len(body)]
            MULTI_CHECKED.append(len(body))
        else:
            assert status != P.ST_OK or plen == count * P.ROW_BYTES  # an OK reply carries its rows
    c = TcpClient(ep)
    out = np.empty((2, 264), np.uint8)
    c.lookup_into(TABLE.identity, np.array([0, ROWS - 1], np.uint64), [out], 2.0)
    np.testing.assert_array_equal(out, np.concatenate([TABLE.weight[[0, ROWS - 1]], TABLE.scale[[0, ROWS - 1]]], 1))
    c.close()
    assert srv.snapshot()["client_errors"] == 0


def test_fuzzer_reached_row_replies():
    """The fuzzer above must have compared real row replies, not only refusals."""
    assert len(CHECKED) >= 4 and max(CHECKED) > 0, CHECKED
    assert len(MULTI_CHECKED) >= 2 and max(MULTI_CHECKED) > 0, MULTI_CHECKED
