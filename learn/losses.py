"""Policy-gradient losses: pure functions of tensors returning ``(loss, metrics)``.

Shapes and units (the same for every function here):

- ``logprobs``: (B, T) float32, learner log-probabilities (nats) of the sampled tokens, after the
  sampling temperature (see ``learn.logprobs.token_logprobs``); carries the graph.
- ``behavior_logprobs``: (B, T) float32, the actor's (vLLM's ``processed_logprobs``) log-probabilities
  of the same tokens under the policy version that generated them. Never differentiated.
- ``advantages``: (B,) float32, one per completion, already baselined (group mean subtracted,
  optionally group-std normalized) when the group was complete; never recomputed here.
- ``mask``: (B, T) float32, 1.0 on completion tokens, 0.0 on prompt and padding.
- ``num_tokens``: token count of the WHOLE policy version's batch (summed over micro-batches and
  all-reduced across learners): token-mean aggregation. Each micro-batch's loss is its masked token sum
  divided by this count, so the sum of micro-batch losses (and gradients) equals the full-batch loss,
  and L learners equal one learner on the union batch provided their gradients are all-reduced with
  a SUM (each learner's loss is already its share of the global mean); an all-reduce AVG must be
  multiplied by L.

Padding positions may hold anything (even -inf): inputs are masked with ``torch.where`` before any
arithmetic, so nothing from padding reaches the loss or the gradient. A batch with no completion
tokens gives loss 0 that still has a graph (``backward()`` works and yields zero gradients).

Metrics are python floats over masked tokens of THIS call only (means are local; the learner weights
them by ``masked_tokens`` to combine micro-batches). Empty batch: means and counts 0.0, ratio stats 1.0.

- ``logprob_mismatch_mean_abs`` / ``logprob_mismatch_max_abs``: |logp - behavior_logp|, in nats.
- ``kl_behavior_learner_k3``: Schulman's k3 estimator ("Approximating KL divergence", 2020) of
  KL(behavior || learner). Tokens are sampled from the behavior policy mu, so with
  r = pi/mu = exp(logp - behavior_logp) (the importance ratio), k3 = r - 1 - log r >= 0 is an unbiased,
  low-variance estimate of KL(mu || pi). (Using exp(behavior - learner) instead would be biased: the
  samples do not come from the learner.)
"""

from __future__ import annotations

import torch

Metrics = dict[str, float]


