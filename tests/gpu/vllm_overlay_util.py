"""Helpers of the vLLM overlay GPU runs (tests/gpu/vllm_overlay_qualify.py and
vllm_overlay_step_bench.py, docs/gpu.md): vLLM's own Engram code loaded from the wheel's Python
source with the stand-ins it needs (listed in STUBS), the synthetic tables, the table server
subprocess, vLLM's table layout and loader, random ids and a CUDA-synchronised timer.
A helper module, not a run script: both scripts import it."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
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


CFG = ns(
    scheduler_config=ns(max_num_batched_tokens=32768, max_num_seqs=64),
    engram_config=ns(cpu_offload=True, dp_shared_memory=False, use_thp=False),
    compilation_config=ns(cudagraph_mode=_Mode("PIECEWISE")),
    additional_config={},
    lora_config=None,
)


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
        "vllm.compilation.breakable_cudagraph": {
            "eager_break_during_capture": lambda f: f,
            "is_breakable_cudagraph_enabled": lambda: True,
        },
        "vllm.config": {"VllmConfig": object, "get_current_vllm_config": lambda: CFG},
        "vllm.distributed": {
            "get_dp_group": lambda: None,
            "get_engram_dp_group": lambda: None,
            "get_engram_dp_size": lambda: 1,
            "get_tensor_model_parallel_rank": lambda: SIM["rank"],
            "get_tensor_model_parallel_world_size": lambda: SIM["tp"],
            "tensor_model_parallel_all_gather": lambda x, dim=-1: x,
        },
        "vllm.distributed.device_communicators.shm_broadcast": {
            "SHM_PATH": "/dev/shm",
            "check_shm_free_space": lambda *a, **k: None,
        },
        "vllm.distributed.parallel_state": {"GroupCoordinator": object, "in_the_same_node_as": lambda *a, **k: [True]},
        "vllm.forward_context": {"get_forward_context": lambda: None, "is_forward_context_available": lambda: False},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.model_executor.layers.fusion.quant_activation": {"QuantizedActivation": object},
        "vllm.model_executor.layers.linear": {"ColumnParallelLinear": StubLinear},
        "vllm.model_executor.layers.quantization": {"QuantizationConfig": object},
        "vllm.model_executor.layers.quantization.utils.quant_utils": {"kMxfp8Dynamic": None},
        "vllm.model_executor.utils": {
            "set_weight_attrs": lambda p, a: [setattr(p, k, v) for k, v in (a or {}).items()]
        },
        "vllm.models.deepseek_v41.common.ops.query_quant": {
            "can_fuse_query_quant": lambda *a: False,
            "mxfp8_scale_bytes": lambda *a: 0,
            "mxfp8_scale_offset": None,
        },
        "vllm.platforms": {
            "current_platform": ns(
                is_cuda=lambda: True,
                is_rocm=lambda: False,
                is_cuda_alike=lambda: True,
                is_xpu=lambda: False,
                is_device_capability_family=lambda *a: False,
            )
        },
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
            _stub_module(
                name,
                attrs,
                f"import failed under torch {torch.__version__}: {type(exc).__name__}: {str(exc)[:160]}",
                src,
            )
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
            STUBS[pkg] = f"package __init__ not run (engram.py itself is): {type(exc).__name__}: {str(exc)[:160]}"
    eng = importlib.import_module("vllm.models.deepseek_v41.common.engram")
    # Always replaced: vLLM's compiled extension and the process-group world.
    eng.get_accelerator_view_from_cpu_tensor = uva_view
    STUBS["engram.get_accelerator_view_from_cpu_tensor"] = (
        "vLLM compiled extension (torch.ops._C.get_cuda_view_from_cpu_tensor): CuPy alias of the same UVA address"
    )
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

    srv = subprocess.run(
        [sys.executable, "-c", "from dsv41.transport import native; print(native.implementation())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return {"client": native.implementation(), "server": srv.stdout.strip() or f"unknown ({srv.stderr[-200:]})"}


def small_config(vocab: int) -> dict:
    return {
        "engram_layer_ids": [1, 14],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": vocab,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 229,
        "vocab_size": 260,
    }


def vllm_layout(eng, layout):
    cfg = ns(
        engram_layer_ids=layout.layer_ids,
        engram_num_embeddings=layout.rows,
        engram_max_ngram_size=layout.max_ngram_size,
        engram_n_heads=layout.n_heads,
        engram_head_dim=layout.head_dim,
        engram_compressed_vocab_size=layout.compressed_vocab_size,
        engram_pad_token_id=layout.pad_token_id,
        engram_vocab_size=layout.vocab_sizes[0],
    )
    return eng.EngramLayout(cfg), cfg


def build_engram(eng, vl, li: int, model_cfg):
    import torch

    cfg = ns(hidden_size=64, hc_mult=4, rms_norm_eps=1e-6, **vars(model_cfg))
    with torch.device("cuda"):
        return eng.Engram(cfg, None, vl, li, False, f"model.layers.{vl.layer_ids[li]}.engram")


def load_vllm_tables(emb, manifest, data: Path, layer_id: int) -> None:
    """vLLM's own weight loader over the shard's tensors (what vLLM does at model load)."""
    import torch
    from safetensors import safe_open

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
                urls = (
                    doc.get("urls")
                    or doc.get("listen")
                    or [v for v in doc.values() if isinstance(v, str) and "://" in v]
                )
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


#: What ``sync_probe`` saw over a run: steps probed, synchronizes done, failures (messages).
SYNC_PROBE: dict = {"steps": 0, "syncs": 0, "failures": []}


def sync_probe(torch, where: str, ms: float = 5.0) -> None:
    """``torch.cuda.synchronize()`` from the launching thread right after a step returned, again
    and again for ``ms`` milliseconds: a run on the GPU failed when the worker
    thread captured a new size's launch graph while the benchmark synchronized after that size's
    first step. A failure is recorded in ``SYNC_PROBE`` (with ``where``), not raised: the run
    goes on and reports it (a failed synchronize also invalidates such a capture, counted in
    ``launch_graphs.failures``)."""
    SYNC_PROBE["steps"] += 1
    end = time.perf_counter() + ms * 1e-3
    while True:
        try:
            torch.cuda.synchronize()
        except RuntimeError as exc:
            SYNC_PROBE["failures"].append(f"{where}: {exc}")
            return
        SYNC_PROBE["syncs"] += 1
        if time.perf_counter() >= end:
            return


def warmup(torch, fw, hash_buf, sets, t: int, seconds: float, steps: int) -> dict:
    """Untimed interleaved rounds of every arm for ``seconds`` before the first timed decode round:
    in 80-round runs without it the first 15-25 s of decode steps ran at
    about 20 ms against 16.5 ms later, in every arm (24 tokens, the first size: step p10 16.2-16.6
    ms, median 19.3-19.9 ms), which pairing by round does not remove. Returns the steps run and
    the none arm's median step (ms) in the first and last tenth of them."""
    arms, none_ms, n, end = list(fw), [], 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for arm in arms:
            for _ in range(steps):
                hash_buf[:t].copy_(sets[n % len(sets)])
                n += 1
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fw[arm]()
                torch.cuda.synchronize()
                if arm == "none":
                    none_ms.append((time.perf_counter() - t0) * 1e3)
    d = max(1, len(none_ms) // 10)
    return {
        "s": seconds,
        "tokens": t,
        "steps": n,
        "none_step_ms_first_tenth": round(float(np.median(none_ms[:d])), 3) if none_ms else None,
        "none_step_ms_last_tenth": round(float(np.median(none_ms[-d:])), 3) if none_ms else None,
    }


def drafter_seam(torch) -> dict:
    """Per-step host cost of the drafter seam on rank 0 with an instant drafter: the hidden-state
    copy (``OverlaySpeculator._rank0_drafts``: rows + tails + counts to the host) and the
    drafts' broadcast (one-rank NCCL group: the collective's launch, no peer)."""
    import abc

    import torch.distributed as dist

    from dsv41.overlay import drafter as D

    res: dict = {}
    try:
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            dist.init_process_group("nccl", rank=0, world_size=1)
        tpg = ns(rank_in_group=0, world_size=1, broadcast=lambda t, src=0: dist.broadcast(t, src=src))
        res["broadcast"] = "torch.distributed NCCL, world_size 1"
    except Exception as exc:  # noqa: BLE001
        tpg = ns(rank_in_group=0, world_size=1, broadcast=lambda t, src=0: t)
        res["broadcast"] = f"none (NCCL group failed: {type(exc).__name__}: {str(exc)[:120]})"

    class Base(abc.ABC):  # noqa: B024 - stands in for vLLM's abstract base, whose methods the subclass defines
        pass

    class Instant:
        def propose(self, items):
            return [ns(tokens=[1, 2, 3, 4, 5]) for _ in items]

        def counters(self):
            return {}

    k, H, V, n_reqs, max_len = 5, 4096, 129280, 8, 4096
    cls = D.speculator_class(Base)
    rs = ns(
        total_len=ns(gpu=torch.randint(100, max_len, (n_reqs,), dtype=torch.int32, device="cuda")),
        all_token_ids=ns(gpu=torch.randint(0, V, (n_reqs, max_len), dtype=torch.int32, device="cuda")),
    )
    vcfg = ns(
        speculative_config=ns(
            num_speculative_tokens=k, draft_model_config=ns(hf_config=ns(dspark_target_layer_ids=[2, 3]))
        ),
        scheduler_config=ns(max_num_seqs=16),
    )
    spec = cls(vcfg, torch.device("cuda"), rs, tp_group=tpg, make_spec=lambda c: (Instant(), 3, 4))
    q = np.arange(0, 6 * (n_reqs + 1), 6)
    batch = ns(
        num_reqs=n_reqs,
        query_start_loc_np=q,
        idx_mapping=torch.arange(n_reqs, device="cuda"),
        req_ids=[f"r{i}" for i in range(n_reqs)],
    )
    T = int(q[-1])
    aux = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    ns_ = torch.full((n_reqs,), 6, device="cuda")
    nr = torch.zeros(n_reqs, dtype=torch.int64, device="cuda")
    for _ in range(5):
        spec.propose(batch, None, None, None, aux, ns_, nr, None, None, None, None)
    torch.cuda.synchronize()
    whole, bcast = [], []
    out = spec.draft_tokens[:n_reqs]
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        spec.propose(batch, None, None, None, aux, ns_, nr, None, None, None, None)
        t1 = time.perf_counter()
        tpg.broadcast(out, src=0)
        t2 = time.perf_counter()
        whole.append((t1 - t0) * 1e3)
        bcast.append((t2 - t1) * 1e3)
    torch.cuda.synchronize()
    if dist.is_initialized():  # torch warns at exit ("destroy_process_group() was not called") when left open
        dist.destroy_process_group()
    res.update(
        requests=n_reqs,
        k=k,
        hidden=H,
        propose_host_ms_median=round(float(np.median(whole)), 4),
        propose_host_ms_p90=round(float(np.percentile(np.asarray(whole), 90)), 4),
        broadcast_host_ms_median=round(float(np.median(bcast)), 4),
        note="propose = rank 0's hidden-state + tails copy to the host, the DraftInputs, an instant "
        "drafter, the drafts' H2D and broadcast; the broadcast alone timed apart",
    )
    return res


def time_join(rr) -> dict:
    """Wrap layer 1's ``RemoteRows.join`` (an instance attribute, one Python call more) so that the
    host time of its return and the generation it joined are kept (the
    launching thread's return after the hand-off, ``dsv41.harness.phases.join_return``)."""
    got = {"gen": 0, "ret": 0}
    orig = rr.join

    def join(*args):
        gen = rr._gen
        res = orig(*args)
        got["ret"] = time.monotonic_ns()
        got["gen"] = gen
        return res

    rr.join = join
    return got
