"""Hashing: every shared test vector, chunked == one-shot, token map checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41.engram.hashing import (
    REAL_TOKEN_MAP_SHA256,
    DecodeState,
    NgramHasher,
    check_token_map,
    load_token_map,
    token_map_sha256,
)
from dsv41.engram.layout import EngramLayout
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

VEC = Path(__file__).resolve().parents[1] / "data" / "engram_hash_vectors.json"
REAL_CFG = {
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
}

pytestmark = pytest.mark.skipif(not VEC.exists(), reason="shared test vectors absent")


@pytest.fixture(scope="module")
def vectors() -> dict:
    return json.loads(VEC.read_text())


@pytest.fixture(scope="module")
def hasher(vectors: dict) -> NgramHasher:
    return NgramHasher(EngramLayout.from_config(REAL_CFG), np.asarray(vectors["token_map"]))


def test_every_vector(vectors: dict, hasher: NgramHasher) -> None:
    assert len(vectors["cases"]) >= 4
    names = set()
    for case in vectors["cases"]:
        mask = None if case["mask"] is None else np.asarray(case["mask"], dtype=bool)
        rows, _ = hasher.hash(np.asarray(case["tokens"]), mask)
        assert rows.shape == (len(case["tokens"]), 2, 24) and rows.dtype == np.int64
        np.testing.assert_array_equal(rows, np.asarray(case["rows"]), err_msg=case["name"])
        names.add(case["name"])
    assert "f2_dead_mask" in names


def test_vectors_token_by_token(vectors: dict, hasher: NgramHasher) -> None:
    for case in vectors["cases"]:
        mask = case["mask"] or [1] * len(case["tokens"])
        st_ = None
        for t, (tok, m) in enumerate(zip(case["tokens"], mask, strict=False)):
            r, st_ = hasher.hash(np.asarray([tok]), np.asarray([bool(m)]), st_)
            np.testing.assert_array_equal(r[0], np.asarray(case["rows"][t]))


def test_same_compressed_same_rows(vectors: dict, hasher: NgramHasher) -> None:
    c = {x["name"]: x for x in vectors["cases"]}
    assert c["f3a"]["tokens"] != c["f3b_same_compressed"]["tokens"]
    a, _ = hasher.hash(np.asarray(c["f3a"]["tokens"]))
    b, _ = hasher.hash(np.asarray(c["f3b_same_compressed"]["tokens"]))
    np.testing.assert_array_equal(a, b)


def test_rows_in_column_bucket(hasher: NgramHasher) -> None:
    rng = np.random.default_rng(0)
    rows, _ = hasher.hash(rng.integers(0, 10, 500))
    lay = hasher.layout
    for li in range(2):
        off = np.asarray(lay.offsets[li])
        pr = np.asarray(lay.primes[li])
        assert ((rows[:, li] >= off) & (rows[:, li] < off + pr)).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.lists(st.tuples(st.integers(0, 9), st.booleans()), min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    use_mask=st.booleans(),
)
def test_chunked_equals_one_shot(hasher: NgramHasher, data, cuts, use_mask) -> None:
    tokens = np.asarray([t for t, _ in data], dtype=np.int64)
    mask = np.asarray([m for _, m in data], dtype=bool) if use_mask else None
    full, full_state = hasher.hash(tokens, mask)
    bounds = sorted({0, len(tokens), *[c for c in cuts if c <= len(tokens)]})
    state = None
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        r, state = hasher.hash(tokens[a:b], None if mask is None else mask[a:b], state)
        parts.append(r)
    got = np.concatenate(parts) if parts else np.zeros((0, 2, 24), np.int64)
    np.testing.assert_array_equal(got, full)
    if state is not None:
        np.testing.assert_array_equal(state.history, full_state.history)


def test_state_is_last_three(hasher: NgramHasher) -> None:
    _, s = hasher.hash(np.asarray([1, 5, 6, 8]), np.asarray([1, 1, 0, 1], bool))
    assert s.history.tolist() == [5, -1, 99091]
    assert hasher.initial_state().history.tolist() == [-1, -1, -1]
    assert s.copy().history is not s.history


def test_bad_inputs(hasher: NgramHasher) -> None:
    with pytest.raises(Dsv41Error, match="outside the token map"):
        hasher.hash(np.asarray([10]))
    with pytest.raises(Dsv41Error, match="outside the token map"):
        hasher.hash(np.asarray([-1]))
    with pytest.raises(Dsv41Error, match="mask has shape"):
        hasher.hash(np.asarray([1, 2]), np.asarray([True]))
    with pytest.raises(Dsv41Error, match="1-D"):
        hasher.hash(np.asarray([[1]]))
    with pytest.raises(Dsv41Error, match="decode state"):
        hasher.hash(np.asarray([1]), state=DecodeState(np.zeros(2, np.int64)))
    with pytest.raises(ConfigError, match="pad"):
        NgramHasher(hasher.layout, np.asarray([0, 1]))
    with pytest.raises(ConfigError, match="1-D"):
        NgramHasher(hasher.layout, np.asarray([]))


def test_token_map_sha_and_loading(tmp_path: Path) -> None:
    tm = np.arange(129280, dtype=np.int32) % 99092
    digest = token_map_sha256(tm)
    assert digest == token_map_sha256(tm.astype(np.int64))  # canonical int32 LE encoding
    assert check_token_map(tm, digest) == digest
    with pytest.raises(VerificationError, match=REAL_TOKEN_MAP_SHA256):
        check_token_map(tm)
    (tmp_path / "a.json").write_text(json.dumps([0, 1, 2]))
    (tmp_path / "b.json").write_text(json.dumps({"token_map": [0, 1, 2]}))
    np.save(tmp_path / "c.npy", np.asarray([0, 1, 2]))
    (tmp_path / "d.bin").write_bytes(np.asarray([0, 1, 2], "<i4").tobytes())
    for n in ("a.json", "b.json", "c.npy", "d.bin"):
        assert load_token_map(tmp_path / n).tolist() == [0, 1, 2]
    (tmp_path / "e.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "f.json").write_text("[1, 2.5]")
    (tmp_path / "g.bin").write_bytes(b"abc")
    (tmp_path / "h.json").write_text("[-1]")
    for n, msg in [
        ("e.json", "token_map"),
        ("f.json", "list of ints"),
        ("g.bin", "multiple of 4"),
        ("h.json", r"\[0, 2\^31\)"),
        ("zz.json", "does not exist"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load_token_map(tmp_path / n)
