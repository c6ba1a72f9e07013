"""Per-token log-probabilities at the LM head, in fp32 and in chunks.

A (B, T) batch with a 151k vocabulary has B*T*151k logits: in fp32 that is gigabytes, and autograd
would keep them (and the log-softmax) alive until backward. ``token_logprobs`` instead flattens the
B*T positions, cuts them into chunks of ``chunk_tokens`` and runs head -> /temperature -> log-softmax
-> gather for each chunk so that only each chunk's inputs (hidden slice, head weight) and its (n,)
log-sum-exp are saved, and backward recomputes one chunk's logits at a time. An ``nn.Linear`` or
weight-tensor head goes through ``_FusedChunk``, whose hand-written backward forms
``onehot - softmax`` in place in one (n, V) buffer; another head module runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Peak extra memory is about
``chunk_tokens * V * 4`` bytes (times a small constant), in forward and in backward.

On a GPU with bf16/fp16 weights, ``impl="cce"`` runs the head through Apple's Cut Cross-Entropy
(Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024; the
``cut_cross_entropy`` package that Unsloth installs): Triton kernels that compute each position's
log-sum-exp and target logit over vocabulary tiles in on-chip memory (bf16 inputs, fp32
accumulation), so no (n, V) buffer is ever written, and the same in backward (gradient filtering
off; the gradient matmuls take the softmax gradient in bf16, as bf16 autograd would). :func:`head_impl` picks it where it applies.

Units: natural-log probabilities of ``softmax(lm_head(hidden) / temperature)``, the same
distribution vLLM samples from and reports with ``logprobs_mode="processed_logprobs"`` (top-k/top-p
truncation aside). Shifting (hidden at position t predicts token t+1) is the caller's job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _head_params(lm_head: torch.nn.Module | torch.Tensor):
    """(weight (V, H), bias (V,) or None) for a tensor or nn.Linear; None for another module."""
    if isinstance(lm_head, torch.Tensor):
        return lm_head, None
    if isinstance(lm_head, torch.nn.Linear):
        return lm_head.weight, lm_head.bias
    return None


class _FusedChunk(torch.autograd.Function):
    """One chunk of an ``nn.Linear``/tensor head with a hand-written backward (no autograd graph).

    Forward: logits (n, V) fp32 = hidden @ W^T + b, / T; lse; logp = z[target] - lse; optional entropy.
    Backward recomputes the logits and turns them in place into d logp / d z = onehot - softmax(z)
    (times the upstream gradient, / T), then two matmuls: a few passes over one (n, V) fp32 buffer
    instead of autograd's chain (div, logsumexp, gather, where and their backwards), which made the
    head the learner's largest cost on a GPU (docs/profile_learner.md). Saves only hidden, W, b,
    targets and lse (n,).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, want_entropy: bool):
        logits = F.linear(hidden.float(), weight, bias)  # (n, V) fp32
        if temperature != 1.0:
            logits.div_(temperature)
        lse = torch.logsumexp(logits, dim=-1)  # (n,)
        valid = targets >= 0
        picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logp = torch.where(valid, picked - lse, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        if not want_entropy:
            return logp, None
        logits.sub_(lse.unsqueeze(-1))  # log p, in place
        entropy = -(logits.exp() * logits).sum(-1)  # H = -sum_v p_v log p_v
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        valid = targets >= 0
        g = torch.where(valid, grad_logp, torch.zeros_like(grad_logp))  # (n,)
        dz = F.linear(hidden.float(), weight, bias)  # recomputed logits (n, V)
        if temperature != 1.0:
            dz.div_(temperature)
        dz.sub_(lse.unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))  # -g * softmax(z)
        rows = torch.arange(len(targets), device=dz.device)
        dz[rows, targets.clamp(min=0)] += g  # + g * onehot(target); g = 0 on ignored positions
        if temperature != 1.0:
            dz.div_(temperature)  # z = logits / T
        grad_hidden = (dz @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = dz.t() @ hidden.float() if ctx.needs_input_grad[1] else None
        grad_bias = dz.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


HEAD_IMPLS = ("auto", "chunked", "cce")
ENTROPY_SAMPLE = 1024  # positions per call whose entropy the cce path computes (see token_logprobs)


def head_impl(requested: str, lm_head: torch.nn.Module | torch.Tensor, temperature: float) -> tuple[str, str]:
    """Resolve ``--learner_head`` to ``("chunked" | "cce", why)``.

    ``cce`` needs a CUDA device, a bf16/fp16 Linear or tensor head without bias, temperature 1 (the
    kernel takes the hidden states in their own dtype, where dividing by another temperature would
    round) and the ``cut_cross_entropy`` package. ``auto`` takes ``cce`` when all hold, else
    ``chunked``. Raises ValueError if ``cce`` is requested and one does not hold (naming it).
    """
    if requested not in HEAD_IMPLS:
        raise ValueError(f"--learner_head must be one of {HEAD_IMPLS}, got {requested!r}")
    if requested == "chunked":
        return "chunked", "asked for"
    params = _head_params(lm_head)
    reason = None
    if params is None or params[1] is not None:
        reason = "the head is not a bias-free Linear"
    elif params[0].device.type != "cuda":
        reason = "the head is not on a CUDA device"
    elif params[0].dtype not in (torch.bfloat16, torch.float16):
        reason = f"the head is {params[0].dtype}, not bf16/fp16"
    elif temperature != 1.0:
        reason = f"--temperature is {temperature}, not 1.0"
    else:
        try:
            import cut_cross_entropy  # noqa: F401
        except ImportError:
            reason = "cut_cross_entropy is not installed"
    if reason is None:
        return "cce", "bf16 head on CUDA"
    if requested == "cce":
        raise ValueError(f"--learner_head cce cannot run: {reason}")
    return "chunked", reason


def _cce_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden (n, H), weight (V, H) in one half dtype, targets (n,) long (negative: ignored) -> (n,)
    fp32 logprobs at temperature 1, 0.0 on ignored positions; gradient to hidden and weight.

    CCE's log-sum-exp accumulates in fp32, but its target logit sums products rounded to the half
    dtype (``(e * c).to(float32)`` in its indexed-dot kernel): an error that grows with the logits'
    size (0.004 nats on a random model, 0.12 at 30x its scale, on an H200). The value is corrected
    here with the fp32 dot product minus the same rounded sum, which cancels CCE's term; the gradient
    is CCE's (the target logit's gradient does not depend on how its value was summed).
    """
    from cut_cross_entropy import linear_cross_entropy

    hidden = hidden.to(weight.dtype)
    valid = targets >= 0
    safe = targets.masked_fill(~valid, -100)  # the package's ignore_index
    nll = linear_cross_entropy(hidden, weight, safe, ignore_index=-100, reduction="none", filter_eps=None,
                               impl="cce")
    with torch.no_grad():
        picked = weight[targets.clamp(min=0)]  # (n, H)
        exact = (hidden.float() * picked.float()).sum(-1)  # fp32 products and sum
        rounded = (hidden * picked).float().sum(-1)  # CCE's: products rounded to the half dtype
        fix = torch.where(valid, exact - rounded, torch.zeros_like(exact))
    return fix - nll.float()


def _chunk(hidden: torch.Tensor, weight, bias, targets: torch.Tensor, temperature: float,
           module, want_entropy: bool):
    """One chunk: hidden (n, H), targets (n,) -> logprobs (n,) fp32 [, entropy (n,) fp32]."""
    if module is None:
        logits = F.linear(hidden.float(), weight, bias)  # (n, V) fp32
    else:  # a wrapped head: run it in its own dtype, fp32 from the logits on
        logits = module(hidden).float()
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    valid = targets >= 0
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, picked - lse, torch.zeros_like(lse))
    if not want_entropy:
        return logp
    with torch.no_grad():  # H = lse - sum_v p_v * z_v
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module | torch.Tensor,
                   target_ids: torch.Tensor, temperature: float, chunk_tokens: int = 1024,
                   return_entropy: bool = False, impl: str = "chunked"):
    """Log-probabilities of ``target_ids`` under ``softmax(lm_head(hidden) / temperature)``.

    Args:
        hidden: (B, T, H) final hidden states (after the final norm), any float dtype.
        lm_head: the output head: an ``nn.Linear`` (weight (V, H), optional bias) or its weight
            tensor (V, H). Its weight and bias are cast to fp32 once per call (a no-op when already
            fp32), so the matmul, log-softmax and the weight-gradient accumulation over chunks are
            fp32; the gradient reaches the original parameter through the cast. Any other module
            (e.g. a wrapped head) is called on the hidden states in its own dtype and only its
            logits are promoted to fp32.
        target_ids: (B, T) long, the token whose probability is wanted at each position. Negative
            ids (e.g. -100 on padding) are ignored and give logprob 0.0.
        temperature: sampling temperature, > 0; the same one the actors sampled with.
        chunk_tokens: flattened positions per chunk (default 1024); full fp32 logits exist for at
            most this many positions at a time.
        return_entropy: also return the per-token entropy (nats) of the tempered distribution,
            computed from the same chunk without gradient.
        impl: ``"chunked"`` (the fp32 chunks above) or ``"cce"`` (Cut Cross-Entropy; resolve it with
            :func:`head_impl`). With ``cce`` and ``return_entropy``, the entropy is computed exactly
            at a strided sample of at most ``ENTROPY_SAMPLE`` positions (by the chunked code, no
            gradient) and every other position holds that sample's mean, so its sum estimates the
            total without another pass over the vocabulary for every position.

    Returns:
        logprobs (B, T) float32 with gradient to ``hidden`` and the head; with ``return_entropy``,
        ``(logprobs, entropy)`` with entropy (B, T) float32, detached.
    """
    if hidden.dim() != 3 or target_ids.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (B, T, H) and target_ids (B, T), got "
                         f"{tuple(hidden.shape)} and {tuple(target_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

    if impl not in ("chunked", "cce"):
        raise ValueError(f"impl must be 'chunked' or 'cce', got {impl!r}")
    params = _head_params(lm_head)
    b, t, h = hidden.shape
    flat_hidden = hidden.reshape(b * t, h)  # (N, H)
    flat_targets = target_ids.reshape(b * t).long()  # (N,)
    if impl == "cce" and b * t > 0:
        logprobs = _cce_logprobs(flat_hidden, params[0], flat_targets).reshape(b, t)
        if not return_entropy:
            return logprobs
        with torch.no_grad():
            step = -(-(b * t) // ENTROPY_SAMPLE)
            sample = flat_hidden[::step]
            _, sampled = _chunk(sample, params[0].float(), None, flat_targets[::step], temperature, None, True)
            entropy = sampled.mean().expand(b * t).clone()
            entropy[::step] = sampled
        return logprobs, entropy.reshape(b, t)
    module = lm_head if params is None else None
    weight = bias = None
    if params is not None:
        weight = params[0].float()
        bias = None if params[1] is None else params[1].float()
    logps, entropies = [], []
    for start in range(0, b * t, chunk_tokens):
        end = min(start + chunk_tokens, b * t)
        if module is None:  # a Linear head or a weight tensor: the fused chunk
            logp, entropy = _FusedChunk.apply(flat_hidden[start:end], weight, bias, flat_targets[start:end],
                                              temperature, return_entropy)
            out = (logp, entropy) if return_entropy else logp
        else:
            out = checkpoint(_chunk, flat_hidden[start:end], weight, bias, flat_targets[start:end],
                             temperature, module, return_entropy, use_reentrant=False)
        if return_entropy:
            logps.append(out[0])
            entropies.append(out[1])
        else:
            logps.append(out)
    if not logps:  # B*T == 0
        empty = hidden.new_zeros((b, t), dtype=torch.float32) + 0.0 * hidden.sum()
        return (empty, empty.detach().clone()) if return_entropy else empty
    logprobs = torch.cat(logps).reshape(b, t)
    if return_entropy:
        return logprobs, torch.cat(entropies).reshape(b, t)
    return logprobs
