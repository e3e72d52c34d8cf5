"""Layer 1's exposed time in a prefill step, taken apart phase by phase (from the
step benchmark, ``tests/gpu/vllm_overlay_step_bench.py``).

Inputs per step: the C++ core's trace of layer 1's multi-piece job (``EngramCore.take_traces``,
CLOCK_MONOTONIC ns), the host time at which the step's first main-stream event ran (the GPU was
idle, so it runs at once) and main-stream events (ms after that first event): layer 0's start
and end, and the events around layer 1's ``_finish_prefetch`` (``a``: after layer 0 on the main
stream, ``b``: after the wait on layer 1's done event). GPU times are put on the host clock as
``host_t0_ns + ms * 1e6``; the first event runs some microseconds after ``host_t0_ns``, so GPU
instants land that much early (the phases before the fetch look that much longer, the tail that
much shorter; their sum is unchanged).

With ``L0s`` = layer 0's start and ``B`` = event ``b`` on the host clock, layer 1's exposed time
(``stall`` = ``b - a``) less its bound (``fetch - layer0``) is, when ``a`` follows layer 0 at
once, ``B - L0s - fetch``: the time on layer 1's critical path that is not its fetch. It is the
sum of

- ``to_first_fetch``: layer 0's start to the first request (the launching thread's start of
  layer 1, the worker's wake-up, the ids wait, piece 0's plan), split into ``submit_after_l0``,
  ``wake``, ``ids_wait``, ``plan0`` and ``plan0_to_fetch``;
- ``launches``: the piece graph launches between requests (pieces 0..n-2);
- ``plan_waits``: waits for a piece's plan between its predecessor's launch and its request,
  and (piece 0 requested as a head and a rest) between the head's reply and
  the rest's request;
- ``last_launch``: after the last reply, its graph launch, the done event and the hand-off;
- ``tail``: the hand-off to ``b`` (the last piece's H2D copy and kernel, the launching
  thread's wake-up in ``join`` and the main stream's wait on the done event);

less ``a - layer0_end`` (0 when ``a`` follows layer 0 at once). ``fetch`` is the sum of the
pieces' request times (pipelined requests: their fill and drain included).

Where the core sends a job's requests as one pipelined stream across its pieces
(``stream`` traces: a piece's requests go out before the previous piece's graph is launched, so
the pieces' request spans overlap): ``fetch`` is then the connection's busy time, ``t_fetch1 -
t_fetch0 - idle`` (first request sent to last reply, less the gaps with nothing in flight);
``launches`` is 0 (the graph launches overlap requests in flight; their sum is
``launches_overlapped``, not on the path); ``plan_waits`` is ``idle`` (nothing in flight: a
segment's plan awaited); ``last_launch`` runs from the last reply to the hand-off.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsv41.errors import Dsv41Error
from dsv41.harness.paired import decide, median_interval

#: Phase names of ``layer1_phases`` in the order they lie on layer 1's critical path.
PHASES = (
    "submit_after_l0",
    "wake",
    "ids_wait",
    "plan0",
    "plan0_to_fetch",
    "launches",
    "plan_waits",
    "last_launch",
    "tail",
)


def layer1_phases(trace: dict, host_t0_ns: int, gpu_ms: dict, layer0_target_ms: float) -> dict:
    """One step's phases of layer 1's job (ms, see the module).

    ``trace``: one ``EngramCore.take_traces()`` entry (ints, ns: ``t_sub``, ``t_deq``,
    ``t_ids``, ``t_plan0``, ``t_done``; lists ``fetch0``, ``fetch1``, ``launch1`` of one entry per
    piece, 0 for a piece with no request; optional ``t_head1`` / ``t_rest0``, nonzero when piece 0
    was requested as a head and a rest: the head's end and the rest's start); ``host_t0_ns``: ``time.monotonic_ns()`` just before
    the step's first main-stream event; ``gpu_ms``: float ms after that event of ``l0_start``,
    ``l0_end``, ``a`` and ``b``; ``layer0_target_ms``: the stand-in's per-layer time.

    Returns the ``PHASES`` (ms) plus ``fetch`` (sum of the request times), ``layer0`` (measured,
    ``l0_end - l0_start``), ``stall`` (``b - a``), ``excess`` (``stall - (fetch - layer0)``),
    ``excess_target`` (the same with ``layer0_target_ms``), ``critical`` (``B - L0s - fetch``)
    and ``a_after_l0`` (``a - l0_end``), all float ms. Raises Dsv41Error for a trace whose
    lists differ in length, with no piece, or with a timestamp missing (0) or out of order.
    """
    if trace.get("stream"):
        return _stream_phases(trace, host_t0_ns, gpu_ms, layer0_target_ms)
    f0, f1, l1 = (list(trace[k]) for k in ("fetch0", "fetch1", "launch1"))
    n = len(f0)
    if n == 0 or len(f1) != n or len(l1) != n:
        raise Dsv41Error(f"phase trace: {len(f0)}/{len(f1)}/{len(l1)} piece entries")
    ts = [trace[k] for k in ("t_sub", "t_deq", "t_ids", "t_plan0", "t_done")]
    if min(ts) <= 0 or min(l1) <= 0:
        raise Dsv41Error("phase trace: a timestamp is missing")
    t_sub, t_deq, t_ids, t_plan0, t_done = ts
    # a piece without a request (no owned id) has fetch0 = fetch1 = 0: it starts where the
    # previous piece's launch (or piece 0's plan) ended and takes no fetch time
    prev_end = t_plan0
    fs, fe = [], []
    for k in range(n):
        a0, a1 = (f0[k], f1[k]) if f0[k] else (prev_end, prev_end)
        fs.append(a0)
        fe.append(a1)
        prev_end = l1[k]
    h1, r0 = int(trace.get("t_head1", 0) or 0), int(trace.get("t_rest0", 0) or 0)
    if bool(h1) != bool(r0):
        raise Dsv41Error("phase trace: a head's end without the rest's start, or the reverse")
    split = (h1 - fs[0], r0 - h1) if h1 else (0, 0)  # piece 0: head fetch, wait before the rest
    seq = [t_sub, t_deq, t_ids, t_plan0]
    for k in range(n):
        seq += [fs[k]] + ([h1, r0] if k == 0 and h1 else []) + [fe[k], l1[k]]
    if any(b < a for a, b in zip(seq, seq[1:], strict=False)) or t_done < l1[-1]:
        raise Dsv41Error("phase trace: timestamps out of order")
    ms = 1e-6
    l0s = host_t0_ns + gpu_ms["l0_start"] * 1e6
    b_ns = host_t0_ns + gpu_ms["b"] * 1e6
    fetch = (sum(fe[k] - fs[k] for k in range(n)) - split[1]) * ms
    layer0 = gpu_ms["l0_end"] - gpu_ms["l0_start"]
    stall = gpu_ms["b"] - gpu_ms["a"]
    out = {
        "submit_after_l0": (t_sub - l0s) * ms,
        "wake": (t_deq - t_sub) * ms,
        "ids_wait": (t_ids - t_deq) * ms,
        "plan0": (t_plan0 - t_ids) * ms,
        "plan0_to_fetch": (fs[0] - t_plan0) * ms,
        "launches": sum(l1[k] - fe[k] for k in range(n - 1)) * ms,
        "plan_waits": (sum(fs[k] - l1[k - 1] for k in range(1, n)) + split[1]) * ms,
        "last_launch": (t_done - fe[-1]) * ms,
        "tail": (b_ns - t_done) * ms,
        "fetch": fetch,
        "layer0": layer0,
        "stall": stall,
        "excess": stall - (fetch - layer0),
        "excess_target": stall - (fetch - layer0_target_ms),
        "critical": (b_ns - l0s) * ms - fetch,
        "a_after_l0": gpu_ms["a"] - gpu_ms["l0_end"],
    }
    return {k: float(v) for k, v in out.items()}


def _stream_phases(trace: dict, host_t0_ns: int, gpu_ms: dict, layer0_target_ms: float) -> dict:
    """``layer1_phases`` of a ``stream`` trace (see the module): ``t_fetch0``, ``t_fetch1``,
    ``idle`` (ns) besides the common fields; per piece ``launch1`` (its launch's end) and, for
    ``launches_overlapped``, ``fetch1`` (its last reply). Raises Dsv41Error as ``layer1_phases``."""
    f1, l1 = list(trace["fetch1"]), list(trace["launch1"])
    n = len(l1)
    if n == 0 or len(f1) != n or len(trace["fetch0"]) != n:
        raise Dsv41Error(f"phase trace: {len(trace['fetch0'])}/{len(f1)}/{n} piece entries")
    ts = [trace[k] for k in ("t_sub", "t_deq", "t_ids", "t_plan0", "t_fetch0", "t_fetch1", "t_done")]
    if min(ts) <= 0 or min(l1) <= 0:
        raise Dsv41Error("phase trace: a timestamp is missing")
    t_sub, t_deq, t_ids, t_plan0, t_fetch0, t_fetch1, t_done = ts
    idle = int(trace.get("idle", 0))
    if (
        any(b < a for a, b in zip(ts, ts[1:], strict=False))
        or idle < 0
        or idle > t_fetch1 - t_fetch0
        or max(l1) > t_done
    ):
        raise Dsv41Error("phase trace: timestamps out of order")
    ms = 1e-6
    l0s = host_t0_ns + gpu_ms["l0_start"] * 1e6
    b_ns = host_t0_ns + gpu_ms["b"] * 1e6
    fetch = (t_fetch1 - t_fetch0 - idle) * ms
    layer0 = gpu_ms["l0_end"] - gpu_ms["l0_start"]
    stall = gpu_ms["b"] - gpu_ms["a"]
    # a piece's launch: from its last reply (or, with no request, the previous launch) to its end
    prev, over = t_fetch0, 0
    for k in range(n):
        start = max(f1[k], prev) if f1[k] else prev
        over += max(l1[k] - start, 0)
        prev = l1[k]
    out = {
        "submit_after_l0": (t_sub - l0s) * ms,
        "wake": (t_deq - t_sub) * ms,
        "ids_wait": (t_ids - t_deq) * ms,
        "plan0": (t_plan0 - t_ids) * ms,
        "plan0_to_fetch": (t_fetch0 - t_plan0) * ms,
        "launches": 0.0,
        "plan_waits": idle * ms,
        "last_launch": (t_done - t_fetch1) * ms,
        "tail": (b_ns - t_done) * ms,
        "fetch": fetch,
        "layer0": layer0,
        "stall": stall,
        "excess": stall - (fetch - layer0),
        "excess_target": stall - (fetch - layer0_target_ms),
        "critical": (b_ns - l0s) * ms - fetch,
        "a_after_l0": gpu_ms["a"] - gpu_ms["l0_end"],
        "launches_overlapped": over * ms,
        "span": (t_fetch1 - t_fetch0) * ms,
    }
    return {k: float(v) for k, v in out.items()}


#: The launching thread's return from layer 1's join after the hand-off, in
#: order; with ``ret_to_b`` they sum to ``tail`` (``b`` less the hand-off).
RETURN_PHASES = ("ret_seen", "ret_queue", "ret_gil", "ret_join_py", "ret_vllm", "ret_to_b")


def join_return(t_done: int, wait: Sequence[int], join_ret_ns: int, join1_ns: int, b_ns: float) -> dict:
    """Layer 1's tail after the hand-off taken apart on the launching thread (ms).

    ``t_done``: the core's hand-off (the trace's ``t_done``, ns); ``wait``: the layer's
    ``EngramSlot.wait_times()`` of that join, ``(gen, enter, seen, queued, gil)`` (ns: entered
    the wait, saw the hand-off, queued the stream's wait on the done event, took the GIL back);
    ``join_ret_ns``: ``RemoteRows.join`` returned; ``join1_ns``: the benchmark's host time after
    vLLM's ``_ready_rows``; ``b_ns``: the main-stream event ``b`` on the host clock.

    Returns ``ret_seen`` (hand-off to the wait seeing it: the core reads ``t_done`` after it set
    the flag and released the slot's lock, so a few microseconds negative is normal),
    ``ret_queue`` (the C++ ``cuStreamWaitEvent``), ``ret_gil`` (the GIL taken back),
    ``ret_join_py`` (``join``'s Python after the wait), ``ret_vllm`` (vLLM's ``_finish_prefetch``
    and ``_ready_rows`` after the overlay's join), ``ret_to_b`` (from there to ``b`` on the GPU),
    ``join_return`` (``t_done`` to ``join1``, the older traces' ``join_wake``) and ``wait_lead`` (the wait
    entered this long before the hand-off). Raises Dsv41Error for a missing (0) or out-of-order
    wait time."""
    _gen, enter, seen, queued, gil = (int(v) for v in wait)
    seq = [enter, seen, queued, gil, int(join_ret_ns), int(join1_ns)]
    if min(seq) <= 0 or t_done <= 0:
        raise Dsv41Error("join return: a timestamp is missing")
    if any(b < a for a, b in zip(seq, seq[1:], strict=False)):
        raise Dsv41Error("join return: timestamps out of order")
    ms = 1e-6
    out = {
        "ret_seen": (seen - t_done) * ms,
        "ret_queue": (queued - seen) * ms,
        "ret_gil": (gil - queued) * ms,
        "ret_join_py": (join_ret_ns - gil) * ms,
        "ret_vllm": (join1_ns - join_ret_ns) * ms,
        "ret_to_b": (b_ns - join1_ns) * ms,
        "join_return": (join1_ns - t_done) * ms,
        "wait_lead": (t_done - enter) * ms,
    }
    return {k: float(v) for k, v in out.items()}


def trace_fetch_ns(trace: dict) -> int:
    """A job's fetch (ns) from its trace: the stream's busy time (a pipelined stream), else the sum of the
    pieces' request times (as ``layer1_phases``, without piece 0's head-to-rest wait)."""
    if trace.get("stream"):
        return int(trace["t_fetch1"] - trace["t_fetch0"] - trace.get("idle", 0))
    return int(sum(b - a for a, b in zip(trace["fetch0"], trace["fetch1"], strict=False)))


def summarize(steps: Sequence[dict], ndigits: int = 4) -> dict:
    """Per key of ``layer1_phases`` over the steps: ``{"median", "p10", "p90"}`` (ms, rounded to
    ``ndigits``), and ``steps`` (their count). Raises Dsv41Error for no steps."""
    if not steps:
        raise Dsv41Error("phase summary of no steps")
    out: dict = {"steps": len(steps)}
    for k in steps[0]:
        x = np.asarray([s[k] for s in steps], dtype=float)
        out[k] = {
            "median": round(float(np.median(x)), ndigits),
            "p10": round(float(np.percentile(x, 10)), ndigits),
            "p90": round(float(np.percentile(x, 90)), ndigits),
        }
    return out


def paired(phases: Sequence[dict], fetch14: Sequence[float]) -> dict:
    """Layer 1's bound checked step by step: each timed overlay step's stall
    at layer 1 against that step's own layer-1 fetch and layer-0 time, so the fetch's spread
    between steps and runs cancels (the issue: "layer 1's exposed time <= the fetch time minus
    the layer-0 time", per measurement). ``excess`` uses the layer 0 measured on the main stream
    in that step, ``excess_target`` the stand-in's per-layer target; each as the median of the
    per-step values with its 95 % order-statistic interval and the decision for "<= 0". Plus
    the phases of ``layer1_phases`` (median, p10, p90 over the steps) and layer 14's fetch.

    ``phases``: ``layer1_phases`` dicts (ms), one per step; ``fetch14``: layer 14's fetch per
    step (ms; may be empty). Returns ``{"steps", "phases_ms", "excess", "excess_target",
    "within_bound_steps", "layer14_fetch_ms_median", "note"}``, each of ``excess`` /
    ``excess_target`` as ``{"median_ms", "order_ci95_ms", "bootstrap_ci95_ms", "decision",
    "per_step_ms"}`` (ms). Raises Dsv41Error for no steps or a non-finite value."""
    out: dict = {"steps": len(phases), "phases_ms": summarize(phases)}
    for key in ("excess", "excess_target"):
        iv = median_interval([p[key] for p in phases])
        out[key] = {
            "median_ms": round(iv["median"], 4),
            "order_ci95_ms": [round(v, 4) for v in iv["order_ci"]] if iv["order_ci"] else None,
            "bootstrap_ci95_ms": [round(v, 4) for v in iv["bootstrap_ci"]] if iv["bootstrap_ci"] else None,
            "decision": decide(iv, 0.0),
            "per_step_ms": [round(p[key], 4) for p in phases],
        }
    out["within_bound_steps"] = sum(p["excess"] <= 0 for p in phases)
    out["layer14_fetch_ms_median"] = round(float(np.median(fetch14)), 3) if fetch14 else None
    out["note"] = (
        "excess = stall(b - a) - (fetch - layer0) per step; critical = b - layer 0's start - fetch, "
        "the sum of the phases; excess = critical - a_after_l0"
    )
    return out
