"""What the overlay's CPU tests share (tests/unit/test_overlay_engram.py, test_overlay_worker.py):
the synthetic tables (``tabs``), a CPU emulation of vLLM's Engram lookup kernel and the exact
reference rows it is compared with bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.engram import dequant, synthetic
from dsv41.engram.layout import EngramLayout
from dsv41.engram.manifest import load_manifest
from dsv41.overlay import engram as E


CFG = {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_vocab_size": 500,
       "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
       "engram_compressed_vocab_size": 229, "vocab_size": 260}
SEED = 5


@pytest.fixture(scope="module")
def tabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ovl")
    mpath = synthetic.write_synthetic_tables(CFG, d, seed=SEED, chunk_size=1 << 20)
    return load_manifest(mpath), d, EngramLayout.from_config(CFG)


def kernel_on_cpu(w, s, sel, dst, out, n, rows):
    """Emulation of vLLM's ``_engram_lookup_kernel`` (SORTED, BF16 out): owned = 0 <= sel < n;
    value = float(e4m3 byte) * bitcast<float>(scale byte << 23), rounded to bf16; others 0."""
    sel = sel[:rows].long()
    owned = (sel >= 0) & (sel < n)
    local = torch.where(owned, sel, torch.zeros_like(sel))
    vals = w[local].view(torch.float8_e4m3fn).float()
    scale = (s[local].int() << 23).view(torch.float32).repeat_interleave(32, dim=1)
    res = (vals * scale).to(torch.bfloat16)
    res[~owned] = 0
    out.view(-1, w.shape[1])[dst[:rows].long()] = res


def reference(tabs_, layer_id: int, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """float32 [R, 256] holding bf16 values: owned rows via dequant.dequantize(vllm), others 0."""
    manifest, d, layout = tabs_
    flat = ids.reshape(-1).astype(np.int64)
    owned = (flat >= lo) & (flat < hi)
    ref = np.zeros((flat.size, 256), np.float32)
    if owned.any():
        packed = synthetic.synthetic_rows(SEED, layer_id, layout.rows[layout.layer_index(layer_id)], flat[owned])
        ref[owned] = dequant.dequantize(packed, convention="vllm", backend="numpy")[0]
    return ref


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    nan = np.isnan(got) & np.isnan(ref)  # NaN payloads are not compared (0 * inf)
    return bool(np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))


def remote_rows(tabs_, src, layer_id: int, tp: int = 2, rank: int = 0, max_tokens: int = 64, **kw):
    """The overlay's ``RemoteRows`` for ``layer_id`` of rank ``rank`` at TP ``tp`` over ``src``, on CPU."""
    manifest, d, layout = tabs_
    li = layout.layer_index(layer_id)
    c0, _ = layout.columns_for_rank(tp, rank)
    lo, hi = layout.row_range(li, tp, rank)
    return E.RemoteRows(src, layer_id, head_start=c0, part=-(-layout.n_columns // tp), n_hash_cols=layout.n_columns,
                        vocab_start=lo, vocab_end=hi, dim=256, block=32, max_tokens=max_tokens, device="cpu",
                        dequant=kernel_on_cpu, rank=rank, **kw)


def lookup_ids(tabs_, rr, t: int, seed: int) -> np.ndarray:
    """(t, n_columns) int32 hashed ids for ``rr``: own rows, -1 pads, out-of-range and other ranks' rows."""
    layout = tabs_[2]
    li = layout.layer_index(rr.layer_id)
    rng = np.random.default_rng(seed)
    ids = rng.integers(rr.vocab_start, rr.vocab_end, size=(t, layout.n_columns)).astype(np.int32)
    u = rng.random(ids.shape)
    ids[u < 0.1] = -1
    ids[u > 0.9] = layout.rows[li] + 3
    ids[(u > 0.8) & (u <= 0.9)] = rng.integers(0, layout.rows[li])
    return ids


def exact_rows(tabs_, rr, ids: np.ndarray, out) -> bool:
    """``out`` (t, part, 256) bf16 equals the reference rows of ``ids`` bit for bit."""
    he = min(rr.head_start + rr.part, rr.n_hash_cols)
    mine = np.full((ids.shape[0], rr.part), -1, np.int64)
    mine[:, : he - rr.head_start] = ids[:, rr.head_start:he]
    return same_bits(out.float().numpy().reshape(-1, 256), reference(tabs_, rr.layer_id, mine, rr.vocab_start,
                                                                     rr.vocab_end))


def poisoned(t: int, part: int):
    """A (t, part, 256) bf16 output buffer of NaNs (a row left unwritten shows)."""
    return torch.full((t, part, 256), float("nan"), dtype=torch.bfloat16)
