"""Calibration of the WIN2 rule by simulated windows: a log-normal noise model (measured from an
A/A window's cells or given), whole windows drawn from it and decided by the full rule
(:func:`dsv41.harness.win2.decide`), the false-WIN rate and the minimum detectable effect per
pair count (``dsv41 window simulate``; docs/windows.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dsv41.harness.win2 import DEFAULT_ALPHA, DEFAULT_MIN_EFFECT, METRICS, VERDICTS, Win2Error, decide, pair_log_ratios


@dataclass(frozen=True)
class NoiseModel:
    """Log-normal noise of one timed cell: ``log(metric) = prompt_base + drift * t + e``,
    ``e ~ N(0, sigma)`` per cell (``sigma`` in natural-log units, i.e. ~ the coefficient of
    variation), ``drift`` a linear trend per cell index within a window (what ABBA cancels).
    ``source`` says where ``sigma`` came from (a measured A/A run or docs/benchmarks.md)."""

    sigma: float
    drift: float = 0.0
    source: str = "given"


def sigma_from_cells(cells: list[dict], metric: str) -> float:
    """Per-cell log-noise ``sigma`` estimated from an A/A window's cells: the robust SD (1.4826 x
    MAD, the normal-consistent constant) of the pair log-ratios divided by sqrt(2), since a
    log-ratio is the difference of two cells. Raises Win2Error with fewer than 4 complete pairs."""
    pairs, problems = pair_log_ratios(cells, metric)
    if len(pairs) < 4:
        raise Win2Error(
            f"need at least 4 complete pairs to estimate noise, got {len(pairs)}"
            + (f" ({problems[0]})" if problems else "")
        )
    r = np.array([p["r"] for p in pairs])
    mad = float(np.median(np.abs(r - np.median(r))))
    return 1.4826 * mad / math.sqrt(2)


def simulate_cells(
    rng: np.random.Generator,
    n_pairs: int,
    n_prompts: int,
    effect: float,
    noise: NoiseModel,
    metric: str = "step_ms_p50",
) -> list[dict]:
    """One simulated window: ``n_pairs`` pairs over ``n_prompts`` prompts (two categories),
    blocks of two pairs in seeded ABBA/BAAB order; the candidate better by ``effect`` (fraction).
    ``n_pairs`` must be a multiple of ``2 * n_prompts``."""
    if n_pairs % (2 * n_prompts):
        raise Win2Error(f"pairs ({n_pairs}) must be a multiple of 2 x prompts ({2 * n_prompts})")
    blocks = n_pairs // (2 * n_prompts)
    base = rng.uniform(math.log(20), math.log(60), n_prompts)
    order = [(p, b) for p in range(n_prompts) for b in range(blocks)]
    rng.shuffle(order)
    cells, t = [], 0
    lower = METRICS[metric] == "lower"
    shift = -math.log1p(effect) if lower else math.log1p(effect)
    for bi, (p, _b) in enumerate(order):
        seq = (
            ("control", "candidate", "candidate", "control")
            if rng.random() < 0.5
            else ("candidate", "control", "control", "candidate")
        )
        for k, arm in enumerate(seq):
            v = base[p] + noise.drift * t + rng.normal(0.0, noise.sigma) + (shift if arm == "candidate" else 0.0)
            t += 1
            cells.append(
                {
                    "block": bi,
                    "pair": k // 2,
                    "arm": arm,
                    "prompt_id": f"p{p}",
                    "category": "short" if p % 2 else "code",
                    "seed": 1000 * bi + k // 2,
                    "ok": True,
                    metric: math.exp(v),
                }
            )
    return cells


def simulate(
    noise: NoiseModel,
    pair_counts=(32, 64, 128),
    n_windows: int = 400,
    n_prompts: int = 4,
    metric: str = "step_ms_p50",
    min_effect: float = DEFAULT_MIN_EFFECT,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    n_resamples: int = 1999,
    power: float = 0.8,
    effects=(0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.10, 0.15, 0.20, 0.30, 0.40, 0.50, 0.75),
    progress=None,
) -> dict:
    """A/A and known-effect windows through the full rule (``decide``, categories included).

    Returns ``{"noise": {...}, "rows": [{"n_pairs", "false_win_rate", "false_win_ci95", "aa_verdicts",
    "mde", "power_at_mde"}]}``: ``false_win_rate`` is the fraction of A/A windows decided WIN
    (its 95 % Clopper-Pearson interval beside it); ``mde`` the smallest effect of ``effects``
    decided WIN in at least ``power`` of ``n_windows // 4`` windows (None when none reaches it).
    ``progress(n)``: optional callback advanced once per simulated window.
    """
    from scipy import stats

    rng = np.random.default_rng(seed)
    rows = []
    for n in pair_counts:
        counts = {v: 0 for v in VERDICTS}
        for _ in range(n_windows):
            d = decide(
                simulate_cells(rng, n, n_prompts, 0.0, noise, metric),
                metric,
                min_effect,
                alpha,
                int(rng.integers(1 << 31)),
                n_resamples=n_resamples,
            )
            counts[d.verdict] += 1
            if progress:
                progress(1)
        k = counts["WIN"]
        ci = stats.binomtest(k, n_windows).proportion_ci(0.95, method="exact")
        mde, p_at = None, None
        k_eff = max(20, n_windows // 4)
        for eff in effects:
            wins = 0
            for _ in range(k_eff):
                d = decide(
                    simulate_cells(rng, n, n_prompts, eff, noise, metric),
                    metric,
                    min_effect,
                    alpha,
                    int(rng.integers(1 << 31)),
                    n_resamples=n_resamples,
                )
                wins += d.verdict == "WIN"
                if progress:
                    progress(1)
            if wins / k_eff >= power:
                mde, p_at = eff, wins / k_eff
                break
        rows.append(
            {
                "n_pairs": n,
                "false_win_rate": k / n_windows,
                "false_win_ci95": [ci.low, ci.high],
                "aa_verdicts": counts,
                "mde": mde,
                "power_at_mde": p_at,
                "windows_per_effect": k_eff,
            }
        )
    return {
        "noise": {"sigma": noise.sigma, "drift": noise.drift, "source": noise.source},
        "n_windows": n_windows,
        "n_prompts": n_prompts,
        "metric": metric,
        "min_effect": min_effect,
        "alpha": alpha,
        "power": power,
        "seed": seed,
        "n_resamples": n_resamples,
        "rows": rows,
    }
