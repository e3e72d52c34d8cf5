"""One fenced window's run: smoke start, paired cells, gate, WIN2 R3 decision, report.

:func:`run_window` is what ``dsv41 window run`` does (the command only parses its options into
:class:`WindowParams` and prints the result): it checks the metric and the two-window cap,
creates ``windows/<id>/`` with this process's ``run.pid`` (``window_pid.write_run_pid``), runs the
smoke start on both arms, the seeded ABBA/BAAB cells (``window.plan_cells`` /
``window.run_cells``), for a drafting candidate the distributional gate, decides by WIN2 R3
(``win2.decide``) and writes the report with its cap record (``window.write_report``).

It takes no HOLD itself: ``window.yml`` holds admission around it. Switching arms is
``switch_cmd``'s job (a shell command, ``{arm}`` replaced); with none, the two URLs are two
endpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import shlex
import subprocess
import sys
from collections.abc import Callable

from dsv41.errors import Dsv41Error
from dsv41.harness import bench, refs, win2, win2_cap, window, window_pid
from dsv41.harness.window import WindowError

#: ``progress(window_id, total_cells)`` -> a context manager around the cells whose value is
#: called once per finished cell with its ``cells.jsonl`` record.
ProgressFactory = Callable[[str, int], contextlib.AbstractContextManager[Callable[[dict], None]]]


@dataclasses.dataclass
class WindowParams:
    """What one ``dsv41 window run`` does (its options, same names and defaults).

    ``control`` / ``candidate``: the arms' base URLs (the same URL with ``switch_cmd``, or for an
    A/A window). ``spec``: a workload spec as ``bench.load_spec`` returns it. ``name``: the
    candidate's name (the question is ``name`` + ``metric``). ``min_effect``, ``alpha``: fractions.
    ``window_id``: empty for UTC time + name. ``refs_path``: greedy references for the smoke
    start's known answer (empty: none). ``cap``: apply and record the two-window cap (False for
    calibration runs). ``metrics``: every rank's ``/metrics`` URL (empty: each arm's URL +
    ``/metrics``); ``rank_urls``: every rank's counters endpoint (:func:`dsv41.harness.rank_metrics.urls`;
    under vLLM each Spark's overlay endpoint), snapshotted besides ``metrics``;
    ``snapshot_metrics`` False for endpoints without one. ``tolerance_nat``: the
    gate's near-tie tolerance (nat). ``fault_after_cells`` / ``fault_cmd``: a fault drill
    (``window.FaultTrigger``; both needed)."""

    control: str
    candidate: str
    spec: dict
    name: str = "aa"
    control_name: str = "production"
    question: str = ""
    metric: str = "step_ms_p50"
    min_effect: float = win2.DEFAULT_MIN_EFFECT
    alpha: float = win2.DEFAULT_ALPHA
    seed: int = 0
    windows_dir: str = "windows"
    window_id: str = ""
    switch_cmd: str = ""
    refs_path: str = ""
    cap: bool = True
    metrics: list[str] = dataclasses.field(default_factory=list)
    rank_urls: dict[str, str] = dataclasses.field(default_factory=dict)
    snapshot_metrics: bool = True
    drafting: bool = False
    tolerance_nat: float = 0.5
    fault_after_cells: int = 0
    fault_cmd: str = ""


def _with_ranks(urls: list[str], rank_urls: dict[str, str]) -> list[str]:
    """``urls`` plus each rank's endpoint not already among them (each read once)."""
    return urls + [u for u in dict.fromkeys(rank_urls.values()) if u not in urls]


@dataclasses.dataclass
class WindowResult:
    """A finished (or interrupted) window: its id, directory, ``cells.jsonl`` path, the decision
    written to ``decision.json``, and whether it was interrupted (Ctrl-C or SIGTERM during the
    cells: the cells so far are kept and the decision is INVALID). ``fault_failure``: one line
    when a fault drill (``fault_cmd``) never triggered or its command failed, else None."""

    window_id: str
    dir: str
    cells_path: str
    decision: win2.Decision
    interrupted: bool
    fault_failure: str | None = None

    @property
    def summary_path(self) -> str:
        """The report's ``summary.md``."""
        return os.path.join(self.dir, "summary.md")


@contextlib.contextmanager
def _no_progress(window_id: str, total: int):
    yield lambda rec: None


def _switcher(switch_cmd: str) -> Callable[[str], None]:
    def switch(arm: str) -> None:
        if switch_cmd:
            # the switch's own output goes to stderr: stdout is the decision alone (window.yml
            # reads the verdict from its first line)
            rc = subprocess.run(
                switch_cmd.replace("{arm}", shlex.quote(arm)), shell=True, check=False, stdout=sys.stderr
            ).returncode
            if rc != 0:
                raise WindowError(f"switching to the {arm} arm failed (exit {rc}): {switch_cmd}")

    return switch


def _fill_missing(cells: list[dict], plan: list[dict]) -> list[dict]:
    """The rule must see cells that never ran as incomplete pairs: decide on what was planned."""
    if len(cells) >= len(plan):
        return cells
    done = {(c["block"], c["pair"], c["arm"]) for c in cells}
    return cells + [
        {k: c[k] for k in ("block", "pair", "arm", "prompt_id", "category", "seed")}
        | {"ok": False, "error": "not run (window stopped)"}
        for c in plan
        if (c["block"], c["pair"], c["arm"]) not in done
    ]


