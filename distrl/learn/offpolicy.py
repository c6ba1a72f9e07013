"""Off-policy correction against the behavior logprobs the actors record: pure functions of tensors.

A completion used at learner version V was sampled by policy version ``policy_version <= V`` (the
*behavior* policy mu, whose per-token logprobs vLLM recorded), while the gradient is taken at the
learner's weights pi_theta. Three policies appear (AReaL's notation, Fu et al. 2025, "AReaL: A
Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning", arXiv:2505.24298 §5):

- behavior mu: ``behavior_logprobs`` (B, T), constants;
- proximal pi_prox: the learner's weights at consumption, before this version's optimizer step;
- current pi_theta: ``logprobs`` (B, T), carrying the graph.

One policy version is one optimizer step (DESIGN.md), so every forward pass of a version runs at the
proximal weights and ``pi_prox == pi_theta.detach()`` holds exactly: the learner passes
``logprobs.detach()`` as the proximal logprobs instead of running a second no-grad forward that would
return the same numbers. The loss functions take ``proximal_logprobs`` as an argument (tests pass other
values), so a learner that ever takes several optimizer steps per version only has to compute them once
before its first step.

Corrections (``off_policy``):

- ``none``: weight 1. GRPO's ratio is taken against mu (PPO's clip against the sampler, DESIGN.md's
  "clip" option); PG is the plain on-policy estimator (biased when data is stale).
- ``tis``: truncated importance sampling (Ionides 2008; for LLM RL, Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"; TRL's ``vllm_importance_sampling_mode``
  ``token_truncate`` / ``sequence_truncate``). Token level: ``w_it = min(pi_prox_it / mu_it, C)``.
  Sequence level: ``w_i = min(prod_t pi_prox_it / mu_it, C)`` (the product over the completion's tokens,
  as TRL; not GSPO's geometric mean), the same for every token of the sequence. GRPO's ratio is then
  taken against pi_prox.
- ``decoupled``: AReaL's decoupled PPO objective,
  ``w_it * min(u_it A_i, clip(u_it, 1 - eps_low, 1 + eps_high) A_i)`` with ``u = pi_theta / pi_prox``
  and the behavior weight ``w_it = min(pi_prox_it / mu_it, C)`` (token level). Departure: AReaL drops
  tokens whose weight exceeds its cap (``behav_imp_weight_cap``) instead of truncating; pass
  ``mask_high = C`` for that behavior. With one optimizer step per version the estimator is the same as
  ``tis`` at token level (TIS is the decoupled objective with a truncated weight); both names stay
  because the issue and the literature use both, and ``tis`` adds the sequence level.

Band mask (any correction): tokens whose behavior ratio ``rho_it = pi_prox_it / mu_it`` lies outside
``[mask_low, mask_high]`` get weight 0 (their loss and gradient vanish); ``None`` leaves that side
open. The mask never changes the loss normalizers: those are fixed for the whole version's batch before
any forward pass, which keeps micro-batching exact (``distrl.learn.losses.Normalizer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distrl.learn.config import IS_LEVELS, OFF_POLICY, OffPolicyConfig
from distrl.learn.tensor_metrics import masked_stats

__all__ = ["IS_LEVELS", "OFF_POLICY", "Correction", "OffPolicyConfig", "correction"]


@dataclass
class Correction:
    """What a correction contributes to the per-token loss; all (B, T) float32 and detached.

    old_logprobs: the "old" policy of GRPO's clipped ratio (mu for ``none``, pi_prox otherwise).
    weights: the importance weight multiplying each token's loss (0 on band-masked and padding tokens).
    """

    old_logprobs: torch.Tensor
    weights: torch.Tensor
    metrics: dict[str, torch.Tensor]  # 0-dim, on the device


@torch.no_grad()
def correction(proximal: torch.Tensor, behavior: torch.Tensor, keep: torch.Tensor,
               cfg: OffPolicyConfig) -> Correction:
    """Old policy and importance weights for one micro-batch.

    Args:
        proximal: (B, T) float32 pi_prox logprobs, finite on kept tokens (0 elsewhere).
        behavior: (B, T) float32 mu logprobs, finite on kept tokens (0 elsewhere).
        keep: (B, T) bool, completion tokens.
        cfg: the correction.

    Metrics over kept tokens (0-dim tensors on the device, no host sync; empty batch: ratios 1.0,
    fractions 0.0):
    ``is_ratio_mean``/``is_ratio_max``/``is_ratio_min`` of rho = pi_prox / mu (token level, before
    truncation), ``is_weight_mean``/``is_weight_max`` of the weights applied (after truncation and
    masking; 1.0 for ``none``), ``is_truncated_fraction`` (weights cut at C) and ``band_masked_fraction``.
    """
    log_rho = torch.where(keep, proximal - behavior, torch.zeros_like(proximal))  # (B, T)
    band = keep.clone()
    if cfg.mask_low is not None and cfg.mask_low > 0:
        band &= log_rho >= math.log(cfg.mask_low)
    if cfg.mask_high is not None:
        band &= log_rho <= math.log(cfg.mask_high)
    log_cap = math.log(cfg.cap)
    if cfg.method == "none":
        raw = torch.ones_like(log_rho)
        old = behavior
    elif cfg.level == "sequence":
        seq = log_rho.sum(dim=1, keepdim=True)  # (B, 1): log prod_t rho_it
        raw = torch.exp(seq.clamp(max=log_cap + 1.0)).expand_as(log_rho)
        old = proximal
    else:
        raw = torch.exp(log_rho.clamp(max=log_cap + 1.0))
        old = proximal
    truncated = raw > cfg.cap
    weights = torch.where(band, raw.clamp(max=cfg.cap), torch.zeros_like(raw))
    count = keep.sum()
    n = count.clamp(min=1)
    rho_mean, rho_max, rho_min = masked_stats(torch.exp(log_rho), keep, count, 1.0)
    w_mean, w_max, _ = masked_stats(weights, keep, count, 1.0)
    metrics = {"is_ratio_mean": rho_mean, "is_ratio_max": rho_max, "is_ratio_min": rho_min,
               "is_weight_mean": w_mean, "is_weight_max": w_max,
               "is_truncated_fraction": (truncated & keep).sum() / n, "band_masked_fraction": (keep & ~band).sum() / n}
    return Correction(old, weights, metrics)
