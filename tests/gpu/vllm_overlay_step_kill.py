"""The step benchmark's table-server kill cases (tests/gpu/vllm_overlay_step_bench.py, issue 23)
and the per-step helpers they share with it: ``step_ids`` (a step's ids), ``timed_exact_step``
(one timed overlay step compared bit for bit with vLLM's path), ``gj_counters`` (the GPU-side
join's counters). The kills: ``kill_server`` (decode steps, SIGKILL after step 10 of 40),
``prefill_after_kill`` (prefill chunks with the server dead: the C++ local fill) and
``kill_mid_prefill`` (the server restarted on its port, then SIGKILLed while a
GPU-joined prefill chunk's rows are being fetched); ``kill_ratios`` (the steps around the kill
against the other arms' medians). Split out of the benchmark to keep both files
under the repository's 600-line limit."""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time

import numpy as np

import vllm_overlay_util as Q
from vllm_overlay_step_util import Forward

#: Seconds a step of the mid-prefill kill may take before the run is taken for hung: the stacks of
#: every thread go to stderr and the process exits (a hang is a failure the run must show, not wait on).
HANG_S = 120.0
#: Seconds to wait, after the table server is restarted, for rows to come from it again.
RECONNECT_S = 60.0


def gj_counters(ovl) -> dict:
    """The GPU-side join's counters summed over the overlay's Engram layers: the
    launching thread's ``gpu_joins`` / ``gpu_join_redos`` and the C++ slot's ``gj_*``."""
    tot: dict = {}
    for o in ovl:
        rr = o.embed_tokens._dsv41
        if getattr(rr, "_gj", None) is None:
            continue
        for k in ("gpu_joins", "gpu_join_redos"):
            tot[k] = tot.get(k, 0) + rr.counters.get(k, 0)
        for k, v in rr._gj.counters().items():
            tot[k] = tot.get(k, 0) + v
    return tot


def prefill_after_kill(torch, own, ovl, hash_buf, layout, rng, layers, t: int, src) -> dict:
    """Three eager ``t``-token prefill steps through the overlay after the table server was
    killed: rows compared bit for bit with vLLM's path; step times; the GPU-side
    join's counters (with no connection its jobs are filled from the local rows in C++)."""
    f_o = Forward(torch, ovl, hash_buf, t, layers, {1: ovl[0], 14: ovl[1]}, graphs=False)
    f_u = Forward(torch, own, hash_buf, t, layers, {1: own[0], 14: own[1]}, graphs=False)
    g0 = gj_counters(ovl)
    c0 = {k: v for k, v in src.counters().items() if isinstance(v, (int, float))}
    ok, times = True, []
    for _ in range(3):
        ok &= timed_exact_step(torch, f_o, f_u, hash_buf, layout, rng, t, own, ovl, times)
    c1 = {k: v for k, v in src.counters().items() if isinstance(v, (int, float))}
    return {
        "steps": 3,
        "tokens": t,
        "rows_bit_exact": ok,
        "step_ms": [round(x, 3) for x in times],
        "gpu_join": {k: v - g0.get(k, 0) for k, v in gj_counters(ovl).items()},
        "counters": {k: c1[k] - c0.get(k, 0) for k in ("fallbacks", "transport_errors", "lookups")},
    }


def timed_exact_step(torch, f_o, f_u, hash_buf, layout, rng, t: int, own, ovl, times: list) -> bool:
    """One step on fresh ids: the overlay's forward ``f_o`` timed on the host (ms appended to
    ``times``), then vLLM's ``f_u``; True when every Engram layer's ``t`` staged rows are bit-identical."""
    hash_buf[:t].copy_(step_ids(torch, rng, t, layout, own))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f_o()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
    ro = [e.staged_rows[:t].clone() for e in ovl]
    f_u()
    torch.cuda.synchronize()
    return all(
        bool(torch.equal(x.view(torch.int16), e.staged_rows[:t].view(torch.int16)))
        for x, e in zip(ro, own, strict=False)
    )


def step_ids(torch, rng, t: int, layout, own):
    """int32 [t, n_layers, 24] on the GPU: each Engram layer's ids drawn around its own rank range."""
    per = [
        Q.random_ids(
            rng, t, layout, li, e.embed_tokens.n_hash_cols, e.embed_tokens.vocab_start_idx, e.embed_tokens.vocab_end_idx
        )
        for li, e in enumerate(own)
    ]
    return torch.from_numpy(np.stack(per, axis=1)).cuda()


