"""Policy-gradient losses: pure functions of tensors returning ``(loss, metrics)``.

Shapes and units (the same for every function here):

- ``logprobs``: (B, T) float32, learner log-probabilities (nats) of the sampled tokens, after the
  sampling temperature (see ``distrl.learn.logprobs.token_logprobs``); carries the graph.
- ``behavior_logprobs``: (B, T) float32, the actor's (vLLM's ``processed_logprobs``) log-probabilities
  of the same tokens under the policy version that generated them. Never differentiated.
- ``proximal_logprobs``: (B, T) float32, the learner's logprobs at consumption (``distrl.learn.offpolicy``);
  default ``logprobs.detach()``. ``ref_logprobs``: (B, T) float32, the reference policy's logprobs
  (the model with its LoRA adapter disabled, or a frozen copy), needed only with a KL term.
- ``advantages``: (B,) float32, one per completion, already baselined (group mean subtracted,
  optionally group-std normalized) when the group was complete, or by a learner-state baseline.
- ``mask``: (B, T) float32, 1.0 on completion tokens, 0.0 on prompt and padding.

Per-token objective (i sequence, t token, w the off-policy weight, detached):

- ``pg``: REINFORCE with a baseline (Williams 1992): ``l_it = -w_it * A_i * logp_it``.
- ``grpo``: the PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with GRPO's advantages
  (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300):
  ``l_it = -w_it * min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)``,
  ``r_it = exp(logp_it - old_it)``; ``old`` is mu (``off_policy=none``) or pi_prox (``tis``,
  ``decoupled``). ``eps_low != eps_high`` is DAPO's asymmetric "clip-higher" (Yu et al. 2025,
  arXiv:2503.14476).
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783) is ``grpo``
  with advantages that are not std-normalized (``distrl.core.advantages``, estimator ``dr_grpo``) and the
  ``sequence-mean-token-sum-norm`` aggregation (no length normalization); it is a configuration of the
  functions here, not another formula.
- KL to the reference, added per token when ``kl_coef > 0`` (GRPO's beta * D_KL(pi || pi_ref)),
  with Schulman's estimators ("Approximating KL divergence", 2020), ``d = ref - logp``:
  k1 ``= -d``, k2 ``= d^2 / 2``, k3 ``= exp(d) - d - 1`` (GRPO's and TRL's choice). The KL term is not
  importance-weighted or band-masked (as in TRL).

Aggregation (:class:`Normalizer`; N_tok, N_seq and C are constants of the WHOLE policy version's batch,
summed over micro-batches and all-reduced across learners, ``T_i = sum_t m_it``):

- ``token-mean``:                   ``L = sum_{i,t} m_it l_it / N_tok``
  (DAPO; TRL ``loss_type="dapo"`` and, on one process, ``"bnpo"``).
- ``sequence-mean-token-mean``:     ``L = (1 / N_seq) sum_i (sum_t m_it l_it / T_i)``
  (the GRPO paper; TRL ``"grpo"``). A sequence with T_i = 0 contributes 0 but counts in N_seq.
- ``sequence-mean-token-sum-norm``: ``L = (1 / N_seq) sum_i (sum_t m_it l_it / C)``, C a constant
  token count (Dr.GRPO: the generation budget, ``--max_new_tokens``; TRL ``"dr_grpo"`` with
  ``max_completion_length = C``).

Every mode is a sum over sequences with global constants, so the sum of micro-batch losses (and
gradients) equals the full-batch loss, and L learners equal one learner on the union batch when their
gradients are all-reduced with a SUM (each learner's loss is already its share of the global value; an
all-reduce AVG would have to be multiplied by L).

Padding positions may hold anything (even -inf): inputs are masked with ``torch.where`` before any
arithmetic, so nothing from padding reaches the loss or the gradient. A batch with no completion
tokens gives loss 0 that still has a graph (``backward()`` works and yields zero gradients).

Metrics are python floats (0-dim device tensors with ``sync=False``) over masked tokens of THIS call only (the
learner weights them by ``masked_tokens`` to combine micro-batches): ``clip_fraction`` (+ ``_low``/``_high``)
and ``ratio_*`` of r (GRPO), the ``is_*``/``band_masked_fraction`` of ``distrl.learn.offpolicy.correction``,
``kl_ref`` (the chosen estimator's mean) with a reference, and:

- ``logprob_mismatch_mean_abs`` / ``logprob_mismatch_max_abs``: |logp - behavior_logp|, in nats.
- ``kl_behavior_learner_k3``: k3 of KL(behavior || learner). Tokens are sampled from the behavior
  policy mu, so with r = pi/mu = exp(logp - behavior_logp), k3 = r - 1 - log r >= 0 is an unbiased,
  low-variance estimate of KL(mu || pi).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from distrl.learn.offpolicy import OffPolicyConfig, correction
from distrl.learn.tensor_metrics import TensorMetrics, masked_stats, to_floats

Metrics = dict[str, float]
AGGREGATIONS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOSSES = ("pg", "grpo")


@dataclass(frozen=True)
class Normalizer:
    """The global constants of one policy version's batch (see the module docstring).

    Attributes:
        mode: one of AGGREGATIONS.
        num_tokens: N_tok, completion tokens in the whole batch (all micro-batches, all learners).
        num_sequences: N_seq, completions in the whole batch.
        norm_tokens: C, the constant of ``sequence-mean-token-sum-norm`` (tokens; unused otherwise).
    """

    mode: Literal["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"]
    num_tokens: float
    num_sequences: float
    norm_tokens: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.mode!r}")
        if not self.norm_tokens > 0:
            raise ValueError(f"norm_tokens must be > 0, got {self.norm_tokens}")


@dataclass(frozen=True)
class LossConfig:
    """Which objective: ``kind`` pg|grpo, GRPO's clip, KL term, off-policy correction."""

    kind: Literal["pg", "grpo"] = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.kind!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")


