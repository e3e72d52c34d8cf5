"""Paired cells of a fenced window, and the window's report.

A window's timed work is a list of blocks. A block is one (prompt, seed, budget, sampler); it
holds two pairs run back to back in a seeded random order, ABBA (control, candidate, candidate,
control) or BAAB, so that within a block both arms see the same drift and the block mean of the
two pair log-ratios cancels a linear trend (docs/windows.md). Blocks of all prompts are shuffled
together with the window seed. Each timed request is one cell; the cell's metrics are the
request's TTFT, its own step_ms p50 and its decode tok/s (``dsv41.harness.bench``).

Switching arms is the caller's job (``switch(arm)``: in a playbook, restart only what differs and
wait for readiness; for two endpoints, nothing). Cells are appended to ``cells.jsonl`` as they
finish, so a killed run keeps what it measured.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

from dsv41 import fileio
from dsv41.errors import Dsv41Error
from dsv41.harness import bench, win2

ABBA = ("control", "candidate", "candidate", "control")
BAAB = ("candidate", "control", "control", "candidate")


class WindowError(Dsv41Error):
    """A window cannot start or continue (bad plan, unusable output directory)."""


def plan_cells(spec: dict, seed: int, salt_base: str | None = None) -> list[dict]:
    """The seeded cell plan: ``blocks_per_prompt`` blocks per spec prompt, shuffled, each in ABBA
    or BAAB order. Returns cells in run order: ``{"block", "pair", "arm", "prompt_id", "category",
    "seed", "max_tokens", "prompt", "salt", "order"}``; the two cells of a pair share prompt and
    request seed, the two pairs of a block differ in request seed. Same inputs, same plan."""
    rng = random.Random(seed)
    salt_base = salt_base or uuid.uuid4().hex[:12]
    blocks = [(p, b) for p in spec["prompts"] for b in range(spec["blocks_per_prompt"])]
    rng.shuffle(blocks)
    cells = []
    for bi, (p, _) in enumerate(blocks):
        order = ABBA if rng.random() < 0.5 else BAAB
        text = bench.prompt_text(p)
        for k, arm in enumerate(order):
            pair = k // 2
            salt = f"{salt_base}-{bi}-{k}"
            cells.append(
                {
                    "block": bi,
                    "pair": pair,
                    "arm": arm,
                    "prompt_id": p["id"],
                    "category": p["category"],
                    "seed": spec["seed"] + 2 * bi + pair,
                    "max_tokens": p.get("max_tokens", spec["max_tokens"]),
                    "prompt": f"[{salt}] {text}" if spec["unique_prefix"] else text,
                    "salt": salt if spec["cache_salt"] else None,
                    "order": "".join("A" if a == "control" else "B" for a in order),
                }
            )
    return cells


def cell_record(plan_cell: dict, res: bench.RequestResult) -> dict:
    """One ``cells.jsonl`` line: the plan fields (prompt text dropped) plus the request's result."""
    rec = {k: v for k, v in plan_cell.items() if k not in ("prompt", "salt")}
    rec.update(
        ok=res.ok,
        error=res.error,
        ttft_ms=res.ttft_ms,
        step_ms_p50=res.step_ms_p50,
        tok_s=res.tok_s,
        e2e_ms=res.e2e_ms,
        steps=res.steps,
        completion_tokens=res.completion_tokens,
        tokens_per_step=res.tokens_per_step,
        finish_reason=res.finish_reason,
        step_ms=res.step_ms,
        started_at=res.started_at,
    )
    return rec


def counter_summary(delta: dict[str, dict[str, float]]) -> dict:
    """Per-cell figures from a ``bench.metrics_delta``: the non-zero series per URL
    (``counters``), and when present ``accepted_per_round`` (``vllm:spec_decode_num_accepted_tokens``
    / ``..._num_drafts``) and ``engram_fallbacks`` (sum over ranks)."""
    out: dict = {"counters": {u: {k: v for k, v in d.items() if v} for u, d in delta.items()}}
    tot: dict[str, float] = {}
    for d in delta.values():
        for k, v in d.items():
            base = k.split("{", 1)[0]
            tot[base] = tot.get(base, 0.0) + v
    drafts = tot.get("vllm:spec_decode_num_drafts_total", 0.0)
    if drafts > 0:
        out["accepted_per_round"] = tot.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / drafts
    if "dsv41_engram_fallbacks_total" in tot:
        out["engram_fallbacks"] = tot["dsv41_engram_fallbacks_total"]
    return out


