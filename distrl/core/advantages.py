"""Group advantage estimators: pure functions of one group's rewards (no torch).

A rollout actor calls :func:`group_advantages` once a group of n completions of one prompt is complete,
before it PUTs the group, so the buffer can select completions by ``|advantage|`` and the learner never
recomputes them (DESIGN.md, "Groups and top-k").

- ``grpo``: ``A_i = (r_i - mean(r)) / (std(r) + eps)``, the outcome-supervision advantage of GRPO
  (Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
  Models", arXiv:2402.03300, §4.1.2). The paper writes ``std`` without fixing the estimator. We use
  the population standard deviation (ddof=0): the group is the whole set being normalized, so its
  advantages have mean 0 and (up to eps) variance 1, and rewards {1, 0, 0, 1} give {1, -1, -1, 1}.
  (TRL's GRPOTrainer takes torch's default, ddof=1, which shrinks advantages by sqrt((n-1)/n).)
- ``dr_grpo``: ``A_i = r_i - mean(r)``, Dr.GRPO's advantage (Liu et al. 2025, "Understanding
  R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783, §3.2): GRPO's without the division
  by the group std, which up-weights groups of nearly equal rewards (too easy or too hard prompts).
- ``pg``: ``A_i = r_i - mean(r)``, REINFORCE with the group mean as baseline (no scaling); the same
  numbers as ``dr_grpo``, kept as its own name because the losses differ (``distrl.learn.losses``).

A group whose rewards are all equal carries no signal: every advantage is exactly 0.0 (no NaN, and no
``1e-17 / eps`` noise from rounding in the mean).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np

ESTIMATORS = ("grpo", "dr_grpo", "pg")


def group_advantages(rewards: Sequence[float], estimator: Literal["grpo", "dr_grpo", "pg"] = "grpo",
                     eps: float = 1e-6) -> list[float]:
    """Advantages of one group's completions, in the order of `rewards`.

    Args:
        rewards: the group's rewards (reward units; any length >= 1).
        estimator: ``grpo`` (mean-centered, divided by population std + eps), ``dr_grpo`` or ``pg``
            (mean-centered only).
        eps: added to the std in ``grpo`` (reward units), guarding tiny non-zero spreads.

    Raises:
        ValueError: unknown `estimator`, an empty group, a non-finite reward, or `eps` < 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if len(rewards) == 0:
        raise ValueError("a group needs at least one reward")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite, got {list(rewards)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = np.asarray(rewards, dtype=np.float64)  # (n,)
    if r.max() == r.min():
        return [0.0] * len(r)
    centered = r - r.mean()
    if estimator in ("pg", "dr_grpo"):
        return centered.tolist()
    return (centered / (r.std(ddof=0) + eps)).tolist()
