"""The overlay's Engram path on the CPU: id masking, row assembly and the compilation refusals.

vLLM's Triton kernel needs a GPU; here its arithmetic is emulated (``kernel_on_cpu``, a test fake
written from ``_engram_lookup_kernel``'s SORTED/BF16 branch) and the assembled rows are compared
bit for bit with ``dequant.dequantize(convention="vllm")``.  tests/gpu/vllm_overlay_qualify.py
compares against vLLM's real kernel and lookup on CUDA.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv41.engram import reader, synthetic
from dsv41.engram.client import RemoteRowSource, RemoteUnavailable
from dsv41.engram.layout import EngramLayout
from dsv41.engram.rowsource import LocalRowSource
from dsv41.engram.server import load_tables
from dsv41.errors import Dsv41Error
from dsv41.overlay import contract as C, engram as E, settings as S
from overlayutil import CFG, SEED, kernel_on_cpu, reference, same_bits, tabs  # noqa: F401 - tabs is a fixture


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
    src = LocalRowSource(reader.LocalRowReader(manifest, d))
    rng = np.random.default_rng(tp * 10 + rank)
    for li, layer_id in enumerate(layout.layer_ids):
        c0, _ = layout.columns_for_rank(tp, rank)
        part = -(-layout.n_columns // tp)
        lo, hi = layout.row_range(li, tp, rank)
        rr = E.RemoteRows(
            src,
            layer_id,
            head_start=c0,
            part=part,
            n_hash_cols=layout.n_columns,
            vocab_start=lo,
            vocab_end=hi,
            dim=256,
            block=32,
            max_tokens=64,
            device="cpu",
            dequant=kernel_on_cpu,
        )
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
                assert (got.reshape(t, part, 256)[:, he - c0 :] == 0).all()  # padded head: zero rows
    assert src.counters()["fallbacks"] == 0


def test_scale_bytes_zero_and_255_reach_the_output(tabs) -> None:
    manifest, d, layout = tabs
    packed = synthetic.synthetic_rows(SEED, 1, layout.rows[0], np.array([1, 2]))
    assert (packed[0, 256:] == 0).any() and (packed[1, 256:] == 255).any()
    src = LocalRowSource(reader.LocalRowReader(manifest, d))
    rr = E.RemoteRows(
        src,
        1,
        head_start=0,
        part=24,
        n_hash_cols=24,
        vocab_start=0,
        vocab_end=layout.rows[0],
        dim=256,
        block=32,
        max_tokens=4,
        device="cpu",
        dequant=kernel_on_cpu,
    )
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
    src = RemoteRowSource(
        "tcp://127.0.0.1:1", manifest, 0, 1, timeout_ms=50, required=False, local=reader.LocalRowReader(manifest, d)
    )
    try:
        rr = E.RemoteRows(
            src,
            14,
            head_start=0,
            part=24,
            n_hash_cols=24,
            vocab_start=0,
            vocab_end=layout.rows[1],
            dim=256,
            block=32,
            max_tokens=8,
            device="cpu",
            dequant=kernel_on_cpu,
        )
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
    src = LocalRowSource(reader.LocalRowReader(manifest, d))
    rr = E.RemoteRows(
        src,
        1,
        head_start=0,
        part=24,
        n_hash_cols=24,
        vocab_start=0,
        vocab_end=layout.rows[0],
        dim=256,
        block=32,
        max_tokens=2,
        device="cpu",
        dequant=kernel_on_cpu,
    )
    rr.lookup(torch.zeros((0, 24), dtype=torch.int32), torch.empty((0, 24, 256), dtype=torch.bfloat16))
    with pytest.raises(Dsv41Error, match="3 tokens > staging for 2"):
        rr.lookup(torch.zeros((3, 24), dtype=torch.int32), torch.empty((3, 24, 256), dtype=torch.bfloat16))
    ids = torch.full((2, 24), -1, dtype=torch.int32)  # nothing owned: zero rows, no fetch
    out = torch.full((2, 24, 256), 1.0, dtype=torch.bfloat16)
    rr.lookup(ids, out)
    assert (out == 0).all() and src.counters()["lookups"] == 0
    assert rr.host_bytes == 2 * 24 * 8 + 2 * 24 * (4 + 264)  # int64 ids, selectors + rows


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
    got = {
        "head_start": 12,
        "part_n_hash_cols": 12,
        "vocab_start_idx": r["layers"][1]["vocab_start_idx"],
        "vocab_end_idx": r["layers"][1]["vocab_end_idx"],
    }
    assert C.check_ranges(flash, 14, 2, 1, got, contract) == []
    bad = dict(got, vocab_start_idx=got["vocab_start_idx"] + 1)
    problems = C.check_ranges(flash, 14, 2, 1, bad, contract)
    assert len(problems) == 2 and "dsv41 layout" in problems[0] and "contract" in problems[1]
    small = EngramLayout.from_config(CFG)  # not the contract's model: the layout alone decides
    lo, hi = small.row_range(0, 2, 0)
    assert (
        C.check_ranges(
            small,
            1,
            2,
            0,
            {"head_start": 0, "part_n_hash_cols": 12, "vocab_start_idx": lo, "vocab_end_idx": hi},
            contract,
        )
        == []
    )


# ----------------------------------------------------------- the patch on a fake vLLM module


def fake_vllm_engram(tp: int, rank: int, mode: str = "PIECEWISE", cpu_offload: bool = True):
    """A module shaped like vLLM 0.33.0's ``common/engram.py`` where the overlay touches it
    (constructor order, ``_allocate_weights``, ``_weight_loader``, ``lookup``,
    ``Engram._create_embedding``); the kernel is ``kernel_on_cpu`` behind vLLM's launch syntax."""
    mod = types.ModuleType("fake_vllm_engram")
    ns = types.SimpleNamespace
    mod.get_current_vllm_config = lambda: ns(
        compilation_config=ns(cudagraph_mode=ns(name=mode)),
        additional_config={},
        scheduler_config=ns(max_num_batched_tokens=16),
    )
    mod.get_tensor_model_parallel_rank = lambda: rank
    mod.triton = ns(cdiv=lambda a, b: -(-a // b))
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            def run(w, s, sel, dst, out, vocab_start, vocab_end, rows, st, sh, **kw):
                launches.append(kw)
                assert w.dtype == torch.float8_e4m3fn and kw["SORTED"] and not kw["PACKED"] and vocab_start == 0
                kernel_on_cpu(w.view(torch.uint8), s, sel, dst, out, vocab_end, rows)

            return run

    mod._engram_lookup_kernel = Kernel()
    mod.launches = launches

    class ParallelEngramEmbedding:
        _weight_loader = staticmethod(lambda param, w: "vllm's loader")

        def __init__(self, num_embeddings, dim, head_sizes, block_size=32, cpu_offload=cpu_offload):
            self.cpu_offload, self.dp_size, self.dp_shared_memory, self.peer_rows = cpu_offload, 1, False, 0
            self.dim, self.block_size, self.n_hash_cols, self.tp_size = dim, block_size, len(head_sizes), tp
            self.part_n_hash_cols = -(-self.n_hash_cols // tp)
            self.head_start = rank * self.part_n_hash_cols
            self.vocab_start_idx = sum(head_sizes[: self.head_start])
            self.vocab_end_idx = sum(head_sizes[: self.head_start + self.part_n_hash_cols])
            self.part_num_embeddings = self.vocab_end_idx - self.vocab_start_idx
            self._num_sms = 4
            self.weight, self.weight_scale_inv = self._allocate_weights()
            self.loader = self._weight_loader

        def _allocate_weights(self):
            return (
                torch.zeros(self.part_num_embeddings, self.dim, dtype=torch.uint8),
                torch.zeros(self.part_num_embeddings, self.dim // 32, dtype=torch.uint8),
            )

        def lookup(self, indices, out, background=False):
            out.fill_(7)  # "vLLM's own path"

    waits = []
    mod.waits = waits

    def eager_break_during_capture(fn):  # vLLM's decorator outside a capture: a plain call
        def wrapper(*a, **k):
            return fn(*a, **k)

        wrapper.__wrapped__, wrapper.eager_break = fn, True
        return wrapper

    mod.eager_break_during_capture = eager_break_during_capture

    class Engram:
        _prefetch_done = "vllm's prefetch event"

        def __init__(self, layout, li):
            self.embed_tokens = self._create_embedding(layout, li)

        @eager_break_during_capture
        def _finish_prefetch(self, event):
            waits.append(event)  # vLLM: current_stream().wait_event(event)

        def _ready_rows(self, num_tokens):
            self._finish_prefetch(self._prefetch_done)

        def _create_embedding(self, layout, li):
            return ParallelEngramEmbedding(layout.num_embeddings[li], 256, layout.head_sizes[li])

    mod.ParallelEngramEmbedding, mod.Engram = ParallelEngramEmbedding, Engram
    return mod


@pytest.fixture
def runtime(tabs, tmp_path):
    manifest, d, layout = tabs
    (tmp_path / "manifest.json").write_text(Path(manifest.path).read_text())
    (tmp_path / "overlay.json").write_text(json.dumps({"tables_dir": str(d)}))
    E._sources.clear()
    yield tmp_path
    for src, _ in E._sources.values():
        src.close()
    E._sources.clear()


def _vlayout(layout):
    return types.SimpleNamespace(
        layer_ids=layout.layer_ids, num_embeddings=layout.rows, head_sizes=[tuple(p) for p in layout.primes]
    )


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_apply_takes_the_table_and_serves_exact_rows(tabs, runtime, breakable, tp: int, rank: int) -> None:
    manifest, d, layout = tabs
    mod = fake_vllm_engram(tp, rank)
    settings = S.parse(
        {
            "DSV41_ENGRAM_REMOTE": ",".join(["tcp://127.0.0.1:1"] * tp),
            "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "50",
            "DSV41_RUNTIME_ROOT": str(runtime),
        }
    )
    E.apply(mod, settings, C.load())
    E.apply(mod, settings, C.load())  # idempotent
    eng = mod.Engram(_vlayout(layout), 1)
    emb = eng.embed_tokens
    assert emb.weight.numel() == 0 and emb.weight_scale_inv.numel() == 0  # no host table
    assert emb.loader(None, None) is None  # the checkpoint's tensor is dropped
    assert emb._dsv41.layer_id == 14 and emb._dsv41.max_tokens == 16
    ids = np.random.default_rng(3).integers(-1, layout.rows[1] + 2, size=(5, 24)).astype(np.int32)
    out = torch.empty((5, emb.part_n_hash_cols, 256), dtype=torch.bfloat16)
    emb.lookup(torch.from_numpy(ids), out, background=True)  # vLLM's _start_prefetch
    eng._ready_rows(5)  # -> the patched _finish_prefetch: the hand-off, then vLLM's own wait
    assert mod.waits == ["vllm's prefetch event"] and mod.Engram._finish_prefetch.eager_break
    he = emb.head_start + emb.part_n_hash_cols
    ref = reference(tabs, 14, ids[:, emb.head_start : he], emb.vocab_start_idx, emb.vocab_end_idx)
    assert same_bits(out.float().numpy().reshape(-1, 256), ref)
    assert mod.launches[-1]["LOCAL_HEADS"] == emb.part_n_hash_cols and mod.launches[-1]["TOTAL_HEADS"] == 24
    src = E._sources[next(iter(E._sources))][0]
    assert src.counters()["fallbacks"] == 1  # nothing listens on port 1: exact local rows


def test_apply_refuses_full_graphs_at_construction(tabs, runtime) -> None:
    manifest, d, layout = tabs
    mod = fake_vllm_engram(1, 0, mode="FULL_AND_PIECEWISE")
    E.apply(mod, S.parse({"DSV41_ENGRAM_REMOTE": "tcp://127.0.0.1:1", "DSV41_RUNTIME_ROOT": str(runtime)}), C.load())
    with pytest.raises(E.OverlayRefused, match="PIECEWISE"):
        mod.Engram(_vlayout(layout), 0)


@pytest.mark.parametrize("required", [False, True])
def test_apply_declines_what_it_cannot_serve(tabs, runtime, breakable, required: bool, caplog) -> None:
    manifest, d, layout = tabs
    env = {
        "DSV41_ENGRAM_REMOTE": "tcp://127.0.0.1:1",
        "DSV41_RUNTIME_ROOT": str(runtime),
        "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "50",
    }
    if required:
        env["DSV41_ENGRAM_REMOTE_REQUIRED"] = "1"
    settings = S.parse(env)
    gpu_tables = fake_vllm_engram(1, 0, cpu_offload=False)
    E.apply(gpu_tables, settings, C.load())
    wrong_rows = fake_vllm_engram(1, 0)
    E.apply(wrong_rows, settings, C.load())
    bad = _vlayout(layout)
    bad.num_embeddings = [r + 1 for r in layout.rows]
    if required:
        with pytest.raises(E.OverlayRefused, match="host-offloaded.*REQUIRED=1"):
            gpu_tables.Engram(_vlayout(layout), 0)
        with pytest.raises((E.OverlayRefused, Dsv41Error), match="required|rows"):
            wrong_rows.Engram(bad, 0)
        return
    with caplog.at_level("ERROR", logger="dsv41.overlay"):
        a = gpu_tables.Engram(_vlayout(layout), 0)
        b = wrong_rows.Engram(bad, 0)
    for eng in (a, b):  # vLLM's own table and lookup
        assert eng.embed_tokens.weight.numel() > 0 and getattr(eng.embed_tokens, "_dsv41", None) is None
        out = torch.zeros((1, 24, 256), dtype=torch.bfloat16)
        eng.embed_tokens.lookup(torch.zeros((1, 24), dtype=torch.int32), out)
        assert (out == 7).all()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("host-offloaded" in m for m in msgs) and any("rows, the manifest" in m for m in msgs)


def test_source_takes_the_engine_deadline_and_spin(tabs, runtime) -> None:
    """The overlay's RemoteRowSource gets DSV41_ENGRAM_LOOKUP_DEADLINE_MS and
    DSV41_TRANSPORT_CLIENT_SPIN_US from the same settings the engine reads: against a hung server
    with a 5 s request timeout a lookup returns the exact local rows at the 100 ms deadline,
    counted; unset, both take their defaults (1000 ms, 50 us)."""
    from serverutil import SilentServer

    manifest, d, layout = tabs
    tables, _ = load_tables(manifest, d)
    hung = SilentServer(tables)
    try:
        settings = S.parse(
            {
                "DSV41_ENGRAM_REMOTE": f"tcp://127.0.0.1:{hung.port}",
                "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "5000",
                "DSV41_ENGRAM_LOOKUP_DEADLINE_MS": "100",
                "DSV41_TRANSPORT_CLIENT_SPIN_US": "20",
                "DSV41_RUNTIME_ROOT": str(runtime),
            }
        )
        src, _ = E._source(settings, 1, 0)
        assert src.deadline_s == 0.1 and src.spin_us == 20 and src._client.spin_us == 20
        rows = np.random.default_rng(4).integers(0, layout.rows[1], 24)
        t0 = time.monotonic()
        got = src.lookup(14, rows)
        assert time.monotonic() - t0 < 0.1 + 1.0  # the deadline, not the 5 s timeout (loaded host)
        ref = reader.LocalRowReader(manifest, d)
        np.testing.assert_array_equal(got, ref.read(14, rows))
        ref.close()
        c = src.counters()
        assert c["deadline_exceeded"] == 1 and c["fallbacks"] == 1 and c["deadline_ms"] == 100
    finally:
        hung.close()
    plain = S.parse({"DSV41_ENGRAM_REMOTE": "tcp://127.0.0.1:1", "DSV41_RUNTIME_ROOT": str(runtime)})
    src2, _ = E._source(plain, 1, 0)
    assert src2.deadline_s == 1.0 and src2.spin_us == 50
