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
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vllm_overlay_util import (
    CFG,
    ORIG,
    REPO,
    SIM,
    STUBS,
    TRANSPORT_IMPL,
    _Mode,
    build_engram,
    load_vllm_engram,
    load_vllm_tables,
    ns,
    random_ids,
    small_config,
    start,
    synthetic_tables,
    timed,
    transport_impl,
    vllm_layout,
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-src", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="dsv41-qual-")))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=400_000, help="engram_vocab_size of the synthetic tables")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--bench-only", action="store_true", help="skip the exactness cases and the drafter seam")
    ap.add_argument(
        "--reuse-tables",
        action="store_true",
        help="keep the synthetic tables already under --work when they match (no 5 GB rewrite)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    from dsv41.engram.dequant import dequantize
    from dsv41.engram.layout import EngramLayout
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.synthetic import synthetic_rows
    from dsv41.overlay import contract as C, engram as E, settings as S

    res: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
    }
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
    srv, url = start(
        dsv41
        + [
            "engram",
            "serve",
            "--manifest",
            str(mpath),
            "--listen",
            "tcp://127.0.0.1:0",
            "--ready-file",
            str(args.work / "srv.ready"),
        ],
        args.work / "srv.ready",
        env,
    )
    res["engram_server"] = url
    try:
        res.update(
            run_checks(eng, layout, manifest, args, url, runtime, contract, E, S, dequantize, synthetic_rows, torch)
        )
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
    orig = (
        eng.ParallelEngramEmbedding._allocate_weights,
        eng.ParallelEngramEmbedding.lookup,
        eng.Engram._create_embedding,
    )
    ORIG["alloc"] = orig[0]
    for tp, rank in cases:
        SIM.update(tp=tp, rank=rank)
        # vLLM's own layers (unpatched classes), tables loaded by vLLM's weight loader
        (
            eng.ParallelEngramEmbedding._allocate_weights,
            eng.ParallelEngramEmbedding.lookup,
            eng.Engram._create_embedding,
        ) = orig
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
                mine[:, : he - a.head_start] = ids[:, a.head_start : he]
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
                case["sizes"].append(
                    {
                        "layer": lid,
                        "tokens": t,
                        "vllm_vs_overlay_bit_exact": same,
                        "overlay_vs_tables_dequantize_vllm": ref_ok,
                        "owned_rows": int(owned.sum()),
                    }
                )
        src = E._sources[next(iter(E._sources))][0]
        case["row_source_counters"] = {
            k: v
            for k, v in src.counters().items()
            if k in ("lookups", "rows", "remote_rows", "fallbacks", "transport_errors", "source")
        }
        per_case.append(case)
        del own, ovl
        torch.cuda.empty_cache()
    out["cases"] = per_case
    out["rows_compared"] = compared
    out["scale_bytes_seen"] = zeros255
    out["all_bit_exact"] = exact

    # the benchmark and the refusals run as TP2 rank 0: patch again with that rank's URL list
    (
        eng.ParallelEngramEmbedding._allocate_weights,
        eng.ParallelEngramEmbedding.lookup,
        eng.Engram._create_embedding,
    ) = orig
    eng._dsv41_overlay = False
    E._sources.clear()
    SIM.update(tp=2, rank=0)
    E.apply(eng, settings_for(2), contract)
    # refusals (model construction raises; nothing falls back silently)
    refusals = {}
    for label, mode, extra in (
        ("FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE", {}),
        ("FULL", "FULL", {}),
        ("specialized decode", "PIECEWISE", {"decode_backend": "latency_specialized"}),
    ):
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
        sets = [
            torch.from_numpy(random_ids(rng, t, layout, 0, a.n_hash_cols, a.vocab_start_idx, a.vocab_end_idx)).cuda()
            for _ in range(4)
        ]
        out_a = torch.empty((t, a.part_n_hash_cols, 256), dtype=torch.bfloat16, device="cuda")
        out_b = torch.empty_like(out_a)
        reps = args.reps if t < 1000 else max(5, args.reps // 3)
        rr = emb_o._dsv41
        for i in range(2):
            a.lookup(sets[i % 4], out_a)
            rr.lookup(sets[i % 4], out_b)
        tv = timed(lambda i, a=a, sets=sets, out=out_a: a.lookup(sets[i % 4], out), reps)
        # start + join: the worker's fetch, H2D and kernel, joined by the current stream
        to = timed(lambda i, rr=rr, sets=sets, out=out_b: rr.lookup(sets[i % 4], out), reps)
        results.append(
            {
                "case": label,
                "tokens": t,
                "rows": t * a.part_n_hash_cols,
                "vllm_uva_ms": round(tv * 1e3, 3),
                "overlay_ms": round(to * 1e3, 3),
                "overlay_over_vllm": round(to / tv, 2),
                **stages(emb_o, sets, a, reps, manifest, data, E, torch),
            }
        )
    return {
        "rank": "TP2 rank 0 (12 of 24 columns)",
        "table_rows_per_rank": a.part_num_embeddings,
        "vllm_pinned_table_bytes": a.weight.numel() + a.weight_scale_inv.numel(),
        "overlay_pinned_staging_bytes": emb_o._dsv41.host_bytes,
        "transport": "tcp (loopback)",
        "transport_impl": TRANSPORT_IMPL,
        "results": results,
    }


def stages(emb_o, sets, a, reps, manifest, data, E, torch) -> dict:
    """Where the overlay's time goes for the same ids: the row fetch alone (remote tcp, and the
    exact local reader), and the GPU stage alone (one H2D of selectors + rows, split, vLLM's kernel)."""
    from dsv41.engram.reader import LocalRowReader
    from dsv41.engram.rowsource import LocalRowSource

    rr = emb_o._dsv41
    plans = []
    for d in sets:
        ids = np.full((d.shape[0], rr.part), -1, np.int64)
        he = min(rr.head_start + rr.part, rr.n_hash_cols)
        ids[:, : he - rr.head_start] = d.cpu().numpy()[:, rr.head_start : he]
        plans.append(E.plan_rows(ids.reshape(-1), rr.vocab_start, rr.vocab_end))
    buf = np.empty((max(p[1].size for p in plans), E.ROW_BYTES), np.uint8)
    fetch_remote = timed(
        lambda i: rr.source.lookup(rr.layer_id, plans[i % 4][1], out=buf[: plans[i % 4][1].size]), reps
    )
    local = LocalRowSource(LocalRowReader(manifest, data))
    fetch_local = timed(lambda i: local.lookup(rr.layer_id, plans[i % 4][1]), reps)
    rows = plans[0][0].size
    n = plans[0][1].size
    nb = rows * 4 + n * E.ROW_BYTES
    out = torch.empty((sets[0].shape[0], rr.part, 256), dtype=torch.bfloat16, device="cuda")

    def gpu(i: int) -> None:
        dd = rr.d_buf[:nb]
        dd.copy_(rr.h_buf[:nb], non_blocking=True)
        rows_d = dd[rows * 4 :].view(n, E.ROW_BYTES)
        rr.d_w[:n].copy_(rows_d[:, :256])
        rr.d_s[:n].copy_(rows_d[:, 256:])
        rr.dequant(rr.d_w, rr.d_s, dd[: rows * 4].view(torch.int32), rr.d_dst, out, n, rows)

    gpu_stage = timed(gpu, reps)
    return {
        "fetch_tcp_ms": round(fetch_remote * 1e3, 3),
        "fetch_local_reader_ms": round(fetch_local * 1e3, 3),
        "h2d_split_kernel_ms": round(gpu_stage * 1e3, 3),
        "owned_rows": int(n),
    }


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
    from dsv41.drafter.factory import expected_identities
    from dsv41.drafter.model import TorchDrafter, random_drafter
    from dsv41.drafter.speculators import RemoteSpeculator
    from dsv41.overlay import drafter as D

    res: dict = {}
    try:
        base = importlib.import_module("vllm.v1.worker.gpu.spec_decode.speculator").BaseSpeculator
        res["base"] = "vllm BaseSpeculator"
    except Exception as exc:  # noqa: BLE001
        import abc

        class base(abc.ABC):  # noqa: N801, B024 - stand-in with the same abstract methods
            pass

        STUBS["vllm.v1.worker.gpu.spec_decode.speculator.BaseSpeculator"] = (
            f"import failed: {type(exc).__name__}: {str(exc)[:160]}"
        )
        res["base"] = "stand-in ABC"
    H, V, k = 64, 260, 5
    ddir = args.work / "drafter"
    random_drafter(ddir, vocab_size=V, hidden_size=H, seed=3)
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}:{os.environ.get('PYTHONPATH', '')}")
    dsv41 = [sys.executable, "-c", "import sys; from dsv41.cli import main; sys.exit(main())"]
    proc, url = start(
        dsv41
        + [
            "drafter",
            "serve",
            "--listen",
            "tcp://127.0.0.1:0",
            "--drafter",
            str(ddir),
            "--device",
            "cpu",
            "--ready-file",
            str(args.work / "drafter.ready"),
        ],
        args.work / "drafter.ready",
        env,
    )
    try:
        expected = expected_identities(str(ddir), "")
        remote = RemoteSpeculator(url, expected, k=k, timeout_ms=5000)
        cls = D.speculator_class(base)
        n_reqs, max_len = 6, 64
        tpg = ns(rank_in_group=0, world_size=1, broadcast=lambda t, src=0: t)
        rs = ns(
            total_len=ns(gpu=torch.tensor([10, 20, 30, 5, 7, 40], dtype=torch.int32, device="cuda")),
            all_token_ids=ns(gpu=torch.randint(0, V, (n_reqs, max_len), dtype=torch.int32, device="cuda")),
        )
        vcfg = ns(
            speculative_config=ns(
                num_speculative_tokens=k, draft_model_config=ns(hf_config=ns(dspark_target_layer_ids=[2, 3]))
            ),
            scheduler_config=ns(max_num_seqs=16),
        )
        spec = cls(vcfg, torch.device("cuda"), rs, tp_group=tpg, make_spec=lambda c: (remote, 3, 4))
        q = np.array([0, 3, 4, 9, 10, 11, 12])
        batch = ns(
            num_reqs=n_reqs,
            query_start_loc_np=q,
            idx_mapping=torch.arange(n_reqs, device="cuda"),
            req_ids=[f"r{i}" for i in range(n_reqs)],
        )
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
        res.update(
            drafts=drafts.cpu().tolist(),
            in_process=want.tolist(),
            identical=bool(np.array_equal(drafts.cpu().numpy(), want)),
            request_without_sample_has_no_drafts=bool((drafts[3] == -1).all()),
            counters={k2: v for k2, v in spec.counters().items() if isinstance(v, int)},
        )
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
