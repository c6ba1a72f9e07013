"""The adaptive staleness bound (``--max_staleness auto[:CEILING]``): a controller that moves the bound the buffer
enforces between 0 and a ceiling, from off-policy signals the learner already measures at each version.

Signals (per version, token means over the whole version's batch, all ranks averaged so every rank agrees):

| name | metric | what it measures | band: flag (default) |
|---|---|---|---|
| kl | ``learner/kl_behavior_learner_k3`` | k3 of KL(behavior mu, learner pi), nats/token | kl_max (0.02) |
| spread | ``learner/logprob_mismatch_mean_abs`` | mean abs(log pi/mu), the ratios' spread | spread_max (0.2) |
| clip | ``learner/clip_fraction`` | tokens whose clipped PPO/GRPO term wins | clip_max (0.2) |

The flags are ``--staleness_kl_max``, ``--staleness_spread_max`` and ``--staleness_clip_max``.

Rule (additive increase, multiplicative decrease, as TCP's congestion window, Chiu & Jain 1989): the bound starts
at 0 (on-policy); after ``--staleness_patience`` consecutive versions with every measured signal at or below its
band, it rises by 1 (up to the ceiling) and the count restarts; as soon as one version has any signal above its
band, the bound halves at once (``bound // 2``) and the count restarts. A version without any of the signals (a
skipped step, a loss that reports none) leaves bound and count as they are; a signal a loss does not report
(``clip_fraction`` under ``--learner pg``) is left out of the test.

Sources: a staleness bound enforced at generation time (credits) and at training time is AReaL's (Fu et al.
2025, arXiv:2505.24298, "staleness-aware" asynchronous RL, its eta); AReaL fixes it, here it moves. The KL band
is the trust-region argument of TRPO (Schulman et al. 2015, arXiv:1502.05477: the surrogate objective bounds
the true improvement while KL(old || new) stays below delta, 0.01-0.02 per token in practice) and PPO's clip
range (Schulman et al. 2017, arXiv:1707.06347: a clip fraction above ~0.2 means the data has left the region
where the ratio-clipped surrogate is informative). Stale data widens exactly these quantities, as the
behavior policy mu falls further behind pi, so they are what the bound answers to.
"""

from __future__ import annotations

from dataclasses import dataclass

SIGNALS = {"kl": "learner/kl_behavior_learner_k3", "spread": "learner/logprob_mismatch_mean_abs",
           "clip": "learner/clip_fraction"}  # signal name -> the learner metric it reads


@dataclass(frozen=True)
class StalenessBand:
    """The in-band limits of the signals (module docstring) and the patience before a raise."""

    kl_max: float = 0.02
    spread_max: float = 0.2
    clip_max: float = 0.2
    patience: int = 3

    def __post_init__(self) -> None:
        for name in ("kl_max", "spread_max", "clip_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--staleness_{name} must be > 0, got {getattr(self, name)}")
        if self.patience < 1:
            raise ValueError(f"--staleness_patience must be >= 1, got {self.patience}")

    def limit(self, signal: str) -> float:
        return getattr(self, f"{signal}_max")


class StalenessController:
    """Moves the staleness bound between 0 and ``ceiling`` (module docstring: the rule and its sources).

    Args:
        ceiling: the largest bound (>= 0), in versions.
        band: the signals' limits and the patience.
        initial: the bound at the start (default 0, on-policy); clipped to [0, ceiling].
    ``bound`` is the bound in force for the next version; ``calm`` counts consecutive in-band versions.
    """

    def __init__(self, ceiling: int, band: StalenessBand | None = None, initial: int = 0) -> None:
        if ceiling < 0:
            raise ValueError(f"ceiling must be >= 0, got {ceiling}")
        self.ceiling, self.band = ceiling, band or StalenessBand()
        self.bound = min(max(initial, 0), ceiling)
        self.calm = 0

    def out_of_band(self, stats: dict[str, float]) -> list[str] | None:
        """The signals of ``stats`` (learner metrics by tag) above their limit; None when none is measured."""
        measured = {name: stats[tag] for name, tag in SIGNALS.items() if tag in stats}
        if not measured:
            return None
        return [name for name, value in measured.items() if value > self.band.limit(name)]

    def update(self, stats: dict[str, float]) -> int:
        """Take one version's metrics; returns the bound for the next version (module docstring's rule)."""
        out = self.out_of_band(stats)
        if out is None:
            return self.bound
        if out:
            self.bound, self.calm = self.bound // 2, 0
            return self.bound
        self.calm += 1
        if self.calm >= self.band.patience and self.bound < self.ceiling:
            self.bound, self.calm = self.bound + 1, 0
        return self.bound

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps (resume restores the bound and the count)."""
        return {"bound": self.bound, "calm": self.calm}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.bound = min(max(int(state["bound"]), 0), self.ceiling)
        self.calm = int(state.get("calm", 0))