def failed_cell(plan_cell: dict, error: str) -> dict:
    """A ``cells.jsonl`` line for a cell that could not be measured (a refused ``/metrics``
    snapshot, a failed arm switch): the plan fields, ``ok: false`` and ``error``, no metrics, so
    the rule sees it as a failed cell (INVALID window) rather than the run dying without a verdict."""
    rec = {k: v for k, v in plan_cell.items() if k not in ("prompt", "salt")}
    rec.update(ok=False, error=error)
    return rec


def run_cells(
    plan: list[dict],
    endpoints: dict[str, str],
    model: str,
    sampler: dict,
    timeout_s: float,
    out_path: str,
    switch: Callable[[str], None] | None = None,
    progress: Callable[[dict], None] | None = None,
    stop_on_failure: bool = True,
    metrics: dict[str, list[str]] | None = None,
) -> list[dict]:
    """Run ``plan`` in order, one request at a time, appending each cell to ``out_path``.

    ``endpoints``: ``{"control": url, "candidate": url}`` (the same url twice when the arms
    share the nodes and ``switch(arm)`` reconfigures them). ``switch`` is called whenever the arm
    changes. ``metrics``: per arm, every rank's ``/metrics`` URL, snapshotted before and after
    each cell (outside the timed request) into the cell's :func:`counter_summary`. A cell whose
    switch fails (WindowError), whose request fails, or whose ``/metrics`` snapshot is refused
    (BenchError: e.g. the engine was killed mid-window) is written as a failed cell
    (:func:`failed_cell`) and, with ``stop_on_failure``, stops the run: the window is INVALID
    anyway and its decision is still written. KeyboardInterrupt propagates after the cell in
    flight is written."""
    import httpx

    done: list[dict] = []
    arm_now = None
    from dsv41.harness import http

    for arm, url in sorted(endpoints.items()):
        http.check_url(url, what=f"{arm} endpoint", error=WindowError)

    def new_client():
        return httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            trust_env=False,
            headers={**http.window_headers(), **http.auth_headers(what="window cells", error=WindowError)},
        )

    client = new_client()
    try:
        with fileio.Appender(out_path, "cells file", error=WindowError) as fh:  # a cell is kept whole or not at all
            for c in plan:
                rec = None
                if c["arm"] != arm_now:
                    if switch is not None:
                        try:
                            switch(c["arm"])
                        except WindowError as exc:
                            rec = failed_cell(c, f"arm switch failed: {exc}")
                        # a switch may have restarted the engine: no pooled connection outlives it
                        client.close()
                        client = new_client()
                    arm_now = c["arm"] if rec is None else None
                urls = (metrics or {}).get(c["arm"]) or []
                if rec is None:
                    try:
                        before = bench.snapshot_metrics(urls) if urls else None
                    except bench.BenchError as exc:
                        rec = failed_cell(c, f"/metrics snapshot before the cell refused: {exc}")
                if rec is None:
                    body = bench.request_body(model, c["prompt"], c["seed"], c["max_tokens"], sampler, c["salt"])
                    res = bench.stream_one(client, endpoints[c["arm"]], body, c["prompt_id"], c["category"])
                    rec = cell_record(c, res)
                    if before is not None:
                        try:
                            rec.update(counter_summary(bench.metrics_delta(before, bench.snapshot_metrics(urls))))
                        except bench.BenchError as exc:
                            rec.update(ok=False, error=f"/metrics snapshot after the cell refused: {exc}")
                fh.write(fileio.dumps_json(rec, nonfinite="null") + "\n")
                fh.flush()
                done.append(rec)
                if progress:
                    progress(rec)
                if not rec["ok"] and stop_on_failure:
                    break
    finally:
        client.close()
    return done


