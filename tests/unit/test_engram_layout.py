"""Layout: primes, offsets, multipliers, rows, per-rank ranges (engram-spec.md sections 2, 3, 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv41.engram.config import load_model_config
from dsv41.engram.layout import RELEASED_MULTIPLIERS, EngramLayout, compute_multipliers, is_prime
from dsv41.errors import ConfigError

REAL = Path(__file__).resolve().parents[1] / "data" / "dsv41_flash_engram_config.json"
REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "python/dsv41/data/lab_model.json"

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


@pytest.fixture(scope="module")
def real() -> EngramLayout:
    src = REAL if REAL.exists() else REAL_CFG
    return EngramLayout.from_config(src)


def test_real_primes_offsets_rows(real: EngramLayout) -> None:
    assert real.layer_ids == [1, 14]
    assert real.primes[0][0] == 16000057 and real.primes[0][-1] == 16000463
    assert real.primes[1][0] == 16000477 and real.primes[1][-1] == 16000889
    allp = real.primes[0] + real.primes[1]
    assert len(set(allp)) == 48 and allp == sorted(allp) and all(is_prime(p) for p in allp)
    # first 48 primes above vocab_size - 1: no prime is skipped between them
    assert not any(is_prime(n) for n in range(16000000, 16000057))
    assert real.rows == [384006168, 384016682]
    for li in range(2):
        assert real.offsets[li][0] == 0
        assert real.offsets[li][5] == sum(real.primes[li][:5])
    assert real.row_bytes == 264 and real.n_columns == 24


def test_real_tp2_row_ranges(real: EngramLayout) -> None:
    assert real.row_range(0, 2, 0) == (0, 192001740)
    assert real.row_range(1, 2, 0) == (0, 192007016)
    assert real.row_range(0, 2, 1) == (192001740, 384006168)
    assert real.columns_for_rank(2, 1) == (12, 24)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 7, 8, 16, 24, 32])
def test_tp_invariants(real: EngramLayout, tp: int) -> None:
    for li in range(2):
        prev_hi = 0
        cols = 0
        for r in range(tp):
            c0, c1 = real.columns_for_rank(tp, r)
            lo, hi = real.row_range(li, tp, r)
            assert lo == prev_hi and lo <= hi
            assert c1 - c0 <= -(-24 // tp)
            cols += c1 - c0
            prev_hi = hi
            if c1 > c0:  # a rank's range starts at a column offset (vLLM column convention)
                assert lo == real.offsets[li][c0]
        assert prev_hi == real.rows[li] and cols == 24
    if tp in (4, 8):
        assert [real.columns_for_rank(tp, r) for r in range(tp)] == [
            (r * 24 // tp, (r + 1) * 24 // tp) for r in range(tp)
        ]


def test_multiplier_rule_reproduces_released() -> None:
    for layer, want in RELEASED_MULTIPLIERS.items():
        assert compute_multipliers(layer, 4, 99092) == list(want)
    assert all(m % 2 == 1 and 0 < m < 2**63 for m in compute_multipliers(2, 4, 260))


def test_real_uses_released_and_other_layer_computed() -> None:
    cfg = dict(REAL_CFG, engram_layer_ids=[1, 14, 20])
    cfg.pop("engram_num_embeddings")
    lay = EngramLayout.from_config(cfg)
    assert lay.multipliers[0] == list(RELEASED_MULTIPLIERS[1])
    assert lay.multipliers[2] == compute_multipliers(20, 4, 99092)
    # 72 distinct primes across three layers
    assert len({p for lp in lay.primes for p in lp}) == 72


def test_lab_config_rows_computed() -> None:
    lay = EngramLayout.from_config(LAB)
    assert lay.layer_ids == [1, 2]
    assert lay.rows == [sum(p) for p in lay.primes]
    assert min(lay.primes[0]) > 7999 and lay.primes[1][0] > lay.primes[0][-1]
    raw = json.loads(LAB.read_text())
    assert lay.compressed_vocab_size == raw.get("engram_compressed_vocab_size", raw["vocab_size"])


def test_compressed_vocab_defaults_to_vocab_size() -> None:
    cfg = {k: v for k, v in REAL_CFG.items() if k not in ("engram_compressed_vocab_size", "engram_num_embeddings")}
    lay = EngramLayout.from_config(dict(cfg, vocab_size=260))
    assert lay.compressed_vocab_size == 260
    assert lay.multipliers[0] == compute_multipliers(1, 4, 260) != list(RELEASED_MULTIPLIERS[1])


def test_num_embeddings_mismatch_names_both() -> None:
    cfg = dict(REAL_CFG, engram_num_embeddings=[384006168, 384016683])
    with pytest.raises(ConfigError, match=r"384016683.*384016682"):
        EngramLayout.from_config(cfg)


def test_nested_text_config_and_pad_alias(tmp_path: Path) -> None:
    flat = {k: v for k, v in REAL_CFG.items() if k != "engram_pad_token_id"}
    flat["engram_pad_id"] = 2
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"architectures": ["x"], "text_config": flat}))
    cfg = load_model_config(p)
    assert cfg["engram_pad_token_id"] == 2
    assert EngramLayout.from_config(p).rows == [384006168, 384016682]


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"engram_layer_ids": []}, "engram_layer_ids"),
        ({"engram_layer_ids": [1, 1]}, "duplicates"),
        ({"engram_head_dim": 100}, "multiple of 32"),
        ({"engram_num_embeddings": [5]}, "one positive int per"),
        ({"engram_vocab_size": "x"}, "engram_vocab_size"),
        ({"engram_max_ngram_size": 1}, r"in \[2, 16\]"),
        # plausibility bounds: these used to hang the prime search or overflow int64/u32
        ({"engram_max_ngram_size": 10**6}, r"in \[2, 16\]"),
        ({"engram_n_heads": 10**9}, r"engram_n_heads must be in \[1, 256\]"),
        ({"engram_vocab_size": 10**30}, r"in \[2, 2\^32\]"),
        ({"engram_compressed_vocab_size": 10**20}, r"in \[1, 2\^31\]"),
        ({"engram_head_dim": 2**40}, "multiple of 32 <= 8192"),
        ({"engram_layer_ids": [1, 10**20]}, "must be < 65536"),
        ({"engram_pad_id": 3}, "differs"),
    ],
)
def test_bad_configs(change: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load_model_config(dict(REAL_CFG, **change))


def test_missing_keys_and_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lacks Engram keys: engram_n_heads"):
        load_model_config({k: v for k, v in REAL_CFG.items() if k != "engram_n_heads"})
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_config(tmp_path / "list.json")
    cfg = {k: v for k, v in REAL_CFG.items() if k != "engram_compressed_vocab_size"}
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        load_model_config(cfg)


def test_rank_errors(real: EngramLayout) -> None:
    with pytest.raises(ConfigError, match="tp"):
        real.columns_for_rank(0, 0)
    with pytest.raises(ConfigError, match="rank"):
        real.columns_for_rank(2, 2)
    with pytest.raises(ConfigError, match="no Engram table"):
        real.layer_index(3)


def test_to_json(real: EngramLayout) -> None:
    j = real.to_json(2)
    assert j["layers"][0]["ranks"][0]["rows"] == [0, 192001740]
    assert j["layers"][1]["ranks"][1]["rows"] == [192007016, 384016682]
    json.dumps(j)


def test_tp_bound() -> None:
    """`layout --tp 100000000` used to print (and build) one entry per rank for ever."""
    lay = EngramLayout.from_config(REAL_CFG)
    with pytest.raises(ConfigError, match=r"tp must be an int in \[1, 1024\]"):
        lay.to_json(10**8)
    with pytest.raises(ConfigError, match="tp must be"):
        lay.columns_for_rank(True, 0)
    assert lay.columns_for_rank(1024, 1023) == (24, 24)


def test_layout_from_manifest_round_trip_and_foreign_hash(tmp_path: Path) -> None:
    """The layout a manifest was written for; a table hashed for another layout is refused."""
    import dataclasses
    import types

    from dsv41.engram import synthetic
    from dsv41.engram.layout import layout_from_manifest
    from dsv41.engram.manifest import load_manifest
    from dsv41.errors import VerificationError

    synthetic.write_synthetic_tables(LAB, tmp_path, seed=5, rows_override=[900, 300], chunk_size=1 << 20)
    m = load_manifest(tmp_path / "manifest.json")
    got = layout_from_manifest(m)
    want = EngramLayout.from_config(load_model_config(LAB))
    assert (got.layer_ids, got.primes, got.offsets, got.multipliers) == (
        want.layer_ids,
        want.primes,
        want.offsets,
        want.multipliers,
    )
    first = m.tables[0].layer_id

    def table(layer_id: int):
        t = m.table(layer_id)
        if layer_id != first:
            return t
        return dataclasses.replace(t, hash={**t.hash, "multipliers": [3] + list(t.hash["multipliers"][1:])})

    with pytest.raises(VerificationError, match=f"layer {first}: hash parameters differ"):
        layout_from_manifest(types.SimpleNamespace(layout=m.layout, table=table))
