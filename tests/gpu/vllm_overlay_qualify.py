#!/usr/bin/env python3
"""GPU qualification of the vLLM overlay against vLLM 0.33.0's own Engram code (docs/gpu.md).

Builds vLLM's own ``Engram`` / ``ParallelEngramEmbedding`` from the wheel's Python source on
CUDA (TP simulated per rank; nothing of vLLM's compiled extension), loads synthetic tables into
vLLM's pinned host tables with vLLM's own weight loader, starts ``dsv41 engram serve`` on
loopback, patches a second set of Engram layers with the overlay and compares ``staged_rows``
bit for bit (``prepare_embeddings`` -> ``_start_prefetch`` -> ``_ready_rows``) for random ids
including -1, out-of-range ids and other ranks' ids, over rows with scale bytes 0 and 255; the
same rows are also checked against ``dequant.dequantize(convention="vllm")`` on the CPU.  Then
the refusals (FULL graphs, specialized decode), the drafter seam (OverlaySpeculator against the
drafter run in-process) and the benchmark (overlay lookup + H2D + dequant vs vLLM's UVA lookup
of the same rows).  Prints one JSON document (also written to --out).

    python3 tests/gpu/vllm_overlay_qualify.py --vllm-src DIR --work DIR --out results.json

``--vllm-src``: a directory holding the wheel's ``vllm/`` Python files (no compiled extension).
Every vLLM object replaced by a stand-in is listed under ``stubs`` with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

STUBS: dict[str, str] = {}
#: The row transport's implementation at each end ("c++" or "python"), set by main().
TRANSPORT_IMPL: dict[str, str] = {}
SIM = {"tp": 1, "rank": 0}
ORIG: dict = {}  # vLLM's own ParallelEngramEmbedding._allocate_weights before the overlay patch


def ns(**kw):
    return types.SimpleNamespace(**kw)


class _Mode:
    def __init__(self, name: str) -> None:
        self.name = name


CFG = ns(scheduler_config=ns(max_num_batched_tokens=32768, max_num_seqs=64),
         engram_config=ns(cpu_offload=True, dp_shared_memory=False, use_thp=False),
         compilation_config=ns(cudagraph_mode=_Mode("PIECEWISE")), additional_config={}, lora_config=None)


def uva_view(cpu_tensor):
    """CUDA alias of a pinned host tensor (stands in for vLLM's compiled
    ``torch.ops._C.get_cuda_view_from_cpu_tensor``): the same UVA address through CuPy."""
    import cupy
    import torch

    assert cpu_tensor.is_pinned(), "UVA view of an unpinned tensor"
    nbytes = cpu_tensor.numel() * cpu_tensor.element_size()
    if nbytes == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    mem = cupy.cuda.UnownedMemory(cpu_tensor.data_ptr(), nbytes, cpu_tensor, device_id=0)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device="cuda").view(cpu_tensor.dtype).view(cpu_tensor.shape)


class StubLinear:
    """Stands in for ColumnParallelLinear (Engram.wkv; needs a TP process group; not exercised)."""

    def __init__(self, *a, **k) -> None:
        pass

    def __call__(self, *a, **k):
        raise RuntimeError("wkv is not exercised by this qualification")


def _stub_module(name: str, attrs: dict, reason: str, src: Path | None = None) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if src is not None and (src / name.replace(".", "/")).is_dir():
        mod.__path__ = [str(src / name.replace(".", "/"))]  # its submodules stay importable
    sys.modules[name] = mod
    STUBS[name] = reason


def load_vllm_engram(src: Path):
    """Import vllm.models.deepseek_v41.common.engram from ``src``; stub a direct dependency only
    when it fails to import here, and always the compiled-extension UVA view and the TP world."""
    import torch
    import triton

    sys.path.insert(0, str(src))
    os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    fallbacks = {
        "vllm.compilation.breakable_cudagraph": {"eager_break_during_capture": lambda f: f,
                                                 "is_breakable_cudagraph_enabled": lambda: True},
        "vllm.config": {"VllmConfig": object, "get_current_vllm_config": lambda: CFG},
        "vllm.distributed": {"get_dp_group": lambda: None, "get_engram_dp_group": lambda: None,
                             "get_engram_dp_size": lambda: 1,
                             "get_tensor_model_parallel_rank": lambda: SIM["rank"],
                             "get_tensor_model_parallel_world_size": lambda: SIM["tp"],
                             "tensor_model_parallel_all_gather": lambda x, dim=-1: x},
        "vllm.distributed.device_communicators.shm_broadcast": {"SHM_PATH": "/dev/shm",
                                                                "check_shm_free_space": lambda *a, **k: None},
        "vllm.distributed.parallel_state": {"GroupCoordinator": object, "in_the_same_node_as": lambda *a, **k: [True]},
        "vllm.forward_context": {"get_forward_context": lambda: None, "is_forward_context_available": lambda: False},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.model_executor.layers.fusion.quant_activation": {"QuantizedActivation": object},
        "vllm.model_executor.layers.linear": {"ColumnParallelLinear": StubLinear},
        "vllm.model_executor.layers.quantization": {"QuantizationConfig": object},
        "vllm.model_executor.layers.quantization.utils.quant_utils": {"kMxfp8Dynamic": None},
        "vllm.model_executor.utils": {"set_weight_attrs": lambda p, a: [setattr(p, k, v) for k, v in (a or {}).items()]},
        "vllm.models.deepseek_v41.common.ops.query_quant": {"can_fuse_query_quant": lambda *a: False,
                                                            "mxfp8_scale_bytes": lambda *a: 0,
                                                            "mxfp8_scale_offset": None},
        "vllm.platforms": {"current_platform": ns(is_cuda=lambda: True, is_rocm=lambda: False,
                                                  is_cuda_alike=lambda: True, is_xpu=lambda: False,
                                                  is_device_capability_family=lambda *a: False)},
        "vllm.triton_utils": {"tl": triton.language, "triton": triton},
        "vllm.utils.platform_utils": {"is_uva_available": lambda: True},
        "vllm.utils.torch_utils": {"get_accelerator_view_from_cpu_tensor": uva_view},
    }
    for name, attrs in fallbacks.items():
        before = set(sys.modules)
        try:
            mod = importlib.import_module(name)
            missing = [a for a in attrs if not hasattr(mod, a)]
            if missing:
                raise ImportError(f"lacks {missing}")
        except Exception as exc:  # noqa: BLE001 - any failure here means: stand in for it
            for m in set(sys.modules) - before:
                if m.startswith("vllm") and m != "vllm":
                    sys.modules.pop(m, None)
            _stub_module(name, attrs, f"import failed under torch {torch.__version__}: {type(exc).__name__}: "
                                      f"{str(exc)[:160]}", src)
    for pkg in ("vllm.models", "vllm.models.deepseek_v41", "vllm.models.deepseek_v41.common"):
        before = set(sys.modules)
        try:
            importlib.import_module(pkg)
        except Exception as exc:  # noqa: BLE001 - run engram.py without its package's __init__
            for m in set(sys.modules) - before:
                sys.modules.pop(m, None)
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(src / pkg.replace(".", "/"))]
            sys.modules[pkg] = mod
            STUBS[pkg] = (f"package __init__ not run (engram.py itself is): {type(exc).__name__}: "
                          f"{str(exc)[:160]}")
    eng = importlib.import_module("vllm.models.deepseek_v41.common.engram")
    # Always replaced: vLLM's compiled extension and the process-group world.
    eng.get_accelerator_view_from_cpu_tensor = uva_view
    STUBS["engram.get_accelerator_view_from_cpu_tensor"] = (
        "vLLM compiled extension (torch.ops._C.get_cuda_view_from_cpu_tensor): CuPy alias of the same UVA address")
    eng.get_current_vllm_config = lambda: CFG
    STUBS["engram.get_current_vllm_config"] = "VllmConfig of a served model (needs the whole engine): a namespace"
    eng.get_tensor_model_parallel_rank = lambda: SIM["rank"]
    eng.get_tensor_model_parallel_world_size = lambda: SIM["tp"]
    eng.get_engram_dp_size = lambda: 1
    eng.get_engram_dp_group = lambda: None
    STUBS["engram TP/DP world"] = "no torch.distributed world: TP rank/size set per simulated rank, Engram DP 1"
    eng.ColumnParallelLinear = StubLinear
    STUBS["engram.ColumnParallelLinear"] = "wkv projection needs a TP group; not part of the row path"
    eng.is_uva_available = lambda: True
    return eng


def synthetic_tables(cfgd: dict, work: Path, reuse: bool) -> tuple[Path, float, bool]:
    """(manifest path, seconds spent writing, reused?) of the synthetic tables (seed 7) under
    ``work/tables``; with ``reuse`` an existing manifest whose tables have this config's rows is
    kept (the 5 GB write takes ~40 s on the H200 host)."""
    from dsv41.engram.layout import EngramLayout
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.synthetic import write_synthetic_tables

    mpath = work / "tables" / "manifest.json"
    if reuse and mpath.is_file():
        try:
            m = load_manifest(mpath)
            want = EngramLayout.from_config(cfgd)
            if [int(m.table(lid).rows) for lid in want.layer_ids] == list(want.rows):
                return mpath, 0.0, True
        except Exception:  # noqa: BLE001 - anything off: write them again
            pass
    t0 = time.time()
    mpath = Path(write_synthetic_tables(cfgd, work / "tables", seed=7))
    return mpath, round(time.time() - t0, 1), False


def transport_impl(env: dict) -> dict[str, str]:
    """The row transport's implementation ("c++" or "python") of this process (the client) and
    of a process started with ``env`` (the table server's)."""
    from dsv41.transport import native

    srv = subprocess.run([sys.executable, "-c", "from dsv41.transport import native; print(native.implementation())"],
                         env=env, capture_output=True, text=True, timeout=60)
    return {"client": native.implementation(), "server": srv.stdout.strip() or f"unknown ({srv.stderr[-200:]})"}


def small_config(vocab: int) -> dict:
    return {"engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_vocab_size": vocab,
            "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 229, "vocab_size": 260}


def vllm_layout(eng, layout):
    cfg = ns(engram_layer_ids=layout.layer_ids, engram_num_embeddings=layout.rows,
             engram_max_ngram_size=layout.max_ngram_size, engram_n_heads=layout.n_heads,
             engram_head_dim=layout.head_dim, engram_compressed_vocab_size=layout.compressed_vocab_size,
             engram_pad_token_id=layout.pad_token_id, engram_vocab_size=layout.vocab_sizes[0])
    return eng.EngramLayout(cfg), cfg


def build_engram(eng, vl, li: int, model_cfg):
    import torch

    cfg = ns(hidden_size=64, hc_mult=4, rms_norm_eps=1e-6, **vars(model_cfg))
    with torch.device("cuda"):
        return eng.Engram(cfg, None, vl, li, False, f"model.layers.{vl.layer_ids[li]}.engram")


def load_vllm_tables(emb, manifest, data: Path, layer_id: int) -> None:
    """vLLM's own weight loader over the shard's tensors (what vLLM does at model load)."""
    from safetensors import safe_open

    import torch

    t = manifest.table(layer_id)
    with safe_open(str(data / t.file), framework="pt") as f:
        w = f.get_tensor(t.weight_name)
        s = f.get_tensor(t.scale_name)
    if w.dtype != torch.float8_e4m3fn:
        w = w.view(torch.uint8).view(torch.float8_e4m3fn)
    emb.weight.weight_loader(emb.weight, w.view(-1, 256))
    emb.weight_scale_inv.weight_loader(emb.weight_scale_inv, s.view(torch.uint8).view(-1, 8))


def random_ids(rng, t: int, layout, li: int, n_cols: int, lo: int, hi: int):
    """int32 [t, n_cols]: mostly ids of the rank's range, plus -1, ids past the table, and ids of
    other ranks (all masked to zero rows by vLLM's kernel)."""
    rows = layout.rows[li]
    ids = rng.integers(lo, hi, size=(t, n_cols), dtype=np.int64)
    u = rng.random((t, n_cols))
    ids[u < 0.05] = -1
    ids[(u >= 0.05) & (u < 0.08)] = rows + rng.integers(0, 1000)
    ids[(u >= 0.08) & (u < 0.12)] = rng.integers(0, rows, size=int(((u >= 0.08) & (u < 0.12)).sum()))
    if t >= 1 and lo <= 2 < hi:
        ids[0, 0], ids[0, -1] = 1, 2  # synthetic rows 1 and 2 carry scale bytes 0 and 255
    return ids.astype(np.int32)


def start(cmd: list[str], ready: Path, env: dict, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(str(ready) + ".log", "w"))
    t0 = time.time()
    while time.time() - t0 < timeout:
        if ready.exists() and ready.stat().st_size:
            txt = ready.read_text().strip()
            try:
                doc = json.loads(txt)
                urls = doc.get("urls") or doc.get("listen") or [v for v in doc.values() if isinstance(v, str) and "://" in v]
                url = urls[0] if isinstance(urls, list) else urls
            except json.JSONDecodeError:
                url = txt
            return proc, url
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[3:6]} exited: {Path(str(ready) + '.log').read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{cmd} not ready after {timeout} s")


def timed(fn, reps: int) -> float:
    import torch

    ts = []
    for i in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-src", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="dsv41-qual-")))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=400_000, help="engram_vocab_size of the synthetic tables")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--bench-only", action="store_true", help="skip the exactness cases and the drafter seam")
    ap.add_argument("--reuse-tables", action="store_true",
                    help="keep the synthetic tables already under --work when they match (no 5 GB rewrite)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    from dsv41.engram.layout import EngramLayout
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.dequant import dequantize
    from dsv41.engram.synthetic import synthetic_rows
    from dsv41.overlay import contract as C
    from dsv41.overlay import engram as E
    from dsv41.overlay import settings as S

    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}
    import triton

    res["triton"] = triton.__version__
    contract = C.load()
    res["contract_files_match_wheel_source"] = C.check_files(contract, args.vllm_src, "0.33.0") == []
    eng = load_vllm_engram(args.vllm_src)
    res["vllm_engram_module"] = eng.__file__

    cfgd = small_config(args.vocab)
    args.work.mkdir(parents=True, exist_ok=True)
    mpath, res["tables_write_s"], res["tables_reused"] = synthetic_tables(cfgd, args.work, args.reuse_tables)
    manifest = load_manifest(mpath)
    layout = EngramLayout.from_config(cfgd)
    res["table_rows"] = layout.rows
    runtime = args.work / "runtime"
    runtime.mkdir(exist_ok=True)
    (runtime / "manifest.json").write_text(Path(mpath).read_text())
    (runtime / "overlay.json").write_text(json.dumps({"tables_dir": str(args.work / "tables")}))

    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}:{os.environ.get('PYTHONPATH', '')}")
    TRANSPORT_IMPL.update(transport_impl(env))
    res["transport_impl"] = dict(TRANSPORT_IMPL)
    dsv41 = [sys.executable, "-c", "import sys; from dsv41.cli import main; sys.exit(main())"]
    srv, url = start(dsv41 + ["engram", "serve", "--manifest", str(mpath), "--listen", "tcp://127.0.0.1:0",
                              "--ready-file", str(args.work / "srv.ready")], args.work / "srv.ready", env)
    res["engram_server"] = url
    try:
        res.update(run_checks(eng, layout, manifest, args, url, runtime, contract, E, S, dequantize,
                              synthetic_rows, torch))
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    res["stubs"] = STUBS
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0 if res.get("all_bit_exact") else 1


