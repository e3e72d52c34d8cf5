"""The median of paired per-round differences with a 95 % interval, and the decision it gives
against a target (the overlay's step benchmark: overlay minus vLLM's UVA path, ms per step).

Two intervals of the median, both from scipy:
- the distribution-free order-statistic interval: ``[x_(k), x_(n-k+1)]`` of the sorted
  differences with ``k`` the largest count such that ``P(Binomial(n, 1/2) < k) <= (1-level)/2``
  (Conover, *Practical Nonparametric Statistics*, 3rd ed., section 3.2); it needs n >= 6 for a
  95 % level, else it is None;
- a percentile bootstrap (``scipy.stats.bootstrap``, 9,999 resamples, fixed seed).

``decide``: "met" when the order-statistic interval's upper end is at or below the target, "not
met" when its lower end is above it, else "undecided": a claim is made only when the interval
excludes the other side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsv41.errors import Dsv41Error


def median_interval(diffs: Sequence[float], level: float = 0.95) -> dict:
    """``{"n", "median", "order_ci", "bootstrap_ci", "level"}`` of ``diffs`` (floats, any
    unit; intervals as ``[lo, hi]`` in that unit, ``order_ci`` None when n is too small for
    ``level``). Raises Dsv41Error for no differences, a non-finite one, or ``level`` outside
    (0, 1)."""
    from scipy import stats

    x = np.sort(np.asarray(list(diffs), dtype=float))
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise Dsv41Error("median_interval needs at least one finite difference")
    if not 0.0 < level < 1.0:
        raise Dsv41Error(f"median_interval: level {level} is not in (0, 1)")
    n, alpha = int(x.size), (1.0 - level) / 2
    # k = largest count with P(B < k) = cdf(k - 1) <= alpha; 0 when even k = 1 exceeds it
    k = int(stats.binom.ppf(alpha, n, 0.5))
    while k > 0 and stats.binom.cdf(k - 1, n, 0.5) > alpha:
        k -= 1
    while stats.binom.cdf(k, n, 0.5) <= alpha:
        k += 1
    order = [float(x[k - 1]), float(x[n - k])] if k >= 1 else None
    boot = None
    if n >= 2 and x[0] != x[-1]:
        res = stats.bootstrap(
            (x,),
            np.median,
            confidence_level=level,
            n_resamples=9999,
            method="percentile",
            random_state=np.random.default_rng(23),
        )
        boot = [float(res.confidence_interval.low), float(res.confidence_interval.high)]
    elif n >= 2:
        boot = [float(x[0]), float(x[0])]
    return {"n": n, "median": float(np.median(x)), "order_ci": order, "bootstrap_ci": boot, "level": level}


def decide(interval: dict, target: float) -> str:
    """ "met" / "not met" / "undecided" for "the median is at most ``target``" from
    ``median_interval``'s ``order_ci`` ("undecided" when there is none)."""
    ci = interval.get("order_ci")
    if ci is None:
        return "undecided"
    if ci[1] <= target:
        return "met"
    if ci[0] > target:
        return "not met"
    return "undecided"
