"""Group advantage estimators (distrl.core.advantages) against hand arithmetic."""

from __future__ import annotations

import math

import pytest

from distrl.core.advantages import group_advantages


def test_grpo_by_hand():
    # mean 0.5, population std 0.5 -> (r - 0.5) / (0.5 + 1e-6) = +-0.999998
    assert group_advantages([1, 0, 0, 1], "grpo") == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert group_advantages([1, 0, 0, 1], "grpo", eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    # [3, 1, 2]: mean 2, population std sqrt(2/3) -> (+-1) * sqrt(3/2) = +-1.224745
    assert group_advantages([3, 1, 2], "grpo", eps=0.0) == pytest.approx([math.sqrt(1.5), -math.sqrt(1.5), 0.0])
    # one right of four: mean .25, std sqrt(3)/4 -> .75/.4330 = 1.7321, -.25/.4330 = -.57735
    assert group_advantages([0, 1, 0, 0], "grpo", eps=0.0) == pytest.approx([-1 / math.sqrt(3), math.sqrt(3),
                                                                             -1 / math.sqrt(3), -1 / math.sqrt(3)])


def test_pg_by_hand():
    assert group_advantages([1, 0, 0, 1], "pg") == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3, 1, 2], "pg") == [1.0, -1.0, 0.0]


def test_dr_grpo_by_hand_no_std_normalization():
    # Dr.GRPO: r - mean(r), no division by the std: [1, 0, 0, 0] -> mean .25 -> [.75, -.25, -.25, -.25]
    assert group_advantages([1, 0, 0, 0], "dr_grpo") == [0.75, -0.25, -0.25, -0.25]
    # a group of nearly equal rewards keeps its small advantages (GRPO would blow them up to +-1)
    assert group_advantages([0.5, 0.51], "dr_grpo") == pytest.approx([-0.005, 0.005])
    assert group_advantages([0.5, 0.51], "grpo") == pytest.approx([-1.0, 1.0], abs=1e-3)


def test_grpo_advantages_have_mean_0_and_unit_population_variance():
    adv = group_advantages([0.2, 0.9, 0.4, 0.4, 0.1], "grpo", eps=0.0)
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)
    assert sum(a * a for a in adv) / len(adv) == pytest.approx(1.0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "pg"])
@pytest.mark.parametrize("rewards", [[1, 1, 1, 1], [0, 0], [0.1, 0.1, 0.1], [0.7]])
def test_equal_rewards_give_exact_zeros(estimator, rewards):
    assert group_advantages(rewards, estimator) == [0.0] * len(rewards)


def test_errors():
    with pytest.raises(ValueError, match="estimator"):
        group_advantages([1, 0], "rloo")
    with pytest.raises(ValueError, match="at least one"):
        group_advantages([], "grpo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1, float("nan")], "pg")
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1, 0], "grpo", eps=-1)