def aggregate(per_token: torch.Tensor, keep: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar by ``norm.mode``; padding never enters the sum."""
    masked = torch.where(keep, per_token, torch.zeros_like(per_token))
    n_seq = max(float(norm.num_sequences), 1.0)
    if norm.mode == "token-mean":
        return masked.sum() / max(float(norm.num_tokens), 1.0)
    if norm.mode == "sequence-mean-token-mean":
        lengths = keep.sum(dim=1).clamp(min=1).to(masked.dtype)  # (B,)
        return (masked.sum(dim=1) / lengths).sum() / n_seq
    return masked.sum() / (n_seq * float(norm.norm_tokens))


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from logp (graph) and ref (constant), (B, T)."""
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d  # k3 = exp(d) - 1 - d >= 0


def _check(logprobs, advantages, mask, *others) -> None:
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs and mask must be (B, T) of one shape, got "
                         f"{tuple(logprobs.shape)} and {tuple(mask.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be (B,)={tuple(logprobs.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    for name, t in others:
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} must be {tuple(logprobs.shape)}, got {tuple(t.shape)}")


@torch.no_grad()
def _mismatch_metrics(logp: torch.Tensor, behavior: torch.Tensor, keep: torch.Tensor,
                      count: torch.Tensor) -> TensorMetrics:
    """Behavior-vs-learner gap over kept tokens (inputs already masked to finite values); 0.0 when none."""
    diff = logp - behavior  # log r, (B, T); 0 off the kept tokens
    mean_abs, max_abs, _ = masked_stats(diff.abs(), keep, count, 0.0)
    k3, _, _ = masked_stats(torch.expm1(diff) - diff, keep, count, 0.0)  # r - 1 - log r, r = exp(logp - behavior)
    return {"logprob_mismatch_mean_abs": mean_abs, "logprob_mismatch_max_abs": max_abs,
            "kl_behavior_learner_k3": k3}


@torch.no_grad()
def _clip_metrics(ratio: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor, count: torch.Tensor,
                  cfg: LossConfig) -> TensorMetrics:
    """Tokens whose clipped term wins the min (their gradient is zero), and ratio statistics; fractions
    0.0 and ratios 1.0 when no token is kept."""
    a = adv.expand_as(ratio)
    low = keep & (a < 0) & (ratio < 1.0 - cfg.clip_eps_low)
    high = keep & (a > 0) & (ratio > 1.0 + cfg.clip_eps_high)
    n = count.clamp(min=1)
    mean, hi, lo = masked_stats(ratio, keep, count, 1.0)
    return {"clip_fraction": (low | high).sum() / n, "clip_fraction_low": low.sum() / n,
            "clip_fraction_high": high.sum() / n, "ratio_mean": mean, "ratio_max": hi, "ratio_min": lo}


