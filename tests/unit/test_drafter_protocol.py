"""Drafter wire protocol: round trips, header checks, fuzzed payloads and frames."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41.drafter import protocol as P


def _round(n=2, h=8, ntok=5):
    rng = np.random.default_rng(0)
    items = [
        P.RoundItem(
            f"req-{i}",
            rng.integers(0, 260, ntok),
            rng.standard_normal(h).astype(np.float32),
            3 + i,
            0.5 * i,
            17 + i,
            ntok + 10 * i,
        )
        for i in range(n)
    ]
    return P.Round(items, h, 50)


def test_round_roundtrip():
    r = _round()
    back = P.Round.decode(r.encode())
    assert back.hidden_size == 8 and back.deadline_ms == 50
    for a, b in zip(r.items, back.items, strict=False):
        assert a.request_id == b.request_id and a.depth == b.depth and a.seed == b.seed
        assert a.context_len == b.context_len
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.hidden, b.hidden)
        assert b.temperature == pytest.approx(a.temperature)


def test_drafts_roundtrip_and_hello():
    rng = np.random.default_rng(1)
    d = P.Drafts(
        [np.array([1, 2, 3]), np.zeros(0, np.int64)],
        [rng.integers(0, 99, (3, 32)), np.zeros((0, 32), np.int64)],
        [rng.random((3, 32)).astype(np.float32), np.zeros((0, 32), np.float32)],
    )
    back = P.Drafts.decode(d.encode())
    np.testing.assert_array_equal(back.tokens[0], [1, 2, 3])
    np.testing.assert_array_equal(back.top_ids[0], d.top_ids[0])
    assert back.tokens[1].size == 0 and back.top_probs[1].shape == (0, 32)
    h = P.Hello("a" * 64, "b" * 64, "c" * 64, 64, 7, 128, 260, 32, 4, "torch")
    assert P.Hello.decode(h.encode()) == h
    assert P.HelloRequest.decode(P.HelloRequest("d" * 64, "x").encode()) == P.HelloRequest("d" * 64, "x")


def test_frame_header_checks():
    f = P.pack_frame(P.Msg.ROUND, b"abc", round_id=9)
    head, payload = P.decode_frame(f)
    assert head.msg == P.Msg.ROUND and head.round_id == 9 and payload == b"abc"
    cases = {
        P.Status.BAD_MAGIC: b"XXXX" + f[4:],
        P.Status.BAD_VERSION: f[:4] + struct.pack("<H", 99) + f[6:],
        P.Status.BAD_TYPE: f[:6] + struct.pack("<H", 77) + f[8:],
        P.Status.BAD_CRC: f[:-1] + b"x",
        P.Status.BAD_LENGTH: f[:20] + struct.pack("<I", P.MAX_PAYLOAD + 1) + f[24:],
    }
    for status, bad in cases.items():
        with pytest.raises(P.ProtocolError) as ei:
            P.decode_frame(bad)
        assert ei.value.status == status and ei.value.fatal


@pytest.mark.parametrize(
    "mutate, status",
    [
        (lambda b: b[:-3], P.Status.MALFORMED),  # truncated hidden
        (lambda b: b + b"\0", P.Status.MALFORMED),  # trailing byte
        (lambda b: struct.pack("<I", 5000) + b[4:], P.Status.LIMIT),  # too many items
        (lambda b: b[:4] + struct.pack("<I", 0) + b[8:], P.Status.MALFORMED),  # hidden size 0
    ],
)
def test_round_payload_refusals(mutate, status):
    with pytest.raises(P.ProtocolError) as ei:
        P.Round.decode(mutate(_round().encode()))
    assert ei.value.status == status


def test_round_refuses_nonfinite_hidden_and_wrong_width():
    r = _round(1)
    r.items[0].hidden[0] = np.nan
    with pytest.raises(P.ProtocolError, match="non-finite"):
        P.Round.decode(r.encode())
    with pytest.raises(P.ProtocolError, match="hidden size"):
        P.Round.decode(_round(1).encode(), hidden_size=16)


def test_parse_url():
    assert P.parse_url("tcp://127.0.0.1:18800") == ("127.0.0.1", 18800)
    for bad in ("http://x:1", "tcp://x", "tcp://:5", "tcp://x:99999"):
        with pytest.raises(P.Dsv41Error):
            P.parse_url(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_fuzz_payload_decoders_only_raise_protocol_error(data):
    for dec in (P.Round.decode, P.Drafts.decode, P.Hello.decode, P.HelloRequest.decode):
        try:
            dec(data)
        except P.ProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_fuzz_single_byte_mutations_of_a_valid_round(pos, val):
    good = _round().encode()
    bad = bytearray(good)
    bad[pos % len(bad)] = val
    try:
        r = P.Round.decode(bytes(bad))
    except P.ProtocolError:
        return
    assert len(r.items) == 2  # a mutation inside token/hidden values can still be a valid round


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=P.HEADER_SIZE, max_size=P.HEADER_SIZE + 64))
def test_fuzz_frames(data):
    try:
        head, payload = P.decode_frame(data)
    except P.ProtocolError:
        return
    assert zlib.crc32(payload) & 0xFFFFFFFF == head.crc