def run_checks(eng, layout, manifest, args, url, runtime, contract, E, S, dequantize, synthetic_rows, torch):
    out: dict = {}
    vl, mcfg = vllm_layout(eng, layout)
    data = args.work / "tables"
    rng = np.random.default_rng(1234)
    def settings_for(tp: int):
        return S.parse({"DSV41_ENGRAM_REMOTE": ",".join([url] * tp), "DSV41_RUNTIME_ROOT": str(runtime)})

    cases = [(1, 0), (2, 0), (2, 1), (5, 4)] if not args.bench_only else [(2, 0)]
    exact, compared, zeros255 = True, 0, {"scale_0": 0, "scale_255": 0}
    per_case = []
    orig = (eng.ParallelEngramEmbedding._allocate_weights, eng.ParallelEngramEmbedding.lookup,
            eng.Engram._create_embedding)
    ORIG["alloc"] = orig[0]
    for tp, rank in cases:
        SIM.update(tp=tp, rank=rank)
        # vLLM's own layers (unpatched classes), tables loaded by vLLM's weight loader
        (eng.ParallelEngramEmbedding._allocate_weights, eng.ParallelEngramEmbedding.lookup,
         eng.Engram._create_embedding) = orig
        eng._dsv41_overlay = False
        own = [build_engram(eng, vl, li, mcfg) for li in range(len(layout.layer_ids))]
        for li, lid in enumerate(layout.layer_ids):
            load_vllm_tables(own[li].embed_tokens, manifest, data, lid)
        E._sources.clear()
        E.apply(eng, settings_for(tp), contract)
        ovl = [build_engram(eng, vl, li, mcfg) for li in range(len(layout.layer_ids))]
        case = {"tp": tp, "rank": rank, "vllm_pinned_bytes": 0, "overlay_pinned_bytes": 0, "sizes": []}
        for li, lid in enumerate(layout.layer_ids):
            a, b = own[li].embed_tokens, ovl[li].embed_tokens
            assert b._dsv41 is not None and b.weight.numel() == 0, "overlay did not take the table"
            case["vllm_pinned_bytes"] += a.weight.numel() + a.weight_scale_inv.numel()
            case["overlay_pinned_bytes"] += b._dsv41.host_bytes
            for t in (1, 24, 96, 4096):
                ids = random_ids(rng, t, layout, li, a.n_hash_cols, a.vocab_start_idx, a.vocab_end_idx)
                d = torch.from_numpy(ids).cuda()
                own[li].prepare_embeddings(d)
                ra = own[li]._ready_rows(t).clone()
                ovl[li].prepare_embeddings(d)
                rb = ovl[li]._ready_rows(t).clone()
                same = bool(torch.equal(ra.view(torch.int16), rb.view(torch.int16)))
                # CPU reference: dequant.dequantize(convention="vllm") of the owned rows
                he = min(a.head_start + a.part_n_hash_cols, a.n_hash_cols)
                mine = np.full((t, a.part_n_hash_cols), -1, np.int64)
                mine[:, : he - a.head_start] = ids[:, a.head_start:he]
                flat = mine.reshape(-1)
                owned = (flat >= a.vocab_start_idx) & (flat < a.vocab_end_idx)
                packed = synthetic_rows(7, lid, layout.rows[li], flat[owned])
                ref = np.zeros((flat.size, 256), np.float32)
                vals, counts = dequantize(packed, convention="vllm", backend="numpy")
                ref[owned] = vals
                zeros255["scale_0"] += counts["scale_zero"]
                zeros255["scale_255"] += counts["scale_255"]
                got = rb.float().cpu().numpy().reshape(-1, 256)
                both_nan = np.isnan(got) & np.isnan(ref)
                ref_ok = bool(np.array_equal(got[~both_nan].view(np.uint32), ref[~both_nan].view(np.uint32)))
                exact &= same and ref_ok
                compared += t * a.part_n_hash_cols
                case["sizes"].append({"layer": lid, "tokens": t, "vllm_vs_overlay_bit_exact": same,
                                      "overlay_vs_tables_dequantize_vllm": ref_ok, "owned_rows": int(owned.sum())})
        src = E._sources[next(iter(E._sources))][0]
        case["row_source_counters"] = {k: v for k, v in src.counters().items() if k in
                                       ("lookups", "rows", "remote_rows", "fallbacks", "transport_errors", "source")}
        per_case.append(case)
        del own, ovl
        torch.cuda.empty_cache()
    out["cases"] = per_case
    out["rows_compared"] = compared
    out["scale_bytes_seen"] = zeros255
    out["all_bit_exact"] = exact

    # the benchmark and the refusals run as TP2 rank 0: patch again with that rank's URL list
    (eng.ParallelEngramEmbedding._allocate_weights, eng.ParallelEngramEmbedding.lookup,
     eng.Engram._create_embedding) = orig
    eng._dsv41_overlay = False
    E._sources.clear()
    SIM.update(tp=2, rank=0)
    E.apply(eng, settings_for(2), contract)
    # refusals (model construction raises; nothing falls back silently)
    refusals = {}
    for label, mode, extra in (("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", {}),
                               ("FULL", "FULL", {}),
                               ("specialized decode", "PIECEWISE", {"decode_backend": "latency_specialized"})):
        CFG.compilation_config.cudagraph_mode, CFG.additional_config = _Mode(mode), extra
        try:
            build_engram(eng, vl, 0, mcfg)
            refusals[label] = "NOT refused"
        except E.OverlayRefused as exc:
            refusals[label] = str(exc)
    CFG.compilation_config.cudagraph_mode, CFG.additional_config = _Mode("PIECEWISE"), {}
    out["refusals"] = refusals
    out["bench"] = bench(eng, vl, mcfg, layout, manifest, data, rng, torch, args, E)
    if not args.bench_only:
        out["drafter"] = drafter_seam(args, torch)
    return out


