#!/usr/bin/env python3
"""Step-level benchmark of remote Engram rows inside a stand-in of vLLM's DeepSeek-V4.1 step
(issue 23; docs/gpu.md "The step benchmark", results in docs/benchmarks.md).

vLLM's real ``Engram`` modules for layers 1 and 14 (from the wheel's Python source, as in
``vllm_overlay_qualify.py``, through ``vllm_overlay_util.py``) sit inside a stand-in forward shaped like
``DeepseekV4Model.forward``: the step's hash ids are copied into a static buffer, then
``prepare_embeddings`` for both Engram layers (-> ``_start_prefetch``, sharing one prefetch
stream as the model does), then ``--layers`` decoder layers of ``--decode-layer-ms`` /
``--prefill-layer-ms`` GPU time (chained bf16 matmuls, calibrated on the device); the Engram
layers call ``_ready_rows`` (-> ``_finish_prefetch``) and read every staged row before their
matmuls. Decode sizes run as PIECEWISE graphs: every decoder layer is a captured CUDA graph and
the Engram functions run eagerly between them, captured once through the same sequence as
vLLM's breakable capture (eager functions run between segments with the capture flag up, so
the overlay takes its capture-time path) and then replayed. The 32K prefill chunk runs eagerly.

Arms, interleaved round by round: ``uva`` (vLLM's own path, its pinned UVA table), ``overlay``
(the dsv41 overlay, rows from ``dsv41 engram serve`` on loopback), ``none`` (no Engram at all).
Per arm and size: medians and p10/p90 of the host step time (synchronize, step, synchronize)
and of the GPU time (events on the main stream), the main stream's stall at each Engram layer
(event before and after ``_finish_prefetch``), and the overlay's added time over ``uva``. Rows
are compared bit for bit against vLLM's path for every id set of every size, before and after
the timed rounds. Then the drafter seam's per-step host cost (rank 0's hidden-state copy and the
drafts' broadcast over a one-rank NCCL group) and, with ``--kill-server``, a table server killed
mid-run (exact local rows, no hang, the step times around the kill). For the prefill chunk
the C++ core's phase trace is on during the timed rounds and layer 0 runs
between two main-stream events: ``prefill_paired`` (``dsv41.harness.phases.paired``) checks
layer 1's bound step by step against that step's own fetch and layer 0 and takes its critical
path apart. ``--gpu-join 0|1`` sets ``DSV41_ENGRAM_GPU_JOIN`` for the overlay (a
GPU-joined prefill step's trace has ``gpu_join`` and no host join to take apart; each row's
``overlay_worker.gpu_join`` counts the jobs joined on the GPU, filled from the local rows in C++
and taken over by the watchdog), and with ``--kill-server`` three prefill chunks run after the
kill (``kill.prefill_after``: the C++ local fill, bit-exact against vLLM's path), then
the server restarted and killed in the middle of a GPU-joined chunk (``kill.mid_prefill``,
``vllm_overlay_step_kill.py``).

Default per-layer times: decode 1.0 ms (the issue's one decoder layer); prefill
``2 * (13e9 / 43) * 32768 / 2 / 790e12`` s = 12.5 ms: DeepSeek-V4-Flash's 13 B active parameters
over its 43 layers, two FLOPs per parameter and token, the 32,768-token chunk split over TP2,
at the 790 TFLOP/s bf16 rate measured on this workplace's H200 (/work/.library/device/KINDS.md);
attention is left out, so the real layer is longer and the fetch easier to hide.

    python3 tests/gpu/vllm_overlay_step_bench.py --vllm-src DIR --work DIR --out step.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from dsv41.harness import phases as P
from dsv41.harness.paired import decide, median_interval

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vllm_overlay_util as Q  # noqa: E402
from vllm_overlay_step_kill import gj_counters, kill_mid_prefill, kill_ratios, kill_server, prefill_after_kill, step_ids  # noqa: E402
from vllm_overlay_step_util import Forward, Layer, build_engrams, calibrate, check_rows, pct  # noqa: E402

ACTIVE_PARAMS = 13e9
MODEL_LAYERS = 43
BF16_TFLOPS = 790.0
PREFILL_TOKENS = 32768
PREFILL_LAYER_MS = 2 * (ACTIVE_PARAMS / MODEL_LAYERS) * PREFILL_TOKENS / 2 / (BF16_TFLOPS * 1e12) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-src", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=400_000)
    ap.add_argument("--reuse-tables", action="store_true")
    ap.add_argument("--layers", type=int, default=16, help="stand-in decoder layers (Engram at 1 and 14)")
    ap.add_argument("--decode-layer-ms", type=float, default=1.0)
    ap.add_argument("--prefill-layer-ms", type=float, default=round(PREFILL_LAYER_MS, 2))
    ap.add_argument("--tokens", default="24,48,96", help="decode sizes")
    ap.add_argument("--prefill", type=int, default=PREFILL_TOKENS, help="prefill chunk tokens (0: none)")
    ap.add_argument("--rounds", type=int, default=40, help="decode rounds (each: every arm, order rotated)")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per arm and round")
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=30.0,
        help="untimed interleaved decode rounds before the first timed one, seconds (0: none)",
    )
    ap.add_argument(
        "--target-ms",
        type=float,
        default=0.1,
        help="issue 23's decode target: overlay minus UVA, ms per step (both Engram layers)",
    )
    ap.add_argument("--prefill-rounds", type=int, default=8, help="prefill rounds (each: every arm, order rotated)")
    ap.add_argument("--prefill-steps", type=int, default=3)
    ap.add_argument("--kill-server", action="store_true", help="end with a table server killed mid-run")
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--target-dead-ratio",
        type=float,
        default=1.2,
        help="issue 47: steps with the table server dead over the local-only step, at most",
    )
    ap.add_argument(
        "--gpu-join",
        choices=("0", "1"),
        default=None,
        help="DSV41_ENGRAM_GPU_JOIN for the overlay (default: the environment's, else the setting's default)",
    )
    ap.add_argument(
        "--switch-interval-us",
        type=float,
        default=0.0,
        help="sys.setswitchinterval for this run (0: Python's default, 5 ms); the worker "
        "thread waits for the GIL while the launching thread runs Python",
    )
    args = ap.parse_args()
    if args.out.exists():  # two runs into one directory must not overwrite each other's results
        print(f"vllm_overlay_step_bench: {args.out} exists; give another --out", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.WARNING)
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    import torch
    import triton

    from dsv41.engram.layout import EngramLayout
    from dsv41.engram.manifest import load_manifest
    from dsv41.overlay import contract as C, engram as E, settings as S

    res: dict = {
        "tag": args.tag,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "vllm": "0.33.0 (wheel Python source)",
        "switch_interval_s": sys.getswitchinterval(),
    }
    try:
        import subprocess as sp

        res["driver"] = sp.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        res["driver"] = f"unknown ({exc})"
    eng = Q.load_vllm_engram(args.vllm_src)
    cfgd = Q.small_config(args.vocab)
    args.work.mkdir(parents=True, exist_ok=True)
    mpath, res["tables_write_s"], res["tables_reused"] = Q.synthetic_tables(cfgd, args.work, args.reuse_tables)
    manifest = load_manifest(mpath)
    layout = EngramLayout.from_config(cfgd)
    runtime = args.work / "runtime"
    runtime.mkdir(exist_ok=True)
    (runtime / "manifest.json").write_text(Path(mpath).read_text())
    (runtime / "overlay.json").write_text(json.dumps({"tables_dir": str(args.work / "tables")}))
    env = dict(os.environ, PYTHONPATH=f"{Q.REPO / 'python'}:{os.environ.get('PYTHONPATH', '')}")
    res["transport_impl"] = Q.transport_impl(env)
    dsv41 = [sys.executable, "-c", "import sys; from dsv41.cli import main; sys.exit(main())"]
    ready = args.work / f"step-srv{os.getpid()}.ready"
    srv, url = Q.start(
        dsv41
        + ["engram", "serve", "--manifest", str(mpath), "--listen", "tcp://127.0.0.1:0", "--ready-file", str(ready)],
        ready,
        env,
    )
    res["engram_server"] = url
    servers = [srv]

    def restart():
        """The table server again on the first one's port (the overlay's URL): its ``Popen``."""
        from dsv41.transport import parse_url

        again = args.work / f"step-srv{os.getpid()}-{len(servers)}.ready"
        proc, _ = Q.start(
            dsv41
            + [
                "engram",
                "serve",
                "--manifest",
                str(mpath),
                "--listen",
                f"tcp://127.0.0.1:{parse_url(url).port}",
                "--ready-file",
                str(again),
            ],
            again,
            env,
        )
        servers.append(proc)
        return proc

    try:
        res.update(run(args, eng, layout, manifest, url, runtime, srv, restart, torch, E, S, C))
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        import traceback

        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-3000:]
    finally:
        for p in servers:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
    res["sync_probe"] = Q.SYNC_PROBE  # synchronizes right after each size's first steps
    res["stubs"] = Q.STUBS
    args.out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k not in ("stubs", "traceback")}, indent=1, default=str))
    if "traceback" in res:
        print(res["traceback"], file=sys.stderr)
    ok = (
        "error" not in res
        and res.get("all_bit_exact")
        and res.get("kill", {}).get("ok", True)
        and not Q.SYNC_PROBE["failures"]
    )
    return 0 if ok else 1


def run(args, eng, layout, manifest, url, runtime, srv, restart, torch, E, S, C) -> dict:
    from dsv41.overlay import engram_ops as O

    out: dict = {}
    vl, mcfg = Q.vllm_layout(eng, layout)
    data = args.work / "tables"
    Q.SIM.update(tp=2, rank=0)
    main_stream = torch.cuda.Stream()
    torch.cuda.set_stream(main_stream)  # graphs cannot be captured on the legacy stream
    orig = (
        eng.ParallelEngramEmbedding._allocate_weights,
        eng.ParallelEngramEmbedding.lookup,
        eng.Engram._create_embedding,
    )
    Q.ORIG["alloc"] = orig[0]
    own = build_engrams(eng, vl, mcfg, torch, torch.cuda.Stream())
    for li, lid in enumerate(layout.layer_ids):
        Q.load_vllm_tables(own[li].embed_tokens, manifest, data, lid)
    E._sources.clear()
    senv = {"DSV41_ENGRAM_REMOTE": ",".join([url] * 2), "DSV41_RUNTIME_ROOT": str(runtime)}
    gj = args.gpu_join if args.gpu_join is not None else os.environ.get("DSV41_ENGRAM_GPU_JOIN")
    if gj is not None:
        senv["DSV41_ENGRAM_GPU_JOIN"] = gj
    settings = S.parse(senv)
    out["gpu_join_setting"] = settings.gpu_join
    E.apply(eng, settings, C.load())
    capture = {"on": False}
    O._capture_active = lambda: capture["on"]  # what apply() binds to vLLM's BreakableCUDAGraphCapture
    ovl = build_engrams(eng, vl, mcfg, torch, torch.cuda.Stream())
    assert all(o.embed_tokens._dsv41 is not None for o in ovl), "the overlay did not take the tables"
    join_ns = Q.time_join(ovl[0].embed_tokens._dsv41)
    src = E._sources[next(iter(E._sources))][0]
    a = own[0].embed_tokens
    out["rank"] = "TP2 rank 0 (12 of 24 columns)"
    out["stand_in"] = {
        "layers": args.layers,
        "engram_layers": {"1": 1, "14": 14},
        "model_layers": MODEL_LAYERS,
        "prefill_layer_ms_formula": "2 * (13e9/43) * 32768 / 2 / 790e12 s",
    }
    n_dec, one_mm = calibrate(torch, args.decode_layer_ms)
    n_pre, _ = calibrate(torch, args.prefill_layer_ms)
    out["matmul_ms"] = round(one_mm, 4)
    out["matmuls_per_layer"] = {"decode": n_dec, "prefill": n_pre}
    dec_layers = [Layer(torch, n_dec) for _ in range(args.layers)]
    pre_layers = [Layer(torch, n_pre) for _ in range(args.layers)]
    rng = np.random.default_rng(99)
    n_layers = len(layout.layer_ids)
    sizes = [int(x) for x in args.tokens.split(",") if x] + ([args.prefill] if args.prefill else [])
    tmax = max(sizes)
    hash_buf = torch.empty((tmax, n_layers, a.n_hash_cols), dtype=torch.int32, device="cuda")
    results, exact = [], True
    c0 = {k: v for k, v in src.counters().items() if isinstance(v, (int, float))}
    for t in sizes:
        prefill = t >= 1024
        nsets = 3 if prefill else 6
        sets = [step_ids(torch, rng, t, layout, own) for _ in range(nsets)]
        layers = pre_layers if prefill else dec_layers
        fw = {}
        for arm, engs in (("uva", own), ("overlay", ovl), ("none", [])):
            at = {1: engs[0], 14: engs[1]} if engs else {}
            fw[arm] = Forward(torch, engs, hash_buf, t, layers, at, graphs=not prefill)
            hash_buf[:t].copy_(sets[0])
            if prefill:
                for i in range(2):
                    fw[arm]()
                    Q.sync_probe(torch, f"T={t} {arm} step {i}")
            else:
                fw[arm].capture(capture)
                for i in range(2):  # the overlay captures a size's launch graph at its next start
                    fw[arm]()
                    Q.sync_probe(torch, f"T={t} {arm} replay {i}")
        if not prefill and "warmup" not in out:
            out["warmup"] = Q.warmup(torch, fw, hash_buf, sets, t, args.warmup_s, args.steps)
        started = time.strftime("%H:%M:%S UTC", time.gmtime())
        ex = check_rows(torch, fw, sets, hash_buf, t, own, ovl)
        exact &= ex["bit_exact"]
        times = {arm: [] for arm in fw}
        gpu = {arm: [] for arm in fw}
        stalls = {arm: {1: [], 14: []} for arm in fw}
        rounds, steps = (args.prefill_rounds, args.prefill_steps) if prefill else (args.rounds, args.steps)
        arms = list(fw)
        wait0 = sum(o.embed_tokens._dsv41.counters["handoff_wait_s"] for o in ovl)
        wk0 = dict(ovl[0].embed_tokens._dsv41._worker.counters) if ovl[0].embed_tokens._dsv41._worker else {}
        g0 = [dict(o.embed_tokens._dsv41.graphs.counters) for o in ovl]
        p0 = [dict(o.embed_tokens._dsv41.pieces.counters) for o in ovl]
        gj0 = gj_counters(ovl)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        core = ovl[0].embed_tokens._dsv41._worker.core if ovl[0].embed_tokens._dsv41._worker else None
        tracing = bool(prefill and core is not None and hasattr(core, "set_trace"))
        keys = [o.embed_tokens._dsv41._slot.key for o in ovl] if tracing else []
        phases, l0_ms, fetch14, bad_traces = [], {arm: [] for arm in fw}, [], []
        if tracing:  # layer 1's phases per timed overlay step
            core.set_trace(True)
            core.take_traces()
        k = 0
        for r in range(rounds):
            order = arms[r % 3 :] + arms[: r % 3]
            for arm in order:
                f = fw[arm]
                for s in range(steps + 1):
                    hash_buf[:t].copy_(sets[k % nsets])
                    k += 1
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    h0 = time.monotonic_ns()
                    e0.record()
                    f()
                    e1.record()
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    got = core.take_traces() if tracing and arm == "overlay" else []
                    if s == 0:
                        continue  # the first step after switching arms warms caches
                    times[arm].append(dt * 1e3)
                    gpu[arm].append(e0.elapsed_time(e1))
                    for li in f.stall:
                        stalls[arm][li].append(f.stall[li][0].elapsed_time(f.stall[li][1]))
                    if prefill:
                        l0_ms[arm].append(f.l0[0].elapsed_time(f.l0[1]))
                    t1 = [g for g in got if g["key"] == keys[0]] if got else []
                    if t1:
                        gms = {
                            "l0_start": e0.elapsed_time(f.l0[0]),
                            "l0_end": e0.elapsed_time(f.l0[1]),
                            "a": e0.elapsed_time(f.stall[1][0]),
                            "b": e0.elapsed_time(f.stall[1][1]),
                        }
                        try:
                            ph = P.layer1_phases(t1[-1], h0, gms, args.prefill_layer_ms)
                        except Exception as exc:  # noqa: BLE001 - a bad trace is counted, not fatal
                            bad_traces.append(str(exc))
                            continue
                        ph["join_wake"] = (f.host_ns["join1_1"] - t1[-1]["t_done"]) * 1e-6
                        wt = ovl[0].embed_tokens._dsv41._slot.native.wait_times()
                        if t1[-1].get("gpu_join"):  # GPU-side join: no host join; tail = last flag stored to b
                            ph["gpu_join"] = 1.0
                            ph["join_host"] = (f.host_ns["join1_1"] - f.host_ns["join0_1"]) * 1e-6
                        elif wt[0] == t1[-1]["gen"] and join_ns["gen"] == wt[0]:  # this step's join
                            try:
                                ph.update(
                                    P.join_return(
                                        t1[-1]["t_done"], wt, join_ns["ret"], f.host_ns["join1_1"], h0 + gms["b"] * 1e6
                                    )
                                )
                            except Exception as exc:  # noqa: BLE001 - counted with the bad traces
                                bad_traces.append(str(exc))
                                continue
                        else:
                            bad_traces.append(
                                f"join return: wait of gen {wt[0]}, join of {join_ns['gen']}, trace of {t1[-1]['gen']}"
                            )
                            continue
                        ph["prepare_host"] = (f.host_ns["prepare1"] - f.host_ns["prepare0"]) * 1e-6
                        phases.append(ph)
                        fetch14 += [P.trace_fetch_ns(g) * 1e-6 for g in got if g["key"] == keys[1]]
        if tracing:
            core.set_trace(False)
        wait1 = sum(o.embed_tokens._dsv41.counters["handoff_wait_s"] for o in ovl)
        ex2 = check_rows(torch, fw, sets, hash_buf, t, own, ovl)
        exact &= ex2["bit_exact"]
        rr = ovl[0].embed_tokens._dsv41
        w = rr._worker.counters if rr._worker else {}
        row = {
            "case": "prefill" if prefill else "decode",
            "tokens": t,
            "started": started,
            "rows_per_layer": t * a.part_n_hash_cols,
            "steps_per_arm": len(times["uva"]),
            "layer_ms_target": args.prefill_layer_ms if prefill else args.decode_layer_ms,
            "graphs": "none (eager)" if prefill else "PIECEWISE stand-in",
            "rows_bit_exact_before_after": [ex["bit_exact"], ex2["bit_exact"]],
            "rows_compared": ex["rows"] + ex2["rows"],
        }
        for arm in arms:
            row[arm] = {
                "step_ms_median": round(float(np.median(times[arm])), 3),
                "step_ms_p10": round(pct(times[arm], 10), 3),
                "step_ms_p90": round(pct(times[arm], 90), 3),
                "gpu_ms_median": round(float(np.median(gpu[arm])), 3),
            }
            if arm != "none":
                row[arm]["stall_ms_median"] = {str(li): round(float(np.median(v)), 3) for li, v in stalls[arm].items()}
        med = {arm: np.median(times[arm]) for arm in arms}
        row["overlay_minus_uva_ms"] = round(float(med["overlay"] - med["uva"]), 3)
        row["uva_minus_none_ms"] = round(float(med["uva"] - med["none"]), 3)
        row["overlay_minus_none_ms"] = round(float(med["overlay"] - med["none"]), 3)
        # paired per-round differences: a spread for the added time
        per_round = []
        for r in range(rounds):
            sl = slice(r * steps, (r + 1) * steps)
            per_round.append(float(np.median(times["overlay"][sl]) - np.median(times["uva"][sl])))
        row["overlay_minus_uva_per_round_ms"] = [round(x, 3) for x in per_round]
        # the decision: median of the paired per-round differences and its 95 % interval
        paired = median_interval(per_round)
        row["overlay_minus_uva_paired"] = {
            "median_ms": round(paired["median"], 4),
            "rounds": paired["n"],
            "order_ci95_ms": [round(v, 4) for v in paired["order_ci"]] if paired["order_ci"] else None,
            "bootstrap_ci95_ms": [round(v, 4) for v in paired["bootstrap_ci"]] if paired["bootstrap_ci"] else None,
            "target_ms": args.target_ms,
            "decision": decide(paired, args.target_ms),
        }
        jobs = max(1, w.get("jobs", 0) - wk0.get("jobs", 0))
        row["overlay_worker"] = {
            "jobs": w.get("jobs", 0) - wk0.get("jobs", 0),
            "requests": w.get("requests", 0) - wk0.get("requests", 0),
            "multi_layer_requests": w.get("multi_layer_requests", 0) - wk0.get("multi_layer_requests", 0),
            "fetch_ms_per_request": round(
                (w.get("fetch_s", 0) - wk0.get("fetch_s", 0))
                * 1e3
                / max(1, w.get("requests", 0) - wk0.get("requests", 0)),
                3,
            ),
            "host_ms_per_job": round((w.get("host_s", 0) - wk0.get("host_s", 0)) * 1e3 / jobs, 3),
            "fetch_ms_per_job": round((w.get("fetch_s", 0) - wk0.get("fetch_s", 0)) * 1e3 / jobs, 3),
            "wake_ms_per_job": round((w.get("wake_s", 0) - wk0.get("wake_s", 0)) * 1e3 / jobs, 3),
            "coalesce_waits": w.get("coalesce_waits", 0) - wk0.get("coalesce_waits", 0),
            # the C++ core's share: jobs it served, its own graph launches and
            # requests (a job it hands back to Python is counted on Python's side)
            **{k: w.get(k, 0) - wk0.get(k, 0) for k in ("native_jobs", "native_launches", "native_requests")},
            **{
                f"{k}_ms_per_job": round((w.get(f"{k}_s", 0) - wk0.get(f"{k}_s", 0)) * 1e3 / jobs, 4)
                for k in ("ids_wait", "coalesce", "plan", "launch")
            },
            # a multi-piece job's plan of pieces 1.. on the core's planner thread, during the
            # requests (not host work of the worker thread; `plan` is what that thread waited)
            "plan_ahead_ms_per_job": round(
                (w.get("native_plan_ahead_s", 0) - wk0.get("native_plan_ahead_s", 0)) * 1e3 / jobs, 4
            ),
            # host work outside plan and launch: the batch's Python hops, hand-offs, GIL re-takes
            "other_host_ms_per_job": round(
                (
                    w.get("host_s", 0)
                    - wk0.get("host_s", 0)
                    - w.get("plan_s", 0)
                    + wk0.get("plan_s", 0)
                    - w.get("launch_s", 0)
                    + wk0.get("launch_s", 0)
                )
                * 1e3
                / jobs,
                4,
            ),
            "launching_thread_wait_ms_per_step": round(  # both layers' hand-off waits (timed + warm steps)
                (wait1 - wait0) * 1e3 / max(1, len(times["overlay"]) + rounds), 3
            ),
            "inline_lookups": rr.counters["inline_lookups"],
            "worker_refusals": rr.counters["worker_refusals"],
            "handoff_timeouts": rr.counters["handoff_timeouts"],
            # joins of layer 1 that polled once a job's last request was out, whole run so far
            "join_tail_polls_layer1": rr.overlay_counters().get(f"layer{rr.layer_id}_join_tail_polls"),
            # the launch graphs of both layers in the timed rounds (replays = graph launches)
            "launch_graphs": {
                k: round(sum(o.embed_tokens._dsv41.graphs.counters[k] - g[k] for o, g in zip(ovl, g0, strict=False)), 4)
                for k in ("replays", "captures", "failures", "capture_s")
            },
            # a multi-piece job's piece graphs: captured by Python after the first
            # chunk of a size (warm-up), launched by the C++ core (native_launches), so replays stay 0
            "piece_graphs": {
                k: round(sum(o.embed_tokens._dsv41.pieces.counters[k] - g[k] for o, g in zip(ovl, p0, strict=False)), 4)
                for k in ("captures", "failures", "capture_s")
            },
            "piece_graphs_held": sum(len(o.embed_tokens._dsv41.pieces._graphs) for o in ovl),
            # the GPU-side join, both layers, timed rounds and the checks after them:
            # jobs joined on the GPU, filled from the local rows in C++, taken over by the watchdog
            "gpu_join": {k: v - gj0.get(k, 0) for k, v in gj_counters(ovl).items()},
        }
        if prefill:
            fetch = row["overlay_worker"]["fetch_ms_per_job"]  # a job = one layer's pieces
            row["prefill_check"] = {
                "layer14_stall_ms": row["overlay"]["stall_ms_median"]["14"],
                "layer1_stall_ms": row["overlay"]["stall_ms_median"]["1"],
                "fetch_ms_per_layer": fetch,
                "layer0_ms": args.prefill_layer_ms,
                "layer1_bound_ms": round(fetch - args.prefill_layer_ms, 3),
                "layer1_within_bound": row["overlay"]["stall_ms_median"]["1"] <= fetch - args.prefill_layer_ms,
                "exposed_total_ms": row["overlay_minus_none_ms"],
            }
            row["layer0_ms_measured_median"] = {arm: round(float(np.median(v)), 3) for arm, v in l0_ms.items() if v}
            if phases:
                row["prefill_paired"] = P.paired(phases, fetch14)
            row["phase_traces_refused"] = bad_traces[:5] + (
                [f"... {len(bad_traces)} in all"] if len(bad_traces) > 5 else []
            )
        results.append(row)
        print(json.dumps(row), flush=True)
        del fw
    c1 = {k: v for k, v in src.counters().items() if isinstance(v, (int, float))}
    out["row_source_counters"] = {
        k: c1[k] - c0.get(k, 0)
        for k in (
            "lookups",
            "rows",
            "remote_rows",
            "fallbacks",
            "transport_errors",
            "deadline_exceeded",
            "refusals",
            "reconnects",
        )
    }
    out["results"] = results
    out["all_bit_exact"] = exact
    out["drafter_seam"] = Q.drafter_seam(torch)
    if args.kill_server:
        out["kill"] = kill_server(torch, srv, own, ovl, hash_buf, layout, a, rng, dec_layers, capture, src)
        if args.prefill:  # prefill chunks with the server dead (the GPU-side join's local fill)
            out["kill"]["prefill_after"] = prefill_after_kill(
                torch, own, ovl, hash_buf, layout, rng, pre_layers, args.prefill, src
            )
            out["kill"]["ok"] = out["kill"]["ok"] and out["kill"]["prefill_after"]["rows_bit_exact"]
            # the server back on its port, then killed while a GPU-joined chunk is fetched
            out["kill"]["mid_prefill"] = kill_mid_prefill(
                torch, restart, own, ovl, hash_buf, layout, rng, pre_layers, args.prefill, src
            )
            out["kill"]["ok"] = out["kill"]["ok"] and out["kill"]["mid_prefill"]["ok"]
        out["kill"]["vs_local"] = kill_ratios(out["kill"], results, args.target_dead_ratio)
    return out


if __name__ == "__main__":
    sys.exit(main())