class FaultTrigger:
    """A fault drill inside a window (window.yml's ``window_fault=mid_cell``: SIGKILL rank 0's
    engine while cells run). ``cmd`` is a shell command started at once in the background (an
    ansible-playbook takes seconds to start; started early it is ready when needed), with
    ``{trigger}`` replaced by a file path it must wait for before it strikes.

    The file is created once ``after_cells`` cells have finished, or later: with ``arms`` (the
    plan's arm per cell, in order) at the first cell boundary at or after ``after_cells`` whose
    next cell is of the same arm, because an arm switch restarts the TP pair and would heal the
    fault before any cell saw it. The run then waits for the command to strike (at most
    ``strike_wait_s`` seconds) before the next cell, so the fault always lands between two cells of
    one arm and the next cell meets the killed engine, however slowly the controller starts a task
    (a strike raced against a running cell landed after it on a loaded 2-core controller, and the
    next cell's switch healed it). ``join`` waits for the command (``rc`` is its exit status) and
    removes the file. The command's stdout and stderr go to ``log_path`` (default: ``fault.log``
    next to the trigger) so that a drill that did not strike says why; ``record()`` is what the
    window's report keeps."""

    def __init__(
        self,
        after_cells: int,
        cmd: str,
        trigger_path: str,
        strike_wait_s: float = 120.0,
        log_path: str | None = None,
        arms: list[str] | None = None,
    ) -> None:
        import shlex

        self.after_cells, self.trigger_path, self.strike_wait_s = after_cells, trigger_path, strike_wait_s
        self.log_path = log_path or str(Path(trigger_path).with_name("fault.log"))
        self.cmd = cmd.replace("{trigger}", shlex.quote(trigger_path))
        self.at_cell = after_cells
        if arms:
            same = [k for k in range(max(after_cells, 1), len(arms)) if arms[k] == arms[k - 1]]
            self.at_cell = same[0] if same else after_cells
        self.done = 0
        self.rc: int | None = None
        self.triggered = False
        self._proc = None

    def start(self) -> None:
        """Start the command (it waits for the trigger file); its output goes to ``log_path``."""
        if self._proc is None:
            with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
                self._proc = subprocess.Popen(self.cmd, shell=True, stdout=log, stderr=subprocess.STDOUT)

    def record(self) -> dict:
        """``{"after_cells", "at_cell", "triggered", "rc", "log"}`` (``at_cell``: cells finished
        when the trigger was created; ``log``: the file's name): after ``join``."""
        return {
            "after_cells": self.after_cells,
            "at_cell": self.at_cell,
            "triggered": self.triggered,
            "rc": self.rc,
            "log": os.path.basename(self.log_path),
        }

    def failure(self) -> str | None:
        """One line when the drill did not do its job (never triggered, or its command failed),
        else None: a fault drill that did not strike must not pass for one that did."""
        if not self.triggered:
            return (
                f"fault drill never triggered: the window ended after {self.done} cell(s), "
                f"the fault was due after {self.at_cell}"
            )
        if self.rc != 0:
            return f"fault drill command failed (rc {self.rc}); its output is in {self.log_path}"
        return None

    def cell_done(self) -> None:
        """Count one finished cell; after the ``at_cell``-th create the trigger file and wait
        (at most ``strike_wait_s``) for the command to strike before the next cell."""
        self.done += 1
        if self.done == self.at_cell:
            # atomic: the fault command waits for the file and may read it the moment it appears
            fileio.atomic_write(self.trigger_path, "fault\n", "fault trigger file", error=WindowError)
            self.triggered = True
            if self._proc is not None:
                try:
                    self._proc.wait(self.strike_wait_s)
                except subprocess.TimeoutExpired:
                    pass  # join() bounds and ends it; the window goes on

    def join(self, timeout_s: float = 300.0) -> None:
        """Wait for the command (killed after ``timeout_s`` seconds) and remove the trigger file."""
        if self._proc is not None:
            try:
                self.rc = self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self.rc = self._proc.wait()
        Path(self.trigger_path).unlink(missing_ok=True)