def bench(eng, vl, mcfg, layout, manifest, data, rng, torch, args, E):
    """Per-rank rows of TP2 rank 0 (12 columns): overlay lookup+H2D+dequant vs vLLM's UVA
    lookup of the same ids, same host, medians over fresh ids per repetition."""
    SIM.update(tp=2, rank=0)
    ovl = build_engram(eng, vl, 0, mcfg)  # classes are patched: overlay
    emb_o = ovl.embed_tokens
    # vLLM's own lookup: call the original lookup on a table that holds the rows
    own = bench_own_table(eng, vl, mcfg, manifest, data, torch)
    a = own.embed_tokens
    results = []
    for label, t in (("decode", 24), ("decode", 48), ("decode", 96), ("prefill", 32768)):
        sets = [torch.from_numpy(random_ids(rng, t, layout, 0, a.n_hash_cols, a.vocab_start_idx,
                                            a.vocab_end_idx)).cuda() for _ in range(4)]
        out_a = torch.empty((t, a.part_n_hash_cols, 256), dtype=torch.bfloat16, device="cuda")
        out_b = torch.empty_like(out_a)
        reps = args.reps if t < 1000 else max(5, args.reps // 3)
        rr = emb_o._dsv41
        for i in range(2):
            a.lookup(sets[i % 4], out_a)
            rr.lookup(sets[i % 4], out_b)
        tv = timed(lambda i: a.lookup(sets[i % 4], out_a), reps)
        # start + join: the worker's fetch, H2D and kernel, joined by the current stream
        to = timed(lambda i: rr.lookup(sets[i % 4], out_b), reps)
        results.append({"case": label, "tokens": t, "rows": t * a.part_n_hash_cols,
                        "vllm_uva_ms": round(tv * 1e3, 3), "overlay_ms": round(to * 1e3, 3),
                        "overlay_over_vllm": round(to / tv, 2), **stages(emb_o, sets, a, reps, manifest, data, E, torch)})
    return {"rank": "TP2 rank 0 (12 of 24 columns)", "table_rows_per_rank": a.part_num_embeddings,
            "vllm_pinned_table_bytes": a.weight.numel() + a.weight_scale_inv.numel(),
            "overlay_pinned_staging_bytes": emb_o._dsv41.host_bytes, "transport": "tcp (loopback)",
            "transport_impl": TRANSPORT_IMPL,
            "results": results}


def stages(emb_o, sets, a, reps, manifest, data, E, torch) -> dict:
    """Where the overlay's time goes for the same ids: the row fetch alone (remote tcp, and the
    exact local reader), and the GPU stage alone (one H2D of selectors + rows, split, vLLM's kernel)."""
    from dsv41.engram.rowsource import LocalRowSource
    from dsv41.engram.reader import LocalRowReader

    rr = emb_o._dsv41
    plans = []
    for d in sets:
        ids = np.full((d.shape[0], rr.part), -1, np.int64)
        he = min(rr.head_start + rr.part, rr.n_hash_cols)
        ids[:, : he - rr.head_start] = d.cpu().numpy()[:, rr.head_start:he]
        plans.append(E.plan_rows(ids.reshape(-1), rr.vocab_start, rr.vocab_end))
    buf = np.empty((max(p[1].size for p in plans), E.ROW_BYTES), np.uint8)
    fetch_remote = timed(lambda i: rr.source.lookup(rr.layer_id, plans[i % 4][1], out=buf[: plans[i % 4][1].size]), reps)
    local = LocalRowSource(LocalRowReader(manifest, data))
    fetch_local = timed(lambda i: local.lookup(rr.layer_id, plans[i % 4][1]), reps)
    rows = plans[0][0].size
    n = plans[0][1].size
    nb = rows * 4 + n * E.ROW_BYTES
    out = torch.empty((sets[0].shape[0], rr.part, 256), dtype=torch.bfloat16, device="cuda")

    def gpu(i: int) -> None:
        dd = rr.d_buf[:nb]
        dd.copy_(rr.h_buf[:nb], non_blocking=True)
        rows_d = dd[rows * 4:].view(n, E.ROW_BYTES)
        rr.d_w[:n].copy_(rows_d[:, :256])
        rr.d_s[:n].copy_(rows_d[:, 256:])
        rr.dequant(rr.d_w, rr.d_s, dd[: rows * 4].view(torch.int32), rr.d_dst, out, n, rows)

    gpu_stage = timed(gpu, reps)
    return {"fetch_tcp_ms": round(fetch_remote * 1e3, 3), "fetch_local_reader_ms": round(fetch_local * 1e3, 3),
            "h2d_split_kernel_ms": round(gpu_stage * 1e3, 3), "owned_rows": int(n)}


def bench_own_table(eng, vl, mcfg, manifest, data, torch):
    saved = getattr(eng, "_dsv41_overlay", False)
    pa = eng.ParallelEngramEmbedding._allocate_weights
    eng.ParallelEngramEmbedding._allocate_weights = ORIG["alloc"]
    try:
        own = build_engram(eng, vl, 0, mcfg)
    finally:
        eng.ParallelEngramEmbedding._allocate_weights = pa
        eng._dsv41_overlay = saved
    load_vllm_tables(own.embed_tokens, manifest, data, vl.layer_ids[0])
    return own


def drafter_seam(args, torch):
    """OverlaySpeculator (over vLLM's BaseSpeculator when it imports here) with a remote
    ``dsv41 drafter serve`` on loopback, against the same drafter run in-process."""
    from dsv41.drafter.model import TorchDrafter, random_drafter
    from dsv41.drafter.factory import expected_identities
    from dsv41.drafter.speculators import RemoteSpeculator
    from dsv41.overlay import drafter as D

    res: dict = {}
    try:
        base = importlib.import_module("vllm.v1.worker.gpu.spec_decode.speculator").BaseSpeculator
        res["base"] = "vllm BaseSpeculator"
    except Exception as exc:  # noqa: BLE001
        import abc

        class base(abc.ABC):  # noqa: N801 - stand-in with the same abstract methods
            pass

        STUBS["vllm.v1.worker.gpu.spec_decode.speculator.BaseSpeculator"] = (
            f"import failed: {type(exc).__name__}: {str(exc)[:160]}")
        res["base"] = "stand-in ABC"
    H, V, k = 64, 260, 5
    ddir = args.work / "drafter"
    random_drafter(ddir, vocab_size=V, hidden_size=H, seed=3)
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}:{os.environ.get('PYTHONPATH', '')}")
    dsv41 = [sys.executable, "-c", "import sys; from dsv41.cli import main; sys.exit(main())"]
    proc, url = start(dsv41 + ["drafter", "serve", "--listen", "tcp://127.0.0.1:0", "--drafter", str(ddir),
                               "--device", "cpu", "--ready-file", str(args.work / "drafter.ready")],
                      args.work / "drafter.ready", env)
    try:
        expected = expected_identities(str(ddir), "")
        remote = RemoteSpeculator(url, expected, k=k, timeout_ms=5000)
        cls = D.speculator_class(base)
        n_reqs, max_len = 6, 64
        tpg = ns(rank_in_group=0, world_size=1, broadcast=lambda t, src=0: t)
        rs = ns(total_len=ns(gpu=torch.tensor([10, 20, 30, 5, 7, 40], dtype=torch.int32, device="cuda")),
                all_token_ids=ns(gpu=torch.randint(0, V, (n_reqs, max_len), dtype=torch.int32, device="cuda")))
        vcfg = ns(speculative_config=ns(num_speculative_tokens=k, draft_model_config=ns(
            hf_config=ns(dspark_target_layer_ids=[2, 3]))), scheduler_config=ns(max_num_seqs=16))
        spec = cls(vcfg, torch.device("cuda"), rs, tp_group=tpg, make_spec=lambda c: (remote, 3, 4))
        q = np.array([0, 3, 4, 9, 10, 11, 12])
        batch = ns(num_reqs=n_reqs, query_start_loc_np=q, idx_mapping=torch.arange(n_reqs, device="cuda"),
                   req_ids=[f"r{i}" for i in range(n_reqs)])
        T = int(q[-1])
        aux = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        num_sampled = torch.tensor([1, 1, 2, 0, 1, 1], device="cuda")
        num_rejected = torch.tensor([0, 0, 3, 0, 0, 0], device="cuda")
        drafts = spec.propose(batch, None, None, None, aux, num_sampled, num_rejected, None, None, None, None)
        # the same round in-process
        rows = D.hidden_rows(q, num_rejected.cpu().numpy())
        hid = aux[1][torch.from_numpy(rows).cuda()].float().cpu().numpy()
        tot = rs.total_len.gpu.long()
        cols = (tot[:, None] - 4 + torch.arange(4, device="cuda")[None]).clamp(min=0)
        tails = rs.all_token_ids.gpu[torch.arange(n_reqs, device="cuda")[:, None], cols].cpu().numpy()
        live, items = D.draft_inputs(batch.req_ids, num_sampled.cpu().numpy(), hid, tails, tot.cpu().numpy(), k)
        from dsv41.drafter.speculators import LocalSpeculator

        local = LocalSpeculator(str(ddir), k=k, device="cpu")
        want = D.fill_drafts(n_reqs, k, live, local.propose(items))
        res.update(drafts=drafts.cpu().tolist(), in_process=want.tolist(),
                   identical=bool(np.array_equal(drafts.cpu().numpy(), want)),
                   request_without_sample_has_no_drafts=bool((drafts[3] == -1).all()),
                   counters={k2: v for k2, v in spec.counters().items() if isinstance(v, int)})
        # fail closed: worker gone -> no drafts, no error
        proc.terminate()
        proc.wait(timeout=10)
        drafts2 = spec.propose(batch, None, None, None, aux, num_sampled, num_rejected, None, None, None, None)
        res["after_worker_stop_all_minus_one"] = bool((drafts2 == -1).all())
        _ = TorchDrafter
    finally:
        if proc.poll() is None:
            proc.kill()
    return res


if __name__ == "__main__":
    sys.exit(main())