def policy_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, norm: Normalizer, cfg: LossConfig = LossConfig(),
                proximal_logprobs: Optional[torch.Tensor] = None,
                ref_logprobs: Optional[torch.Tensor] = None, sync: bool = True) -> tuple[torch.Tensor, Metrics]:
    """The configured objective (module docstring) for one micro-batch; returns ``(loss, metrics)``.

    Args: shapes and units in the module docstring; ``norm`` the version-global normalizer, ``cfg``
    the objective. ``sync=False`` leaves the metrics as 0-dim tensors on the device (no host sync; the
    learner converts a whole step's with ``distrl.learn.tensor_metrics.to_floats``). Raises ValueError on mismatched
    shapes, or when ``cfg.kl_coef > 0`` and ``ref_logprobs`` is None.
    """
    _check(logprobs, advantages, mask, ("behavior_logprobs", behavior_logprobs),
           ("proximal_logprobs", proximal_logprobs), ("ref_logprobs", ref_logprobs))
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("a KL term (kl_coef > 0) needs ref_logprobs")
    keep = mask > 0
    zeros = torch.zeros_like(logprobs, dtype=torch.float32)
    logp = torch.where(keep, logprobs.float(), zeros)
    behavior = torch.where(keep, behavior_logprobs.float().detach(), zeros)
    prox = logp.detach() if proximal_logprobs is None else torch.where(keep, proximal_logprobs.float(), zeros)
    adv = advantages.float().unsqueeze(1)  # (B, 1)

    count = keep.sum()
    corr = correction(prox.detach(), behavior, keep, cfg.off_policy)
    metrics: TensorMetrics = {"masked_tokens": count, **corr.metrics}
    if cfg.kind == "pg":
        per_token = -corr.weights * adv * logp
    else:
        ratio = torch.exp(logp - corr.old_logprobs)  # (B, T); exactly 1 on padding
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        per_token = -corr.weights * torch.min(ratio * adv, clipped * adv)
        metrics.update(_clip_metrics(ratio.detach(), adv, keep, count, cfg))
    if cfg.kl_coef > 0:
        ref = torch.where(keep, ref_logprobs.float().detach(), zeros)
        kl = kl_estimate(logp, ref, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl_ref"] = masked_stats(kl.detach(), keep, count, 0.0)[0]
    loss = aggregate(per_token, keep, norm)
    metrics.update(_mismatch_metrics(logp.detach(), behavior, keep, count))
    return loss, (to_floats([metrics])[0] if sync else metrics)


def pg_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, num_tokens,
            behavior_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE with a baseline, token-mean, no correction: ``-sum A_i logp_it m_it / num_tokens``.

    ``num_tokens``: int, float or 0-dim tensor (N_tok). ``behavior_logprobs`` is optional and used only
    for the mismatch / KL metrics. Departures from Williams (1992): the baseline is subtracted upstream
    and the per-sequence sum of logprobs is replaced by a token mean over the whole version's batch.
    """
    behavior = logprobs.detach() if behavior_logprobs is None else behavior_logprobs
    loss, m = policy_loss(logprobs, behavior, advantages, mask, Normalizer("token-mean", float(num_tokens), 1.0),
                          LossConfig(kind="pg"))
    if behavior_logprobs is None:
        m = {k: v for k, v in m.items() if not k.startswith(("logprob_mismatch", "kl_behavior", "is_", "band"))}
    return loss, m


def grpo_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, num_tokens, clip_eps: float = 0.2) -> tuple[torch.Tensor, Metrics]:
    """GRPO's clipped ratio against the behavior policy, token-mean, symmetric clip, no KL.

    ``l_it = -min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps) A_i)``, ``r = exp(logp - behavior)``;
    ``loss = sum l_it m_it / num_tokens``. See :func:`policy_loss` for the general form.
    """
    cfg = LossConfig(kind="grpo", clip_eps_low=clip_eps, clip_eps_high=clip_eps)
    return policy_loss(logprobs, behavior_logprobs, advantages, mask,
                       Normalizer("token-mean", float(num_tokens), 1.0), cfg)