def _check(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           behavior_logprobs: torch.Tensor | None) -> None:
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(f"logprobs and mask must be (B, T) of one shape, got "
                         f"{tuple(logprobs.shape)} and {tuple(mask.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be (B,)={tuple(logprobs.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    if behavior_logprobs is not None and behavior_logprobs.shape != logprobs.shape:
        raise ValueError(f"behavior_logprobs must be {tuple(logprobs.shape)}, "
                         f"got {tuple(behavior_logprobs.shape)}")


def _token_mean(per_token: torch.Tensor, keep: torch.Tensor, num_tokens) -> torch.Tensor:
    """sum(per_token over kept tokens) / max(num_tokens, 1); padding never enters the sum."""
    total = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
    denom = torch.as_tensor(num_tokens, dtype=total.dtype, device=total.device).clamp(min=1.0)
    return total / denom


@torch.no_grad()
def _mismatch_metrics(logp: torch.Tensor, behavior: torch.Tensor, keep: torch.Tensor) -> Metrics:
    """Behavior-vs-learner gap over kept tokens (inputs already masked to finite values)."""
    diff = (logp - behavior)[keep]  # log r, (n,)
    if diff.numel() == 0:
        return {"logprob_mismatch_mean_abs": 0.0, "logprob_mismatch_max_abs": 0.0,
                "kl_behavior_learner_k3": 0.0}
    k3 = torch.expm1(diff) - diff  # r - 1 - log r with r = exp(logp - behavior)
    return {"logprob_mismatch_mean_abs": diff.abs().mean().item(),
            "logprob_mismatch_max_abs": diff.abs().max().item(),
            "kl_behavior_learner_k3": k3.mean().item()}


def pg_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, num_tokens,
            behavior_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE with a baseline (Williams 1992), token-mean aggregated.

    loss = -sum_{i,t} A_i * logp_it * mask_it / num_tokens

    Args: see the module docstring for shapes and units. ``num_tokens``: int, float or 0-dim tensor.
    ``behavior_logprobs`` is optional and used only for the mismatch / KL metrics.

    Departures from the paper: the baseline (group mean of rewards) is subtracted upstream when the
    group is complete, not learned; the per-sequence sum of log-probabilities is replaced by a
    token-mean over the whole version's batch. No importance correction: with stale behavior data this
    is the plain (biased) on-policy estimator; use ``grpo_loss`` for a ratio against the behavior.
    """
    _check(logprobs, advantages, mask, behavior_logprobs)
    keep = mask > 0
    logp = torch.where(keep, logprobs.float(), torch.zeros_like(logprobs, dtype=torch.float32))
    adv = advantages.float().unsqueeze(1)  # (B, 1)
    loss = _token_mean(-adv * logp, keep, num_tokens)
    metrics: Metrics = {"masked_tokens": float(keep.sum().item())}
    if behavior_logprobs is not None:
        behavior = torch.where(keep, behavior_logprobs.float(), torch.zeros_like(logp))
        metrics.update(_mismatch_metrics(logp.detach(), behavior, keep))
    return loss, metrics


def grpo_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, num_tokens, clip_eps: float = 0.2) -> tuple[torch.Tensor, Metrics]:
    """GRPO (Shao et al. 2024, DeepSeekMath) = PPO clipped surrogate (Schulman et al. 2017).

    ratio_it = exp(logp_it - behavior_logp_it)          (a real ratio: the learner's logp carries the
                                                          graph, the behavior logp is a constant)
    l_it     = -min(ratio_it * A_i, clip(ratio_it, 1 - clip_eps, 1 + clip_eps) * A_i)
    loss     = sum_{i,t} l_it * mask_it / num_tokens

    Args: see the module docstring for shapes and units. ``clip_eps``: PPO's epsilon (clip_coef),
    dimensionless, default 0.2.

    Departures from the papers:
    - The "old" policy of PPO/GRPO is the behavior policy that generated the tokens (the actor's
      vLLM logprobs, possibly several versions stale), not a snapshot of the learner; there is one
      optimizer step per batch, so the learner-side old policy would give ratio 1 everywhere.
    - Token-mean over the whole version's batch instead of GRPO's per-sequence mean then group mean.
    - No KL-to-reference term here (GRPO's beta * D_KL(pi || pi_ref) is not implemented in this
      function; a reference term is added by the caller if configured).

    Metrics (over masked tokens): ``clip_fraction``, the fraction of tokens whose clipped term was the
    one chosen by the min, i.e. ratio > 1 + eps with A > 0 or ratio < 1 - eps with A < 0 (the gradient
    of those tokens is zero); ``ratio_mean``, ``ratio_max``, ``ratio_min``; the mismatch/KL metrics of
    the module docstring; ``masked_tokens``.
    """
    _check(logprobs, advantages, mask, behavior_logprobs)
    keep = mask > 0
    zeros = torch.zeros_like(logprobs, dtype=torch.float32)
    logp = torch.where(keep, logprobs.float(), zeros)
    behavior = torch.where(keep, behavior_logprobs.float().detach(), zeros)
    adv = advantages.float().unsqueeze(1)  # (B, 1)

    ratio = torch.exp(logp - behavior)  # (B, T); exactly 1 on padding
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    loss = _token_mean(-torch.min(unclipped, clipped), keep, num_tokens)

    with torch.no_grad():
        r = ratio[keep]
        a = adv.expand_as(ratio)[keep]
        active = ((a > 0) & (r > 1.0 + clip_eps)) | ((a < 0) & (r < 1.0 - clip_eps))
        n = r.numel()
        metrics: Metrics = {
            "masked_tokens": float(n),
            "clip_fraction": active.float().mean().item() if n else 0.0,
            "ratio_mean": r.mean().item() if n else 1.0,
            "ratio_max": r.max().item() if n else 1.0,
            "ratio_min": r.min().item() if n else 1.0,
        }
        metrics.update(_mismatch_metrics(logp.detach(), behavior, keep))
    return loss, metrics
