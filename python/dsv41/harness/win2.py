"""The WIN2 decision rule, revision R3: paired cells in, one verdict out.

Input: cells (one dict per timed request, ``windows/<id>/cells.jsonl``) with at least ``block``,
``pair``, ``arm`` (``control`` | ``candidate``), ``prompt_id``, ``category``, ``seed``, ``ok`` and
the metrics ``ttft_ms``, ``step_ms_p50`` (lower is better) and ``tok_s`` (higher is better).

The rule (docs/windows.md; method: docs/system.md "WIN2 R3"):

1. Per pair (``block``, ``pair``): one control and one candidate cell of the same prompt and seed;
   the log-ratio ``r = log(control / candidate)`` for ``*_ms`` metrics and
   ``log(candidate / control)`` for ``tok_s``, so ``r > 0`` always means the candidate is better.
2. Per block: the mean of its pairs' log-ratios (an ABBA/BAAB block holds two pairs whose mean
   cancels a linear drift in time).
3. Effect: the median of the block values, reported as a fraction ``expm1(median)``.
4. CI: BCa bootstrap (``scipy.stats.bootstrap``, ``confidence_level = 1 - alpha``) of that median,
   resampling blocks *within* each prompt identity (one bootstrap sample per prompt: scipy
   resamples each sample independently, i.e. a stratified bootstrap), never pooling blocks across
   prompts. A prompt with a single block is carried as a constant (its only resample is itself).
5. Verdict on the CI in fraction units with ``m = min_effect``: ``WIN`` if ``lo > +m``, ``LOSS``
   if ``hi < -m``, ``NO-CHANGE`` if ``-m <= lo`` and ``hi <= +m``, otherwise ``UNRESOLVED``;
   ``INVALID`` when a cell failed, a pair is incomplete or inconsistent, or a metric is missing.
6. Per-category non-inferiority: a ``WIN`` becomes ``UNRESOLVED`` when any category's CI lies
   wholly below ``-m`` (a regression hidden by the overall win). This guard uses the unadjusted
   ``1 - alpha`` CIs on purpose: more LOSSes only ever withhold a WIN (it fails safe).
7. Per-category verdicts are corrected for multiplicity across the K categories (Holm 1979,
   "A simple sequentially rejective multiple test procedure", Scand. J. Statist. 6:65-70), by
   inverting the CIs: with R categories still open, each is estimated at ``1 - alpha / R``;
   those whose CI resolves (any verdict but UNRESOLVED) keep that verdict and CI, the others
   stay open with R reduced by the number just resolved; stop when none resolves. Because a
   category's CIs at different levels come from the same seeded resamples they are nested, so
   "resolved at level a" defines a p-value and this batch step-down is exactly Holm's: the
   probability that any category gets a false WIN/LOSS/NO-CHANGE is at most ``alpha``.
   Each category also carries its unadjusted estimate under ``descriptive`` (not a verdict).

All-identical block values make BCa degenerate (zero-variance jackknife, scipy returns NaN): the
CI is then the point itself and the reasons say so. Should BCa still give a non-finite bound
(e.g. nearly all values tied), the percentile interval of the same resamples is used, said in
the reasons.

Also here: the distributional gate for drafting candidates. The two-window cap per question is
:mod:`dsv41.harness.win2_cap`; the calibration by simulated windows :mod:`dsv41.harness.win2_sim`.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsv41 import fileio
from dsv41.errors import Dsv41Error

METRICS = {"ttft_ms": "lower", "step_ms_p50": "lower", "tok_s": "higher"}
ARMS = ("control", "candidate")
VERDICTS = ("WIN", "LOSS", "NO-CHANGE", "UNRESOLVED", "INVALID")
REQUIRED = ("block", "pair", "arm", "prompt_id", "category", "seed", "ok")
DEFAULT_MIN_EFFECT = 0.02
DEFAULT_ALPHA = 0.05
# Bootstrap resamples: 9,999 is scipy's default and keeps the BCa tails stable at alpha = 0.05.
DEFAULT_RESAMPLES = 9999
# Fewer blocks than this give no verdict beyond UNRESOLVED: a bootstrap of a median over a handful
# of blocks has a CI about as wide as its data, and a 2-block A/A window "wins" whenever both
# blocks fall beyond +min_effect (seen on the lab: docs/windows.md).
MIN_BLOCKS = 8


class Win2Error(Dsv41Error):
    """A cells file or an argument cannot be used at all (unreadable, not JSON lines, bad flag)."""


@dataclass
class Estimate:
    """Effect and CI of one set of blocks, all in fraction units (``expm1`` of log-ratios).

    ``effect``: median block log-ratio as a fraction (positive = candidate better);
    ``ci``: [lo, hi] at ``1 - alpha``; ``n_pairs``, ``n_blocks``, ``n_prompts``: counts used;
    ``method``: ``BCa``, ``percentile`` or ``degenerate``; ``verdict`` by the rule above.
    """

    effect: float
    ci: tuple[float, float]
    n_pairs: int
    n_blocks: int
    n_prompts: int
    method: str
    verdict: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "effect": self.effect,
            "ci": list(self.ci),
            "n_pairs": self.n_pairs,
            "n_blocks": self.n_blocks,
            "n_prompts": self.n_prompts,
            "method": self.method,
            "notes": list(self.notes),
        }


@dataclass
class Decision:
    """The WIN2 R3 outcome; ``to_dict()`` is the ``dsv41 window decide --json`` document."""

    verdict: str
    metric: str
    min_effect: float
    alpha: float
    seed: int
    effect: float | None = None
    ci: tuple[float, float] | None = None
    n_pairs: int = 0
    categories: dict[str, dict] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    gate: dict | None = None
    #: ``{"method": "holm", "family_alpha", "n_categories"}`` once categories were estimated.
    category_correction: dict | None = None

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "metric": self.metric,
            "min_effect": self.min_effect,
            "alpha": self.alpha,
            "seed": self.seed,
            "effect": self.effect,
            "ci": list(self.ci) if self.ci else None,
            "n_pairs": self.n_pairs,
            "categories": self.categories,
            "category_correction": self.category_correction,
            "reasons": list(self.reasons),
            "gate": self.gate,
            "rule": "WIN2-R3",
        }


def classify(lo: float, hi: float, min_effect: float) -> str:
    """Verdict of a CI ``[lo, hi]`` (fractions, positive = candidate better) against ``min_effect``."""
    if lo > min_effect:
        return "WIN"
    if hi < -min_effect:
        return "LOSS"
    if lo >= -min_effect and hi <= min_effect:
        return "NO-CHANGE"
    return "UNRESOLVED"


def load_cells(path: str) -> list[dict]:
    """Read a cells JSON-lines file; ``Win2Error`` naming the file and line on anything unreadable."""

    lines = fileio.read_text(path, "cells file", error=Win2Error).splitlines()
    cells = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = fileio.loads_json(line)
        except json.JSONDecodeError as exc:
            raise Win2Error(f"{path}:{i}: not a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise Win2Error(f"{path}:{i}: each line must be a JSON object, got {type(obj).__name__}")
        cells.append(obj)
    if not cells:
        raise Win2Error(f"{path}: no cells")
    return cells


def _metric_value(cell: dict, metric: str) -> float | None:
    v = cell.get(metric)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v > 0 else None


def pair_log_ratios(cells: Iterable[dict], metric: str) -> tuple[list[dict], list[str]]:
    """Pair the cells; returns (pairs, problems).

    ``pairs``: ``[{"block", "pair", "prompt_id", "category", "seed", "r"}]`` with ``r`` the
    log-ratio (positive = candidate better). ``problems``: one sentence per defect (a failed cell,
    a missing field, a pair without both arms or with two of one, arms of different prompt or
    seed, a missing or non-positive metric); any problem makes the window INVALID.
    """
    if metric not in METRICS:
        raise Win2Error(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    problems: list[str] = []
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for n, c in enumerate(cells, 1):
        missing = [k for k in REQUIRED if k not in c]
        if missing:
            problems.append(f"cell {n}: missing field(s) {', '.join(missing)}")
            continue
        if c["arm"] not in ARMS:
            problems.append(f"cell {n}: arm must be control or candidate, got {c['arm']!r}")
            continue
        key = (str(c["block"]), str(c["pair"]))
        if c["ok"] is not True:
            err = c.get("error") or "ok is not true"
            problems.append(f"cell {n} (block {key[0]} pair {key[1]} {c['arm']}) failed: {err}")
        if c["arm"] in groups[key]:
            problems.append(f"block {key[0]} pair {key[1]}: two {c['arm']} cells")
            continue
        groups[key][c["arm"]] = c
    pairs = []
    for (block, pair), arms in groups.items():
        if len(arms) != 2:
            have = next(iter(arms))
            problems.append(f"block {block} pair {pair}: incomplete (only {have})")
            continue
        a, b = arms["control"], arms["candidate"]
        if a["prompt_id"] != b["prompt_id"] or a["seed"] != b["seed"]:
            problems.append(
                f"block {block} pair {pair}: arms differ in prompt_id or seed "
                f"({a['prompt_id']!r}/{a['seed']!r} vs {b['prompt_id']!r}/{b['seed']!r})"
            )
            continue
        if not (a["ok"] is True and b["ok"] is True):
            continue  # already reported
        va, vb = _metric_value(a, metric), _metric_value(b, metric)
        if va is None or vb is None:
            problems.append(f"block {block} pair {pair}: {metric} missing, non-finite or <= 0")
            continue
        r = math.log(va / vb) if METRICS[metric] == "lower" else math.log(vb / va)
        pairs.append(
            {
                "block": block,
                "pair": pair,
                "prompt_id": str(a["prompt_id"]),
                "category": str(a["category"]),
                "seed": a["seed"],
                "r": r,
            }
        )
    return pairs, problems


def _blocks(pairs: list[dict]) -> dict[str, dict[str, float]]:
    """{prompt_id: {block: mean log-ratio of the block's pairs}}."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for p in pairs:
        acc[p["prompt_id"]][p["block"]].append(p["r"])
    return {pid: {b: float(np.mean(v)) for b, v in bl.items()} for pid, bl in acc.items()}


def estimate(
    pairs: list[dict], min_effect: float, alpha: float, seed: int, n_resamples: int = DEFAULT_RESAMPLES
) -> Estimate:
    """Effect, stratified-by-prompt BCa CI and verdict of ``pairs`` (see the module doc).

    ``pairs`` must be non-empty (``pair_log_ratios`` output). Deterministic for a given ``seed``.
    """
    from scipy import stats

    per_prompt = _blocks(pairs)
    strata = [np.array(sorted(v.values())) for _, v in sorted(per_prompt.items())]
    allv = np.concatenate(strata)
    n_blocks, n_prompts = int(allv.size), len(strata)
    point = float(np.median(allv))
    notes: list[str] = []
    if np.ptp(allv) == 0.0:
        lo = hi = point
        method = "degenerate"
        notes.append("all block log-ratios are identical: BCa is undefined, the CI is the point")
    else:
        sampled = [s for s in strata if s.size >= 2]
        fixed = np.concatenate([s for s in strata if s.size < 2] or [np.empty(0)])
        if not sampled:
            lo, hi = -math.inf, math.inf
            method = "none"
            notes.append("every prompt has a single block: nothing to resample within a prompt, no CI")
        else:

            def stat(*samples, axis=-1):
                parts = list(samples)
                if fixed.size:
                    shape = samples[0].shape[:-1] + (fixed.size,)
                    parts.append(np.broadcast_to(fixed, shape))
                return np.median(np.concatenate(parts, axis=-1), axis=-1)

            method = "BCa"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DegenerateDataWarning: handled below
                res = stats.bootstrap(
                    tuple(sampled),
                    stat,
                    vectorized=True,
                    paired=False,
                    confidence_level=1 - alpha,
                    n_resamples=n_resamples,
                    method="BCa",
                    rng=np.random.default_rng(seed),
                )
                lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    method = "percentile"
                    notes.append("BCa gave a non-finite bound (ties); percentile interval used")
                    res = stats.bootstrap(
                        tuple(sampled),
                        stat,
                        vectorized=True,
                        paired=False,
                        confidence_level=1 - alpha,
                        n_resamples=n_resamples,
                        method="percentile",
                        rng=np.random.default_rng(seed),
                    )
                    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
            # BCa on a median can place a bound a hair inside the point; the CI must contain it.
            lo, hi = min(lo, point), max(hi, point)
    flo, fhi = math.expm1(lo), math.expm1(hi)
    verdict = "UNRESOLVED" if method == "none" else classify(flo, fhi, min_effect)
    if n_blocks < MIN_BLOCKS and verdict != "UNRESOLVED":
        notes.append(f"only {n_blocks} blocks (< {MIN_BLOCKS}): too few to resolve, {verdict} withheld")
        verdict = "UNRESOLVED"
    return Estimate(
        effect=math.expm1(point),
        ci=(flo, fhi),
        n_pairs=len(pairs),
        n_blocks=n_blocks,
        n_prompts=n_prompts,
        method=method,
        verdict=verdict,
        notes=notes,
    )


def distributional_gate(records: list[dict], tolerance_nat: float = 0.5, length_tolerance: float = 0.10) -> dict:
    """The distributional gate for drafting candidates (replaces exact greedy identity).

    ``records``: one per prompt identity: ``{"prompt_id", "first_diff": int|None,
    "logit_gap_nat": float|None, "control_lengths": [int], "candidate_lengths": [int],
    "control_acceptance": [float], "candidate_acceptance": [float]}`` where ``first_diff`` is the
    first differing greedy token position between arms (None when identical) and
    ``logit_gap_nat`` the target's top-1 minus top-2 logit at that position (natural-log units).

    Passes when every differing prompt is a near-tie (``logit_gap_nat <= tolerance_nat``; 0.5 nat
    is the BF16 near-tie step, docs/system.md) and every prompt's median output length per arm
    agrees within ``length_tolerance`` (fraction). Acceptance per round is compared per prompt
    (median ratio candidate / control) and reported, not gated: changing it is what a drafting
    candidate is for. Returns ``{"passed": bool, "reasons": [str], "prompts": {...}}``.
    """
    reasons: list[str] = []
    out: dict[str, dict] = {}
    for rec in records:
        pid = str(rec.get("prompt_id"))
        row: dict[str, Any] = {"first_diff": rec.get("first_diff")}
        if rec.get("first_diff") is not None:
            gap = rec.get("logit_gap_nat")
            row["logit_gap_nat"] = gap
            if not isinstance(gap, (int, float)) or not math.isfinite(gap):
                reasons.append(f"{pid}: outputs differ at token {rec['first_diff']} but no logit gap was measured")
            elif gap > tolerance_nat:
                reasons.append(
                    f"{pid}: outputs differ at token {rec['first_diff']} with a logit gap of "
                    f"{gap:.3g} nat > the {tolerance_nat:g} nat near-tie tolerance"
                )
        cl, ca = rec.get("control_lengths") or [], rec.get("candidate_lengths") or []
        if cl and ca:
            ml, mc = float(np.median(cl)), float(np.median(ca))
            row["length_ratio"] = mc / ml if ml else math.inf
            if ml == 0 or abs(mc / ml - 1) > length_tolerance:
                reasons.append(
                    f"{pid}: median output length {mc:g} (candidate) vs {ml:g} (control) "
                    f"differs by more than {length_tolerance:.0%}"
                )
        al, aa = rec.get("control_acceptance") or [], rec.get("candidate_acceptance") or []
        if al and aa:
            ma, mc = float(np.median(al)), float(np.median(aa))
            row["acceptance_control"], row["acceptance_candidate"] = ma, mc
        out[pid] = row
    return {
        "passed": not reasons,
        "reasons": reasons,
        "prompts": out,
        "tolerance_nat": tolerance_nat,
        "length_tolerance": length_tolerance,
    }


def decide(
    cells: list[dict],
    metric: str = "step_ms_p50",
    min_effect: float = DEFAULT_MIN_EFFECT,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    gate_records: list[dict] | None = None,
    tolerance_nat: float = 0.5,
    n_resamples: int = DEFAULT_RESAMPLES,
) -> Decision:
    """Apply WIN2 R3 to ``cells``; see the module doc. ``gate_records`` (drafting candidates):
    input of :func:`distributional_gate`; a failed gate makes the verdict INVALID.

    Raises ``Win2Error`` for an unknown metric or ``min_effect``/``alpha`` outside (0, 1).
    """
    if metric not in METRICS:
        raise Win2Error(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    if not (0 <= min_effect < 1) or not math.isfinite(min_effect):
        raise Win2Error(f"--min-effect must be a fraction in [0, 1), got {min_effect}")
    if not (0 < alpha < 1):
        raise Win2Error(f"--alpha must be in (0, 1), got {alpha}")
    d = Decision(verdict="INVALID", metric=metric, min_effect=min_effect, alpha=alpha, seed=seed)
    pairs, problems = pair_log_ratios(cells, metric)
    d.n_pairs = len(pairs)
    if problems:
        d.reasons = problems
        return d
    if not pairs:
        d.reasons = ["no complete pairs"]
        return d
    est = estimate(pairs, min_effect, alpha, seed, n_resamples)
    d.effect, d.ci, d.verdict = est.effect, est.ci, est.verdict
    d.reasons.extend(est.notes)
    d.reasons.append(
        f"overall: effect {est.effect:+.4f}, {1 - alpha:.0%} CI [{est.ci[0]:+.4f}, {est.ci[1]:+.4f}] "
        f"({est.method}; {est.n_pairs} pairs, {est.n_blocks} blocks, {est.n_prompts} prompts) "
        f"vs +-{min_effect:g}: {est.verdict}"
    )
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for p in pairs:
        by_cat[p["category"]].append(p)
    raw = {cat: estimate(by_cat[cat], min_effect, alpha, seed, n_resamples) for cat in sorted(by_cat)}
    adjusted = holm_categories(by_cat, min_effect, alpha, seed, n_resamples, raw)
    regressed = []
    for cat in sorted(by_cat):
        e, level = adjusted[cat]
        doc = e.to_dict()
        doc["alpha_adjusted"] = level
        doc["correction"] = "holm"
        doc["descriptive"] = {"verdict_unadjusted": raw[cat].verdict, "ci": list(raw[cat].ci), "alpha": alpha}
        d.categories[cat] = doc
        if raw[cat].verdict == "LOSS":  # unadjusted CI wholly below -min_effect: fails safe
            regressed.append(cat)
    d.category_correction = {"method": "holm", "family_alpha": alpha, "n_categories": len(by_cat)}
    if d.verdict == "WIN" and regressed:
        d.verdict = "UNRESOLVED"
        d.reasons.append(
            f"non-inferiority failed: category {', '.join(regressed)} lies wholly below "
            f"-{min_effect:g}; the overall WIN becomes UNRESOLVED"
        )
    if gate_records is not None:
        d.gate = distributional_gate(gate_records, tolerance_nat)
        if not d.gate["passed"]:
            d.verdict = "INVALID"
            d.reasons.append("distributional gate failed: " + "; ".join(d.gate["reasons"]))
    return d


def holm_categories(
    by_cat: dict[str, list[dict]],
    min_effect: float,
    alpha: float,
    seed: int,
    n_resamples: int = DEFAULT_RESAMPLES,
    unadjusted: dict[str, Estimate] | None = None,
) -> dict[str, tuple[Estimate, float]]:
    """Holm step-down over the categories' verdicts (module doc, rule 7).

    ``by_cat``: category -> its pairs (``pair_log_ratios`` output). Returns category ->
    (``Estimate`` at the level where it resolved or, if it never did, at the last level tried;
    that level's alpha). The family-wise error of the verdicts is at most ``alpha``.
    ``unadjusted``: estimates already made at ``alpha`` (reused when one category is left)."""
    open_cats = sorted(by_cat)
    out: dict[str, tuple[Estimate, float]] = {}
    while open_cats:
        level = alpha / len(open_cats)
        ests = {
            c: (
                unadjusted[c]
                if unadjusted and c in unadjusted and level == alpha
                else estimate(by_cat[c], min_effect, level, seed, n_resamples)
            )
            for c in open_cats
        }
        resolved = [c for c in open_cats if ests[c].verdict != "UNRESOLVED"]
        for c in resolved or open_cats:
            out[c] = (ests[c], level)
        if not resolved:
            break
        open_cats = [c for c in open_cats if c not in resolved]
    return out