def run_window(params: WindowParams, progress: ProgressFactory | None = None) -> WindowResult:
    """Run one window (module docstring) and return its :class:`WindowResult`; the report
    (``decision.json``, ``cells.jsonl``, ``summary.md``, plots) is in ``windows_dir/<id>/``.

    A cell that fails (switch, request, ``/metrics`` snapshot) makes the window INVALID, not an
    error; so does a gate that cannot run. Raises ``win2.Win2Error`` for an unknown metric or a
    refused cap (before anything is written), WindowError when the window already has cells or
    a smoke-start switch fails, ``bench.BenchError`` when the smoke start fails, and
    KeyboardInterrupt when interrupted outside the cells. ``run.pid`` is removed however it ends."""
    p, sp = params, params.spec
    if p.metric not in win2.METRICS:
        raise win2.Win2Error(f"unknown metric {p.metric!r}; one of {', '.join(win2.METRICS)}")
    nth = win2_cap.check_cap(p.windows_dir, p.name, p.metric) if p.cap else 0
    wid = p.window_id or dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + f"-{p.name}"
    wdir = os.path.join(p.windows_dir, wid)
    if os.path.exists(os.path.join(wdir, "cells.jsonl")):
        raise WindowError(f"window {wid} already has cells in {wdir}; choose another --id")
    os.makedirs(wdir, exist_ok=True)
    window_pid.write_run_pid(wdir)  # a killed window.yml's next run stops this process by it
    try:
        refs_doc = refs.load_refs(p.refs_path) if p.refs_path else None
        endpoints = {"control": p.control, "candidate": p.candidate}
        switch = _switcher(p.switch_cmd)
        model = sp["model"] or bench.served_model(p.control)
        smoke = {}
        for arm in ("control", "candidate"):
            switch(arm)
            smoke[arm] = bench.smoke(endpoints[arm], model, refs_doc, sp["timeout_s"])
        murls = (
            None
            if not p.snapshot_metrics
            else {
                arm: _with_ranks(list(p.metrics) or [url.rstrip("/") + "/metrics"], p.rank_urls)
                for arm, url in endpoints.items()
            }
        )
        plan = window.plan_cells(sp, p.seed)
        cells_path = os.path.join(wdir, "cells.jsonl")
        interrupted = False
        fault = None
        if p.fault_cmd and p.fault_after_cells:
            fault = window.FaultTrigger(
                p.fault_after_cells,
                p.fault_cmd,
                os.path.join(os.path.abspath(wdir), "fault.trigger"),
                arms=[c["arm"] for c in plan],
            )
            fault.start()
        with (progress or _no_progress)(wid, len(plan)) as advance:

            def on_cell(rec: dict) -> None:
                advance(rec)
                if fault is not None:
                    fault.cell_done()

            try:
                window.run_cells(
                    plan,
                    endpoints,
                    model,
                    sp["sampler"],
                    sp["timeout_s"],
                    cells_path,
                    switch,
                    progress=on_cell,
                    metrics=murls,
                )
            except KeyboardInterrupt:
                interrupted = True
            finally:
                if fault is not None:
                    fault.join()
        cells = _fill_missing(win2.load_cells(cells_path) if os.path.getsize(cells_path) else [], plan)
        records, gate_error = None, None
        if p.drafting and not interrupted and all(c.get("ok") for c in cells):
            # the gate's greedy runs are more requests against the arms: if an arm fails here the
            # window is INVALID (decision written, restore follows), not an aborted run
            try:
                ids = {}
                for arm in ("control", "candidate"):
                    switch(arm)
                    ids[arm] = {n: refs.generate(endpoints[arm], q, model, 32) for n, q in bench.greedy_prompts()}
                greedy = {n: (ids["control"][n], ids["candidate"][n]) for n in ids["control"]}
                records = window.gate_records(cells, greedy)
            except Dsv41Error as exc:
                gate_error = f"distributional gate could not run: {exc}"
        d = win2.decide(
            cells, p.metric, p.min_effect, p.alpha, p.seed, gate_records=records, tolerance_nat=p.tolerance_nat
        )
        if gate_error:
            d.verdict = "INVALID"
            d.reasons.append(gate_error)
        meta = {
            "window_id": wid,
            "candidate": p.name,
            "control": p.control_name,
            "question": p.question or f"{p.name}: {p.metric}",
            "window_number": nth,
            "spec": {k: v for k, v in sp.items() if k != "prompts"},
            "prompts": [q["id"] for q in sp["prompts"]],
            "endpoints": endpoints,
            "smoke": smoke,
            "versions": window.stack_version(),
            "interrupted": interrupted,
        }
        if fault is not None:
            meta["fault"] = fault.record()
        # decision and cap are kept together or not at all (write_report's cap)
        window.write_report(
            wdir,
            d,
            cells,
            meta,
            cap=None if not p.cap else lambda: win2_cap.stage_window(p.windows_dir, p.name, p.metric, wid, d.verdict),
        )
        return WindowResult(
            wid, wdir, cells_path, d, interrupted, None if fault is None or interrupted else fault.failure()
        )
    finally:
        window_pid.clear_run_pid(wdir)
