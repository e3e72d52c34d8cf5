"""The overlay's Engram path on the CPU: id masking, row assembly and the compilation refusals.

vLLM's Triton kernel needs a GPU; here its arithmetic is emulated (``kernel_on_cpu``, a test fake
written from ``_engram_lookup_kernel``'s SORTED/BF16 branch) and the assembled rows are compared
bit for bit with ``tables.dequantize(convention="vllm")``.  tests/gpu/vllm_overlay_qualify.py
compares against vLLM's real kernel and lookup on CUDA.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv41.engram import tables
from dsv41.engram.client import RemoteRowSource, RemoteUnavailable
from dsv41.engram.layout import EngramLayout
from dsv41.engram.manifest import load_manifest
from dsv41.engram.rowsource import LocalRowSource
from dsv41.overlay import contract as C
from dsv41.overlay import engram as E

CFG = {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_vocab_size": 500,
       "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
       "engram_compressed_vocab_size": 229, "vocab_size": 260}
SEED = 5


@pytest.fixture(scope="module")
def tabs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ovl")
    mpath = tables.write_synthetic_tables(CFG, d, seed=SEED, chunk_size=1 << 20)
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
    """float32 [R, 256] holding bf16 values: owned rows via tables.dequantize(vllm), others 0."""
    manifest, d, layout = tabs_
    flat = ids.reshape(-1).astype(np.int64)
    owned = (flat >= lo) & (flat < hi)
    ref = np.zeros((flat.size, 256), np.float32)
    if owned.any():
        packed = tables.synthetic_rows(SEED, layer_id, layout.rows[layout.layer_index(layer_id)], flat[owned])
        ref[owned] = tables.dequantize(packed, convention="vllm", backend="numpy")[0]
    return ref


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    nan = np.isnan(got) & np.isnan(ref)  # NaN payloads are not compared (0 * inf)
    return bool(np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))


def test_plan_rows_masks_like_the_kernel() -> None:
    ids = np.array([5, -1, 9, 10, 4, 12, 9, -7], np.int32)
    sel, fetch = E.plan_rows(ids, 5, 12)
    assert sel.tolist() == [0, -1, 1, 2, -1, -1, 3, -1]
    assert fetch.tolist() == [5, 9, 10, 9] and fetch.dtype == np.int64
    buf = np.zeros(8, np.int32)
    sel2, _ = E.plan_rows(ids, 5, 12, sel_out=buf)
    assert sel2 is buf and buf.tolist() == sel.tolist()
    sel, fetch = E.plan_rows(np.array([], np.int32), 0, 10)
    assert sel.size == 0 and fetch.size == 0


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1), (5, 4)])
def test_rows_assembled_bit_exact_against_tables_dequantize_vllm(tabs, tp: int, rank: int) -> None:
    manifest, d, layout = tabs
    src = LocalRowSource(tables.LocalRowReader(manifest, d))
    rng = np.random.default_rng(tp * 10 + rank)
    for li, layer_id in enumerate(layout.layer_ids):
        c0, _ = layout.columns_for_rank(tp, rank)
        part = -(-layout.n_columns // tp)
        lo, hi = layout.row_range(li, tp, rank)
        rr = E.RemoteRows(src, layer_id, head_start=c0, part=part, n_hash_cols=layout.n_columns,
                          vocab_start=lo, vocab_end=hi, dim=256, block=32, max_tokens=64, device="cpu",
                          dequant=kernel_on_cpu)
        for t in (1, 7, 64):
            ids = rng.integers(lo, hi, size=(t, layout.n_columns)).astype(np.int32)
            u = rng.random(ids.shape)
            ids[u < 0.1] = -1
            ids[(u > 0.9)] = layout.rows[li] + 3  # past the table
            ids[(u > 0.8) & (u <= 0.9)] = rng.integers(0, layout.rows[li])  # any rank's rows
            if lo <= 2 < hi:
                ids[0, c0], ids[-1, min(c0 + 1, layout.n_columns - 1)] = 1, 2  # scale bytes 0 and 255
            out = torch.full((t, part, 256), float("nan"), dtype=torch.bfloat16)  # poisoned
            rr.lookup(torch.from_numpy(ids), out)
            mine = np.full((t, part), -1, np.int64)
            he = min(c0 + part, layout.n_columns)
            mine[:, : he - c0] = ids[:, c0:he]
            ref = reference(tabs, layer_id, mine, lo, hi)
            got = out.float().numpy().reshape(-1, 256)
            assert same_bits(got, ref), (tp, rank, layer_id, t)
            if tp == 5:
                assert (got.reshape(t, part, 256)[:, he - c0:] == 0).all()  # padded head: zero rows
    assert src.counters()["fallbacks"] == 0


def test_scale_bytes_zero_and_255_reach_the_output(tabs) -> None:
    manifest, d, layout = tabs
    packed = tables.synthetic_rows(SEED, 1, layout.rows[0], np.array([1, 2]))
    assert (packed[0, 256:] == 0).any() and (packed[1, 256:] == 255).any()
    src = LocalRowSource(tables.LocalRowReader(manifest, d))
    rr = E.RemoteRows(src, 1, head_start=0, part=24, n_hash_cols=24, vocab_start=0, vocab_end=layout.rows[0],
                      dim=256, block=32, max_tokens=4, device="cpu", dequant=kernel_on_cpu)
    ids = np.full((1, 24), -1, np.int32)
    ids[0, :2] = [1, 2]
    out = torch.empty((1, 24, 256), dtype=torch.bfloat16)
    rr.lookup(torch.from_numpy(ids), out)
    r1, r2 = out[0, 0].float().numpy(), out[0, 1].float().numpy()
    blk0 = packed[0, 256:] == 0
    assert (r1.reshape(8, 32)[blk0] == 0).all()  # scale byte 0 -> 0.0 (vLLM), not 2^-127
    blk255 = packed[1, 256:] == 255
    v = r2.reshape(8, 32)[blk255]
    assert np.isinf(v[packed[1, :256].reshape(8, 32)[blk255] & 0x7F != 0]).all()  # 255 -> inf


def test_remote_source_falls_back_exactly_and_refuses_when_required(tabs) -> None:
    manifest, d, layout = tabs
    # nothing listens on port 1: remote fails, the local shards give the exact rows
    src = RemoteRowSource("tcp://127.0.0.1:1", manifest, 0, 1, timeout_ms=50, required=False,
                          local=tables.LocalRowReader(manifest, d))
    try:
        rr = E.RemoteRows(src, 14, head_start=0, part=24, n_hash_cols=24, vocab_start=0,
                          vocab_end=layout.rows[1], dim=256, block=32, max_tokens=8, device="cpu",
                          dequant=kernel_on_cpu)
        ids = np.random.default_rng(0).integers(-2, layout.rows[1] + 5, size=(8, 24)).astype(np.int32)
        out = torch.empty((8, 24, 256), dtype=torch.bfloat16)
        rr.lookup(torch.from_numpy(ids), out)
        assert same_bits(out.float().numpy().reshape(-1, 256), reference(tabs, 14, ids, 0, layout.rows[1]))
        assert src.counters()["fallbacks"] == 1 and src.counters()["remote_rows"] == 0
    finally:
        src.close()
    with pytest.raises(RemoteUnavailable, match="required"):
        RemoteRowSource("tcp://127.0.0.1:1", manifest, 0, 1, timeout_ms=50, required=True)


def test_too_many_tokens_and_empty_batches(tabs) -> None:
    manifest, d, layout = tabs
    src = LocalRowSource(tables.LocalRowReader(manifest, d))
    rr = E.RemoteRows(src, 1, head_start=0, part=24, n_hash_cols=24, vocab_start=0, vocab_end=layout.rows[0],
                      dim=256, block=32, max_tokens=2, device="cpu", dequant=kernel_on_cpu)
    rr.lookup(torch.zeros((0, 24), dtype=torch.int32), torch.empty((0, 24, 256), dtype=torch.bfloat16))
    with pytest.raises(E.Dsv41Error, match="3 tokens > staging for 2"):
        rr.lookup(torch.zeros((3, 24), dtype=torch.int32), torch.empty((3, 24, 256), dtype=torch.bfloat16))
    ids = torch.full((2, 24), -1, dtype=torch.int32)  # nothing owned: zero rows, no fetch
    out = torch.full((2, 24, 256), 1.0, dtype=torch.bfloat16)
    rr.lookup(ids, out)
    assert (out == 0).all() and src.counters()["lookups"] == 0
    assert rr.host_bytes == 2 * 24 * 4 + 2 * 24 * (4 + 264)


def _vcfg(mode: str, extra: dict | None = None):
    ns = types.SimpleNamespace
    return ns(compilation_config=ns(cudagraph_mode=ns(name=mode)), additional_config=extra or {})


@pytest.fixture
def breakable(monkeypatch):
    """vLLM's breakable_cudagraph module (absent in CI): a fake with its switch."""
    state = {"on": True}
    for name in ("vllm", "vllm.compilation"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    fake = types.ModuleType("vllm.compilation.breakable_cudagraph")
    fake.is_breakable_cudagraph_enabled = lambda: state["on"]
    monkeypatch.setitem(sys.modules, "vllm.compilation.breakable_cudagraph", fake)
    return state


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_graph_decode_is_refused_with_the_flag(mode: str, breakable) -> None:
    with pytest.raises(E.OverlayRefused, match=f"cudagraph_mode={mode}.*" + "cudagraph_mode.: .PIECEWISE"):
        E.check_compilation(_vcfg(mode))


def test_piecewise_and_eager_pass_specialized_decode_and_unbreakable_graphs_refused(breakable) -> None:
    E.check_compilation(_vcfg("PIECEWISE"))
    E.check_compilation(_vcfg("NONE"))
    with pytest.raises(E.OverlayRefused, match="latency_specialized.*--additional-config"):
        E.check_compilation(_vcfg("PIECEWISE", {"decode_backend": "latency_specialized"}))
    breakable["on"] = False
    with pytest.raises(E.OverlayRefused, match="VLLM_USE_BREAKABLE_CUDAGRAPH=0"):
        E.check_compilation(_vcfg("PIECEWISE"))
    E.check_compilation(_vcfg("NONE"))  # eager needs no graphs at all


def test_ranges_checked_against_layout_and_contract() -> None:
    flash = EngramLayout.from_config(str(Path(C.__file__).parents[1] / "data" / "dsv41_flash_engram_config.json"))
    contract = C.load()
    r = contract["ranges"]["tp"]["2"][1]
    got = {"head_start": 12, "part_n_hash_cols": 12, "vocab_start_idx": r["layers"][1]["vocab_start_idx"],
           "vocab_end_idx": r["layers"][1]["vocab_end_idx"]}
    assert C.check_ranges(flash, 14, 2, 1, got, contract) == []
    bad = dict(got, vocab_start_idx=got["vocab_start_idx"] + 1)
    problems = C.check_ranges(flash, 14, 2, 1, bad, contract)
    assert len(problems) == 2 and "dsv41 layout" in problems[0] and "contract" in problems[1]
    small = EngramLayout.from_config(CFG)  # not the contract's model: the layout alone decides
    lo, hi = small.row_range(0, 2, 0)
    assert C.check_ranges(small, 1, 2, 0, {"head_start": 0, "part_n_hash_cols": 12, "vocab_start_idx": lo,
                                           "vocab_end_idx": hi}, contract) == []
