"""Learner-state baselines for REINFORCE (``--learner pg --pg_baseline running_mean``).

Williams (1992) allows any baseline that does not depend on the action; the group mean (computed by
the actor, ``distrl.core.advantages``) needs several completions of one prompt, a running mean of the reward
does not. The value is kept by every learner rank and updated from the all-reduced mean reward of the
version's whole batch, so all ranks hold the same baseline.
"""

from __future__ import annotations

from typing import Optional


class RunningMeanBaseline:
    """``A_i = r_i - b``; after each version ``b <- decay * b + (1 - decay) * mean reward of the batch``.

    Before the first update ``b`` is the first batch's own mean (a batch-mean baseline for version 0).
    Units: reward units. ``decay`` in [0, 1) (ValueError otherwise).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.value: Optional[float] = None

    def advantages(self, rewards: list[float], batch_mean: float) -> list[float]:
        """Advantages of this rank's ``rewards``; ``batch_mean`` is the whole version's mean reward."""
        b = batch_mean if self.value is None else self.value
        return [r - b for r in rewards]

    def update(self, batch_mean: float) -> None:
        """Fold the version's mean reward (all learners) into the baseline."""
        self.value = batch_mean if self.value is None else self.decay * self.value + (1 - self.decay) * batch_mean

    def state_dict(self) -> dict:
        return {"decay": self.decay, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.value = float(state["decay"]), state["value"]