def gate_records(cells: list[dict], greedy: dict[str, tuple[list[int], list[int]]]) -> list[dict]:
    """Input of ``win2.distributional_gate`` for a drafting candidate.

    ``greedy``: per greedy reference prompt, (control ids, candidate ids) at temperature 0; a
    prompt whose ids differ gets ``first_diff`` and ``logit_gap_nat`` None (the gap needs the
    target's logits at that position, which a scorer with logprobs supplies; without one the gate
    fails closed). Per spec prompt of the cells: output lengths and accepted drafts per round of
    each arm."""
    from dsv41.harness.refs import first_diff

    recs = [
        {"prompt_id": f"greedy:{name}", "first_diff": first_diff(a, b), "logit_gap_nat": None}
        for name, (a, b) in greedy.items()
    ]
    by_prompt: dict[str, dict] = {}
    for c in cells:
        if not c.get("ok"):
            continue
        r = by_prompt.setdefault(
            c["prompt_id"],
            {
                "prompt_id": c["prompt_id"],
                "first_diff": None,
                "control_lengths": [],
                "candidate_lengths": [],
                "control_acceptance": [],
                "candidate_acceptance": [],
            },
        )
        if c.get("completion_tokens") is not None:
            r[f"{c['arm']}_lengths"].append(c["completion_tokens"])
        if c.get("accepted_per_round") is not None:
            r[f"{c['arm']}_acceptance"].append(c["accepted_per_round"])
    return recs + [by_prompt[k] for k in sorted(by_prompt)]


