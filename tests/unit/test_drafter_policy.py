"""Depth policy and respawn budget."""

from __future__ import annotations

import pytest

from dsv41.drafter.policy import DepthPolicy, RespawnBudget
from dsv41.errors import ConfigError


def test_default_policy_shrinks_with_batch():
    p = DepthPolicy.parse(None, 5)
    assert [p.depth(b) for b in (1, 2, 3, 4, 5, 8, 9, 100)] == [5, 4, 3, 3, 2, 2, 1, 1]
    assert DepthPolicy.parse(None, 3).depth(1) == 3  # capped by k
    assert p.apply(2, [5, 1, 0]) == [4, 1, 0]
    assert DepthPolicy.parse("2:3", 5).depth(3) == 0  # no '*' step: beyond the last -> 0
    assert str(DepthPolicy.parse("1:2,*:1", 4)) == "1:2,*:1 (k=4)"


@pytest.mark.parametrize("bad", ["1", "a:b", "2:3,1:2", "*:1,4:2", "1:-1", "1:99"])
def test_bad_policies(bad):
    with pytest.raises(ConfigError):
        DepthPolicy.parse(bad, 5)
    with pytest.raises(ConfigError):
        DepthPolicy.parse(None, -1)


def test_respawn_budget_window_and_stays_down():
    b = RespawnBudget(2, 10.0)
    assert b.allow(0.0) and b.allow(1.0)
    assert not b.allow(2.0)  # third in the window -> refused
    assert b.exhausted and not b.allow(100.0)  # and it stays down
    b2 = RespawnBudget(2, 10.0)
    assert b2.allow(0.0) and b2.allow(1.0) and b2.allow(11.5)  # the first one left the window
    assert not RespawnBudget(0, 1.0).allow(0.0)
    with pytest.raises(ConfigError):
        RespawnBudget(1, 0)
