"""dsv41.tokenizer: the compressed token map, UTF-8 round trips, chat prompts and their errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41.errors import Dsv41Error
from dsv41.tokenizer import (
    BOS,
    COMPRESSED_VOCAB_SIZE,
    EOS,
    PAD,
    SEP,
    TOKEN_MAP,
    TOKEN_MAP_SHA256,
    ByteTokenizer,
    build_token_map,
)
from engineutil import LAB_CONFIG


def test_token_map_compresses_and_keeps_pad():
    assert TOKEN_MAP.dtype == np.int32 and TOKEN_MAP.shape == (260,)
    assert TOKEN_MAP[PAD] == PAD and TOKEN_MAP[BOS] == BOS and TOKEN_MAP[EOS] == EOS and TOKEN_MAP[SEP] == SEP
    assert COMPRESSED_VOCAB_SIZE == 229 == len(set(TOKEN_MAP.tolist()))
    tok = ByteTokenizer()
    a, b = tok.encode("Hello\tWorld"), tok.encode("hello world")
    assert a != b and TOKEN_MAP[a].tolist() == TOKEN_MAP[b].tolist()
    assert TOKEN_MAP[tok.encode("1")[0]] != TOKEN_MAP[tok.encode("2")[0]]
    assert np.array_equal(build_token_map(), TOKEN_MAP)  # deterministic
    assert len(TOKEN_MAP_SHA256) == 64


def test_token_map_matches_config_key():
    cfg = json.loads(LAB_CONFIG.read_text())
    assert cfg["engram_compressed_vocab_size"] == COMPRESSED_VOCAB_SIZE
    assert cfg["engram_pad_token_id"] == PAD


def test_tokenizer_roundtrip_and_incremental_utf8():
    tok = ByteTokenizer()
    text = "Grüße, 世界!"
    ids = tok.encode(text, bos=True)
    assert ids[0] == BOS and tok.decode(ids) == text
    dec = tok.incremental()
    out = "".join(dec.feed([t]) for t in ids) + dec.feed([], final=True)
    assert out == text
    with pytest.raises(Exception, match="outside the vocabulary"):
        tok.decode([260])


def test_chat_prompt_and_errors():
    tok = ByteTokenizer()
    ids = tok.chat_prompt(
        [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "there"}]}]
    )
    assert ids[0] == BOS and ids.count(SEP) == 3 and tok.decode(ids).endswith("assistant: ")
    for bad, frag in (
        ([{"content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
        (["x"], "role"),
        ([{"role": "wizard", "content": "x"}], "not one of"),
        ([{"role": "user", "content": 5}], "content"),
    ):
        with pytest.raises(Dsv41Error, match=frag):
            tok.chat_prompt(bad)
