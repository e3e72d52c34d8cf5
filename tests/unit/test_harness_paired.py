"""dsv41.harness.paired: the median of paired differences, its 95 % intervals and the decision."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dsv41.errors import Dsv41Error
from dsv41.harness.paired import decide, median_interval


@pytest.mark.parametrize("n", [6, 7, 10, 20, 40, 41, 100])
def test_order_interval_takes_the_binomial_ranks(n: int) -> None:
    x = np.random.default_rng(n).normal(0.05, 0.2, n)
    res = median_interval(x)
    xs = np.sort(x)
    lo_rank = xs.tolist().index(res["order_ci"][0]) + 1  # 1-based rank k of the lower end
    # k is the largest rank with P(B < k) <= 2.5 %, and the upper end is rank n - k + 1
    assert stats.binom.cdf(lo_rank - 1, n, 0.5) <= 0.025 < stats.binom.cdf(lo_rank, n, 0.5)
    assert res["order_ci"][1] == xs[n - lo_rank]
    assert res["order_ci"][0] <= res["median"] <= res["order_ci"][1]
    assert res["bootstrap_ci"][0] <= res["median"] <= res["bootstrap_ci"][1]
    assert res["median"] == pytest.approx(float(np.median(x)))


def test_n40_uses_ranks_14_and_27() -> None:
    # the tabulated distribution-free 95 % interval of the median for n = 40 (Conover, table A3)
    x = np.arange(1.0, 41.0)
    assert median_interval(x)["order_ci"] == [14.0, 27.0]


def test_too_few_rounds_give_no_order_interval_and_no_decision() -> None:
    res = median_interval([0.01, 0.02, 0.03, 0.04, 0.05])
    assert res["order_ci"] is None and decide(res, 0.1) == "undecided"


@pytest.mark.parametrize(("shift", "want"), [(-0.5, "met"), (0.1, "undecided"), (0.7, "not met")])
def test_decide_claims_only_what_the_interval_excludes(shift: float, want: str) -> None:
    x = np.random.default_rng(5).permutation(np.linspace(-0.05, 0.05, 40)) + shift  # median = shift
    assert decide(median_interval(x), 0.1) == want


def test_constant_differences_give_a_point_interval() -> None:
    res = median_interval([0.2] * 10)
    assert res["order_ci"] == [0.2, 0.2] and res["bootstrap_ci"] == [0.2, 0.2]
    assert decide(res, 0.1) == "not met"


@pytest.mark.parametrize("bad", [[], [0.1, float("nan")], [float("inf")] * 7])
def test_no_or_non_finite_differences_are_one_clear_error(bad: list) -> None:
    with pytest.raises(Dsv41Error, match="finite difference"):
        median_interval(bad)


@pytest.mark.parametrize("level", [0.0, 1.0, -0.5, 1.5])
def test_a_level_outside_0_1_is_refused(level: float) -> None:
    with pytest.raises(Dsv41Error, match="not in"):
        median_interval([0.1] * 10, level)