def stack_version(repo: str | None = None) -> dict:
    """Harness version: the package version and, when run from a git checkout, the commit and
    whether the tree is dirty (a dirty tree is flagged in every report)."""
    from dsv41 import __version__

    out = {"package": __version__, "commit": None, "dirty": None}
    root = repo or str(Path(__file__).resolve().parents[3])
    try:
        out["commit"] = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        out["dirty"] = bool(
            subprocess.run(
                ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _ecdf(ax, values, label):
    v = sorted(values)
    if v:
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)


def _save_plot(fig, wdir: str, name: str) -> str:
    """Lay out ``fig`` (a matplotlib Figure), write it atomically as ``wdir/name`` (PNG, 100 dpi;
    fileio errors as for any window file), close it and return ``name``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fileio.atomic_write(os.path.join(wdir, name), lambda f: fig.savefig(f, format="png", dpi=100), "window plot")
    plt.close(fig)
    return name


def write_report(wdir: str, decision: win2.Decision, cells: list[dict], meta: dict, cap=None) -> list[str]:
    """Write ``decision.json``, ``summary.md`` and the PNG plots into ``wdir``; returns the files.

    ``cap``: a callable returning the staged two-window cap update (:func:`win2_cap.stage_window`).
    The decision is staged first (a full disk fails here, nothing kept, the window not counted),
    then the cap; both are renamed into place together, and if the cap cannot be put in place the
    decision is removed again: a decision is kept exactly when its window is counted.
    Raises Dsv41Error (``fileio.FileError`` / ``Win2Error``).

    Plots (matplotlib, Agg): per-pair log-ratios as fractions with the CI and the +-min_effect
    band (``pairs.png``), CDFs of per-request step_ms p50 and TTFT per arm (``cdf.png``), and
    tokens per step (drafted tokens accepted + 1) per prompt and arm (``acceptance.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(wdir, exist_ok=True)
    files = []
    doc = {"decision": decision.to_dict(), **meta}
    decision_path = os.path.join(wdir, "decision.json")
    staged = fileio.stage(decision_path, fileio.dumps_json(doc, indent=1, nonfinite="null") + "\n", "window decision")
    try:
        staged_cap = cap() if cap is not None else None
    except BaseException:
        staged.discard()
        raise
    try:
        staged.commit()
    except BaseException:
        if staged_cap is not None:
            staged_cap.discard()
        raise
    if staged_cap is not None:
        try:
            staged_cap.commit()
        except BaseException:
            os.unlink(decision_path)  # not counted, so not decided: the window can be run again
            raise
    files.append("decision.json")
    pairs, _ = win2.pair_log_ratios([c for c in cells if c.get("ok")], decision.metric)
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = list(range(len(pairs)))
    ax.scatter(xs, [math.expm1(p["r"]) for p in pairs], s=12, label="pair (candidate better > 0)")
    m = decision.min_effect
    ax.axhspan(-m, m, color="grey", alpha=0.2, label=f"+-min effect {m:g}")
    if decision.ci:
        ax.axhspan(decision.ci[0], decision.ci[1], color="tab:orange", alpha=0.3, label="CI of the median")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("pair (run order)")
    ax.set_ylabel(f"{decision.metric} ratio - 1")
    ax.set_title(f"{meta.get('window_id', '')}: {decision.verdict}")
    ax.legend(fontsize=7)
    files.append(_save_plot(fig, wdir, "pairs.png"))
    fig, axs = plt.subplots(1, 2, figsize=(9, 3.5))
    for arm in ("control", "candidate"):
        ok = [c for c in cells if c.get("ok") and c["arm"] == arm]
        _ecdf(axs[0], [c["step_ms_p50"] for c in ok if c.get("step_ms_p50")], arm)
        _ecdf(axs[1], [c["ttft_ms"] for c in ok if c.get("ttft_ms")], arm)
    axs[0].set_xlabel("step_ms p50 per request")
    axs[1].set_xlabel("TTFT ms")
    for a in axs:
        a.set_ylabel("CDF")
        a.legend(fontsize=7)
    files.append(_save_plot(fig, wdir, "cdf.png"))
    prompts = sorted({c["prompt_id"] for c in cells})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.4
    for j, arm in enumerate(("control", "candidate")):
        vals = []
        for p in prompts:
            v = [
                c["accepted_per_round"] + 1 if c.get("accepted_per_round") is not None else c["tokens_per_step"]
                for c in cells
                if c.get("ok")
                and c["arm"] == arm
                and c["prompt_id"] == p
                and (c.get("tokens_per_step") is not None or c.get("accepted_per_round") is not None)
            ]
            vals.append(statistics.median(v) if v else 0.0)
        ax.bar([i + (j - 0.5) * width for i in range(len(prompts))], vals, width, label=arm)
    ax.set_xticks(range(len(prompts)))
    ax.set_xticklabels(prompts, rotation=30, fontsize=7)
    ax.set_ylabel("tokens per step (1 + accepted drafts)")
    ax.legend(fontsize=7)
    files.append(_save_plot(fig, wdir, "acceptance.png"))
    d = decision
    ver = meta.get("versions", {})
    lines = [
        f"# Window {meta.get('window_id', '')}: **{d.verdict}**",
        "",
        f"- question: {meta.get('question', '-')}",
        f"- candidate `{meta.get('candidate', '-')}` vs control `{meta.get('control', '-')}`",
        f"- primary metric {d.metric}, min effect {d.min_effect:.1%}, alpha {d.alpha}",
        f"- effect {d.effect:+.2%} (positive = candidate better), CI [{d.ci[0]:+.2%}, {d.ci[1]:+.2%}]"
        if d.ci
        else "- effect: none (window INVALID)",
        f"- {d.n_pairs} pairs; cells: `cells.jsonl`; plots: pairs.png, cdf.png, acceptance.png",
        f"- harness {ver.get('package')} at {ver.get('commit') or 'unknown commit'}"
        + (" **(dirty tree)**" if ver.get("dirty") else ""),
        "",
        "## Reasons",
        "",
    ]
    lines += [f"- {r}" for r in d.reasons] + [
        "",
        "## Categories",
        "",
        f"Verdicts corrected for multiplicity across the {len(d.categories)} categories (Holm, family "
        f"alpha {d.alpha:g}); each CI is at its Holm-adjusted level. The unadjusted "
        f"{1 - d.alpha:.0%} CI is descriptive only (no verdict is drawn from it; the non-inferiority "
        "guard uses it because it fails safe).",
        "",
        "| category | verdict (Holm) | effect | CI (Holm level) | adjusted alpha | descriptive CI (unadjusted) | pairs |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for cat, e in d.categories.items():
        desc = e.get("descriptive") or {"ci": e["ci"]}
        lines.append(
            f"| {cat} | {e['verdict']} | {e['effect']:+.2%} | [{e['ci'][0]:+.2%}, {e['ci'][1]:+.2%}] | "
            f"{e.get('alpha_adjusted', d.alpha):.4g} | [{desc['ci'][0]:+.2%}, {desc['ci'][1]:+.2%}] | "
            f"{e['n_pairs']} |"
        )
    fileio.atomic_write(os.path.join(wdir, "summary.md"), "\n".join(lines) + "\n", "window summary")
    files.append("summary.md")
    return files