#: Worker counters whose change over the kill's steps shows where a step's fallback time goes
#: (issue 47): the C++ core's local fill, Python's share, the probe.
KILL_WORKER_KEYS = (
    "jobs",
    "native_jobs",
    "native_local_jobs",
    "native_local_batches",
    "native_local_rows",
    "native_local_s",
    "native_fetch_s",
    "native_requests",
    "native_offers_adopted",
    "fetch_s",
    "host_s",
    "wake_s",
    "local_fills_after_failure",
    "lease_probes_offered",
    "native_idle_spins",
)


def python_local_read_ms(src, ovl, t: int, reps: int = 10) -> dict:
    """The fallback the core replaced (issue 47): the row source's Python local reader
    (``LocalRowReader.read``) for one decode step's owned rows of both Engram layers, as the worker
    called it on every step while the server was dead. Median and max ms over ``reps`` steps."""
    times = []
    rng = np.random.default_rng(5)
    for _ in range(reps):
        t0 = time.perf_counter()
        for o in ovl:
            rr = o.embed_tokens._dsv41
            ids = rng.integers(rr.vocab_start, rr.vocab_end, t * rr.part).astype(np.int64)
            src.local.lookup(rr.layer_id, ids)
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median": round(float(np.median(times)), 3),
        "max": round(max(times), 3),
        "reps": reps,
        "rows_per_layer": t * ovl[0].embed_tokens._dsv41.part,
    }


def kill_server(torch, srv, own, ovl, hash_buf, layout, a, rng, layers, capture, src) -> dict:
    """48-token decode steps through the overlay's PIECEWISE stand-in; the table server is
    SIGKILLed after step 10 of 40; every step's rows are compared with vLLM's path. The worker's
    counters over the steps after the kill (``worker_after_kill``, per job where a time) and the
    Python local reader's time for the same rows (``python_local_read_ms``) say where the time goes."""
    t = 48
    f_o = Forward(torch, ovl, hash_buf, t, layers, {1: ovl[0], 14: ovl[1]}, graphs=True)
    f_u = Forward(torch, own, hash_buf, t, layers, {1: own[0], 14: own[1]}, graphs=True)
    hash_buf[:t].copy_(step_ids(torch, rng, t, layout, own))
    f_o.capture(capture)
    f_u.capture(capture)
    c0 = {k: v for k, v in src.counters().items() if isinstance(v, (int, float))}
    rr = ovl[0].embed_tokens._dsv41
    ok, times, killed_at, w0 = True, [], None, {}
    for step in range(40):
        if step == 10:
            srv.send_signal(signal.SIGKILL)
            srv.wait(timeout=10)
            killed_at = step
        if step == 11:
            w0 = dict(rr._worker.counters)
        ok &= timed_exact_step(torch, f_o, f_u, hash_buf, layout, rng, t, own, ovl, times)
    w1 = dict(rr._worker.counters)
    c1 = {k: v for k, v in src.counters().items() if isinstance(v, (int, float))}
    dw = {k: w1.get(k, 0) - w0.get(k, 0) for k in KILL_WORKER_KEYS}
    jobs = max(1, dw["jobs"])
    worker = {k: (round(v * 1e3 / jobs, 4) if k.endswith("_s") else v) for k, v in dw.items()}
    return {
        "ok": ok,
        "killed_after_step": killed_at,
        "steps": 40,
        "rows_bit_exact": ok,
        "step_ms_before_kill_median": round(float(np.median(times[:10])), 3),
        "step_ms_kill_step": round(times[10], 3),
        "step_ms_after_median": round(float(np.median(times[11:])), 3),
        "step_ms_max": round(max(times), 3),
        "counters": {
            k: c1[k] - c0.get(k, 0)
            for k in ("fallbacks", "transport_errors", "remote_rows", "deadline_exceeded", "lookups")
        },
        "worker_refusals": rr.counters["worker_refusals"],
        "handoff_timeouts": rr.counters["handoff_timeouts"],
        "worker_after_kill": {"steps": 29, "note": "*_s keys: ms per job", **worker},
        "python_local_read_ms": python_local_read_ms(src, ovl, t),
    }


