"""Acceptance 2 of issue 4: reward rises at max_staleness 0, 2 and 4 with the decoupled correction.

Slow (about 3 minutes on 2 cores); bench/staleness.py is the full experiment recorded in
docs/staleness.md. The margin is that of test_train.py::test_policy_improvement_half_vocab (0.08 is over
6 standard deviations of the difference an unchanged policy would show with 64 completions of 16 tokens).
"""

from __future__ import annotations

import pytest

from bench import staleness


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 2, 4])
def test_reward_rises_on_stale_data(max_staleness, tmp_path):
    result = staleness.run_one(max_staleness, "decoupled", 20, tmp_path)
    c = result["curves"]
    print(f"\nmax_staleness {max_staleness}: reward " + " ".join(f"{v:.3f}" for v in c["reward_mean"]))
    assert len(c["reward_mean"]) == 20
    assert max(c["staleness_mean"]) == max_staleness  # the data really was that stale
    assert staleness.rise(c["reward_mean"]) > 0.08
