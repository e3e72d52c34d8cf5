"""Fault drills under load on the three-host lab: inject a fault, clear it, measure.

For each fault in turn (:data:`~dsv41.harness.drill_faults.FAULTS`), with the bench client
(:mod:`dsv41.harness.bench`, several concurrent streams over the spec's short, code and long
prompts) keeping the API busy:

1. ``baseline_s`` seconds of load with nothing wrong;
2. the fault is injected and held for ``duration_s`` seconds;
3. the fault is cleared; the drill waits until the system has recovered
   (:func:`~dsv41.harness.drill_measure.recovery_time`) or ``recover_timeout_s`` passed, then
   stops the load (requests in flight finish);
4. the six greedy references are verified (``refs.check``: 6/6 identical, and while they run
   every rank counts remote Engram lookups with zero fallbacks and rank 0 drafts remotely).

One concern per module: the faults, the lab hosts and the request checks in
:mod:`~dsv41.harness.drill_faults`; samples, load and the computations on them in
:mod:`~dsv41.harness.drill_measure`; ``report.json``, ``summary.md`` and ``timeline.png`` in
:mod:`~dsv41.harness.drill_report`; this module runs them (:class:`DrillParams`,
:func:`run_drill`). Lab only: every URL must be in 198.18.0.0/15 and the lab's holder pid
files must exist.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import time
from collections.abc import Callable

from dsv41.errors import Dsv41Error
from dsv41.harness.drill_faults import FAULT_CLASSES, FAULTS, LabHosts, Topology
from dsv41.harness.drill_measure import Load, Sampler, read_sample, recovery_time
from dsv41.harness.drill_report import fault_result, fmt_value


@dataclasses.dataclass
class DrillParams:
    """What ``dsv41 drill run`` does: faults in order, seconds per phase, load, endpoints."""

    faults: list[str]
    endpoint: str
    refs_path: str
    server_metrics: str | None
    worker_metrics: str | None
    spec: dict
    streams: int = 4
    baseline_s: float = 8.0
    duration_s: float = 20.0
    recover_timeout_s: float = 60.0
    stable_s: float = 3.0
    interval_s: float = 1.0
    ranks: tuple[str, ...] = ("0", "1")


def new_id(now: _dt.datetime | None = None) -> str:
    """A drill id: UTC time ``YYYYmmddTHHMMSSZ``."""
    return (now or _dt.datetime.now(_dt.UTC)).strftime("%Y%m%dT%H%M%SZ")


def run_drill(
    params: DrillParams,
    hosts: LabHosts,
    topo: Topology,
    log: Callable[[str], None] = print,
    results: list[dict] | None = None,
) -> list[dict]:
    """Run every fault of ``params`` in turn (module docstring), appending each one's
    :func:`fault_result` to ``results`` (kept when a later fault raises) and returning it. A
    fault whose injection fails or is interrupted is cleared before the exception propagates
    (callers clear every fault once more: ``clear_all``); DrillError if a fault cannot be
    injected or the smoke start fails."""
    from dsv41.harness import bench, refs

    model = params.spec["model"] or bench.served_model(params.endpoint)
    refs_doc = refs.load_refs(params.refs_path)
    bench.smoke(params.endpoint, model, refs_doc, params.spec["timeout_s"])
    api_metrics = params.endpoint.rstrip("/") + "/metrics"
    t_origin = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t_origin

    results = [] if results is None else results
    for name in params.faults:
        fault = FAULT_CLASSES[name](hosts, topo)
        load = Load(params.endpoint, model, params.spec, params.streams, clock)  # raises before any thread runs
        sampler = Sampler(
            lambda: read_sample(clock(), api_metrics, params.server_metrics, params.worker_metrics), params.interval_s
        ).start()
        load.start()
        inject: dict = {}
        t_inject = 0.0
        try:
            time.sleep(params.baseline_s)
            log(f"drill: {name}: injecting ({FAULTS[name]})")
            t_inject = clock()
            inject = fault.inject()
            time.sleep(params.duration_s)
        except BaseException:
            # A failed or interrupted injection may have half-happened: clear it, stop the load.
            try:
                fault.clear()
            finally:
                load.stop()
                sampler.stop()
            raise
        t_clear = clock()
        try:
            clear = fault.clear()
        except BaseException:
            load.stop()
            sampler.stop()
            raise
        log(f"drill: {name}: cleared ({clear.get('action')}); waiting for recovery")
        deadline = t_clear + params.recover_timeout_s
        while clock() < deadline:
            time.sleep(params.interval_s)
            if recovery_time(list(sampler.samples), t_clear, params.ranks, True, params.stable_s) is not None:
                break
        time.sleep(params.interval_s)
        requests = load.stop()
        samples = sampler.stop()
        if name == "async_proxy":
            clear = {**clear, **{k: v for k, v in fault.clear().items() if k in ("proxy_pid", "respawned")}}
        log(f"drill: {name}: {len(requests)} requests, verifying the greedy references")
        try:
            chk = refs.check(
                params.endpoint,
                params.refs_path,
                mode="verify",
                metrics_url=api_metrics,
                require_ranks=list(params.ranks),
                require_drafter=True,
                attempts=5,
                delay_s=2.0,
            )
            refs_rec = {
                "ok": chk.ok,
                "summary": chk.comparison.summary(),
                "identical": chk.comparison.identical,
                "total": chk.comparison.total,
                "attempts": chk.attempts,
                "problem": chk.message(),
            }
        except Dsv41Error as exc:
            refs_rec = {"ok": False, "error": str(exc)}
        res = fault_result(
            name, samples, requests, t_inject, t_clear, params.ranks, params.stable_s, inject, clear, refs_rec
        )
        log(
            f"drill: {name}: {res['requests']} requests, {res['failed']} failed, {res['fallbacks_total']} fallbacks, "
            f"{res['fail_closed_rounds']} fail-closed rounds, recovery {fmt_value(res['recovery_s'])} s, "
            f"refs {refs_rec.get('summary') or refs_rec.get('error')}"
        )
        results.append(res)
    return results