def kill_mid_prefill(
    torch, restart, own, ovl, hash_buf, layout, rng, layers, t: int, src, delays_ms=(3.0, 25.0, 60.0)
) -> dict:
    """A table server SIGKILLed while a GPU-joined ``t``-token prefill chunk is fetched.
    For each delay (ms after the step's start; the layer-1 fetch of a 32K chunk takes ~39 ms,
    layer 14's follows it): ``restart()`` starts the server again on its port (returns the
    ``Popen``), eager prefill steps run until rows come from it again (``remote_rows`` grows with
    no new local fill, at most ``RECONNECT_S``), then one step with a timer thread SIGKILLing the
    server ``delay`` ms after the overlay's forward starts. Each step's rows are compared bit for
    bit with vLLM's path; a step that takes over ``HANG_S`` dumps every thread's stack and exits.
    Returns ``{"ok", "cases": [{"delay_ms", "reconnect_s", "reconnect_steps", "killed_at_ms",
    "step_ms", "rows_bit_exact", "gpu_join", "counters"}]}``; ``ok`` when every case reconnected,
    was killed mid-step and gave exact rows."""
    f_o = Forward(torch, ovl, hash_buf, t, layers, {1: ovl[0], 14: ovl[1]}, graphs=False)
    f_u = Forward(torch, own, hash_buf, t, layers, {1: own[0], 14: own[1]}, graphs=False)
    keys = ("fallbacks", "transport_errors", "remote_rows", "lookups", "reconnects")

    def counts() -> dict:
        c = src.counters()
        return {k: c.get(k, 0) for k in keys}

    cases, ok = [], True
    for delay in delays_ms:
        srv = restart()
        t0, steps, reconnected, times = time.monotonic(), 0, False, []
        while time.monotonic() - t0 < RECONNECT_S:
            c0, g0 = counts(), gj_counters(ovl)
            ok &= timed_exact_step(torch, f_o, f_u, hash_buf, layout, rng, t, own, ovl, times)
            steps += 1
            c1, g1 = counts(), gj_counters(ovl)
            if c1["remote_rows"] > c0["remote_rows"] and g1.get("gj_fallback_jobs", 0) == g0.get("gj_fallback_jobs", 0):
                reconnected = True
                break
        case = {
            "delay_ms": delay,
            "reconnect_s": round(time.monotonic() - t0, 2),
            "reconnect_steps": steps,
            "reconnected": reconnected,
        }
        c0, g0 = counts(), gj_counters(ovl)
        killed = {}

        def kill(p=srv, box=killed):
            box["at"] = time.perf_counter()
            p.send_signal(signal.SIGKILL)

        timer, times = threading.Timer(delay / 1e3, kill), []
        faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
        step_t0 = time.perf_counter()
        timer.start()
        try:
            exact = timed_exact_step(torch, f_o, f_u, hash_buf, layout, rng, t, own, ovl, times)
        finally:
            faulthandler.cancel_dump_traceback_later()
            timer.join()
        srv.wait(timeout=10)
        c1, g1 = counts(), gj_counters(ovl)
        case.update(
            {
                "killed_at_ms": round((killed["at"] - step_t0) * 1e3, 2) if "at" in killed else None,
                "step_ms": round(times[0], 3),
                "rows_bit_exact": exact,
                "killed_during_step": "at" in killed and killed["at"] - step_t0 < times[0] / 1e3,
                "gpu_join": {k: v - g0.get(k, 0) for k, v in g1.items()},
                "counters": {k: c1[k] - c0[k] for k in keys},
            }
        )
        ok &= exact and reconnected and case["killed_during_step"]
        cases.append(case)
    return {"ok": bool(ok), "tokens": t, "cases": cases}


def kill_ratios(kill: dict, results: list, bound: float) -> dict:
    """Issue 47's done-when: the decode steps after the kill against the ``none`` arm's 48-token
    step, and the 32K chunks with the server dead against vLLM's own local rows (the ``uva`` arm's
    chunk: no table server at all), as ratios of medians; ``met`` when each is <= ``bound``."""
    med = {(r["tokens"], arm): r[arm]["step_ms_median"] for r in results for arm in ("none", "uva", "overlay")}
    got: dict = {"bound": bound}
    none48 = med.get((48, "none"))
    if none48:
        got["decode_after_over_none"] = round(kill["step_ms_after_median"] / none48, 3)
    pa = kill.get("prefill_after")
    if pa and (pa["tokens"], "uva") in med:
        got["prefill_dead_over_uva"] = round(float(np.median(pa["step_ms"])) / med[(pa["tokens"], "uva")], 3)
        got["prefill_dead_over_overlay"] = round(float(np.median(pa["step_ms"])) / med[(pa["tokens"], "overlay")], 3)
    got["met"] = all(got[k] <= bound for k in ("decode_after_over_none", "prefill_dead_over_uva") if k in got)
    return got
