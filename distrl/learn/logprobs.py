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
off; the gradient matmuls take the softmax gradient in bf16, as bf16 autograd would). :func:`head_impl` picks it
where it applies.

``impl="halfmm"`` is the chunked algorithm with the matmuls in the head's own half dtype: a bf16/fp16
head weight is not upcast, the hidden states are cast to its dtype, and each chunk's logits come out
of a half-precision matmul that writes fp32 (``torch.mm(..., out_dtype=torch.float32)`` on CUDA: bf16
tensor-core rate, where the fp32 chunks run at TF32 rate). A product of two half values is exact in
fp32, so logprobs equal the chunked path's up to accumulation order; in backward the (n, V) softmax
gradient is cast to the half dtype once and the two gradient matmuls run in it, so the gradients are
rounded to bf16/fp16 (as CCE's are). Bias, any temperature and exact per-position entropy are kept.
Memory per chunk: about ``chunk_tokens * V * (4 + 2)`` bytes in backward. Off CUDA the matmul falls
back to fp32 products of the same half values (same values, no speed-up); ``auto`` picks it for a
bf16/fp16 head on CUDA (:data:`AUTO_HEADS`).

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


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (n, k) @ b (k, m), both in one half dtype (bf16/fp16) -> (n, m) fp32.

    On CUDA, cuBLAS's half-precision matmul writing fp32 (``torch.mm(..., out_dtype=torch.float32)``):
    bf16/fp16 tensor-core rate, fp32 accumulation, no rounding of the result to the half dtype. Elsewhere
    (``aten::mm.dtype`` has no CPU kernel) ``a.float() @ b.float()``: the same math, since a product of two
    half values is exact in fp32 and the sums are fp32 in both; only the order of accumulation differs.
    """
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _raw_logits(hidden, weight, half: bool) -> torch.Tensor:
    """One chunk's logits before bias and temperature, (n, V) fp32: ``hidden`` (n, H) and ``weight``
    (V, H) both fp32 (``half=False``: an fp32 matmul, TF32 on a GPU where allowed) or both in the head's
    half dtype (``half=True``: :func:`_mm_fp32`)."""
    return _mm_fp32(hidden, weight.t()) if half else F.linear(hidden.float(), weight)


def _tempered(raw: torch.Tensor, bias, inv_t: float) -> torch.Tensor:
    """z = (raw + bias) / T, (n, V) fp32, from raw (n, V) fp32 logits and bias (V,) or None."""
    return (raw if bias is None else raw + bias.float()) * inv_t


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log p_v (n,) in nats, p = softmax(z), lse = logsumexp(z) (n,): no cancellation when
    the entropy is small (unlike lse - sum p z)."""
    log_p = z - lse.unsqueeze(-1)
    return -(torch.exp(log_p) * log_p).sum(-1)


def _stats(raw: torch.Tensor, bias, targets: torch.Tensor, inv_t: float, want_entropy: bool):
    """raw (n, V) fp32 logits, bias (V,) or None, targets (n,) long (negative: ignored), inv_t = 1/T ->
    (logp (n,), lse (n,), entropy (n,) or None), all fp32, z = (raw + bias) / T: logp = z[target] - lse
    (0.0 where ignored), entropy = -sum_v p_v log p_v with p = softmax(z) (nats). On CUDA it runs compiled
    (:func:`_fused`): a pass or two over the (n, V) logits instead of one per operation."""
    z = _tempered(raw, bias, inv_t)
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(targets >= 0, picked - lse, torch.zeros_like(lse))
    return logp, lse, (_entropy(z, lse) if want_entropy else None)


def _softmax_grad(raw: torch.Tensor, bias, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor,
                  inv_t: float, dtype: torch.dtype):
    """d(sum_i g_i logp_i) / d(raw + bias) = g * (onehot(target) - softmax(z)) / T as (n, V) ``dtype``,
    and its column sum (V,) fp32 when there is a bias (else None); ``g`` (n,) fp32, 0 on ignored
    positions. Computed in fp32, rounded to ``dtype`` once; compiled on CUDA like :func:`_stats`."""
    z = _tempered(raw, bias, inv_t)
    onehot = torch.arange(raw.shape[-1], device=raw.device) == targets.unsqueeze(-1)
    dz = g.unsqueeze(-1) * (onehot.float() - torch.exp(z - lse.unsqueeze(-1))) * inv_t
    return dz.to(dtype), (None if bias is None else dz.sum(0))


_COMPILED: dict = {}


def _fused(fn, like: torch.Tensor):
    """``fn`` compiled with torch.compile (dynamic shapes) when ``like`` is on CUDA, else ``fn`` itself.
    If compiling fails (no Triton, an unsupported GPU), ``fn`` runs eagerly from then on (same math)."""
    if not like.is_cuda or _COMPILED.get(fn) is False:
        return fn
    if fn not in _COMPILED:
        compiled = torch.compile(fn, dynamic=True)

        def first_call(*args):
            try:
                out = compiled(*args)
            except Exception as exc:  # noqa: BLE001 - a compiler failure: the eager function is the same math
                import logging

                logging.getLogger(__name__).warning("LM head: torch.compile of %s failed (%s: %s); running it "
                                                    "eagerly", fn.__name__, type(exc).__name__, exc)
                _COMPILED[fn] = False
                return fn(*args)
            _COMPILED[fn] = compiled
            return out

        return first_call
    return _COMPILED[fn]


class _FusedChunk(torch.autograd.Function):
    """One chunk of an ``nn.Linear``/tensor head with a hand-written backward (no autograd graph).

    Forward: raw logits (n, V) fp32 = hidden @ W^T; z = (raw + b) / T; lse; logp = z[target] - lse;
    optional entropy (:func:`_stats`). Backward recomputes the raw logits and forms
    d logp / d z = onehot - softmax(z) (times the upstream gradient, / T) in one pass
    (:func:`_softmax_grad`), then two matmuls, instead of autograd's chain (div, logsumexp, gather,
    where and their backwards), which made the head the learner's largest cost on a GPU
    (docs/profile_learner.md). Saves only hidden, W, b, targets and lse (n,). On CUDA the element-wise
    passes over the (n, V) logits are compiled (:func:`_fused`).

    ``half=False`` (``impl="chunked"``): W and b are fp32 and every matmul is fp32 (TF32 on a GPU
    where allowed). ``half=True`` (``impl="halfmm"``): hidden and W are in the head's half dtype; the
    forward matmul multiplies half values into fp32 logits (:func:`_mm_fp32`), so logp is the same
    fp32 value up to accumulation order; backward rounds the fp32 softmax gradient to the half dtype
    once and runs the two gradient matmuls in it (fp32 accumulation inside cuBLAS, results rounded to
    the half dtype, as bf16 autograd or CCE would). Peak extra memory per chunk: about n * V * 4 bytes
    in forward, n * V * (4 + 2) in backward with ``half`` (more when the element-wise passes run eagerly).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, want_entropy: bool, half: bool = False):
        # a chunk's targets are a view at offset `start` of the call's: a copy at offset 0 keeps the compiled
        # functions from guarding on (and recompiling for) the offset happening to equal another size
        targets = targets.clone()
        raw = _raw_logits(hidden, weight, half)  # (n, V) fp32
        logp, lse, entropy = _fused(_stats, raw)(raw, bias, targets, 1.0 / temperature, want_entropy)
        del raw
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.half = temperature, half
        if not want_entropy:
            return logp, None
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        g = torch.where(targets >= 0, grad_logp.float(), torch.zeros_like(lse))  # (n,)
        raw = _raw_logits(hidden, weight, ctx.half)  # recomputed (n, V) fp32
        dtype = weight.dtype if ctx.half else torch.float32
        dz, dbias = _fused(_softmax_grad, raw)(raw, bias, lse, targets, g, 1.0 / ctx.temperature, dtype)
        del raw
        grad_bias = dbias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        grad_hidden = (dz @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = dz.t() @ hidden.to(dz.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


HEAD_IMPLS = ("auto", "chunked", "cce", "halfmm")
# what `auto` tries on CUDA, in order, before chunked (halfmm: faster than cce, bench/gpu_pipeline.py)
AUTO_HEADS = ("halfmm",)
ENTROPY_SAMPLE = 1024  # positions per call whose entropy the cce path computes (see token_logprobs)


def _cannot_run(impl: str, params, temperature: float) -> str | None:
    """Why head ``impl`` ("cce" | "halfmm") cannot run on a head with ``params`` (see :func:`_head_params`),
    or None if it can."""
    if impl == "halfmm":
        if params is None:
            return "the head is not an nn.Linear or a weight tensor"
        if params[0].dtype not in (torch.bfloat16, torch.float16):
            return f"the head is {params[0].dtype}, not bf16/fp16"
        return None
    if params is None or params[1] is not None:
        return "the head is not a bias-free Linear"
    if params[0].device.type != "cuda":
        return "the head is not on a CUDA device"
    if params[0].dtype not in (torch.bfloat16, torch.float16):
        return f"the head is {params[0].dtype}, not bf16/fp16"
    if temperature != 1.0:
        return f"--temperature is {temperature}, not 1.0"
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError:
        return "cut_cross_entropy is not installed"
    return None


def head_impl(requested: str, lm_head: torch.nn.Module | torch.Tensor, temperature: float) -> tuple[str, str]:
    """Resolve ``--learner_head`` to ``("chunked" | "cce" | "halfmm", why)``.

    ``cce`` needs a CUDA device, a bf16/fp16 Linear or tensor head without bias, temperature 1 (the
    kernel takes the hidden states in their own dtype, where dividing by another temperature would
    round) and the ``cut_cross_entropy`` package. ``halfmm`` needs a Linear or tensor head whose weight
    is bf16/fp16 (bias and any temperature allowed; any device, but only CUDA has the fast matmul, see
    :func:`_mm_fp32`). ``auto`` takes the first of ``AUTO_HEADS`` that can run on a CUDA head, else
    ``chunked``. Raises ValueError if an unknown name is given, or ``cce``/``halfmm`` is requested and a
    requirement does not hold (naming it).
    """
    if requested not in HEAD_IMPLS:
        raise ValueError(f"--learner_head must be one of {HEAD_IMPLS}, got {requested!r}")
    if requested == "chunked":
        return "chunked", "asked for"
    params = _head_params(lm_head)
    if requested != "auto":
        reason = _cannot_run(requested, params, temperature)
        if reason is not None:
            raise ValueError(f"--learner_head {requested} cannot run: {reason}")
        return requested, "asked for"
    reasons = []
    for impl in AUTO_HEADS:
        reason = _cannot_run(impl, params, temperature)
        if reason is None and params[0].device.type != "cuda":
            reason = "the head is not on a CUDA device"
        if reason is None:
            return impl, "bf16/fp16 head on CUDA"
        reasons.append(f"{impl}: {reason}")
    return "chunked", "; ".join(reasons)


def _cce_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden (n, H), weight (V, H) in one half dtype, targets (n,) long (negative: ignored) -> (n,)
    fp32 logprobs at temperature 1, 0.0 on ignored positions; gradient to hidden and weight.

    CCE's log-sum-exp accumulates in fp32, but its target logit sums products rounded to the half
    dtype (``(e * c).to(float32)`` in its indexed-dot kernel): an error that grows with the logits'
    size (0.004 nats on a random model, 0.12 at 30x its scale). The value is corrected
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
    """One chunk through autograd (a head that is not a Linear or tensor, or CCE's entropy sample):
    hidden (n, H), targets (n,) -> logprobs (n,) fp32 [, entropy (n,) fp32, no gradient]; the math of
    :func:`_stats` on fp32 logits (``F.linear`` in fp32, or the module in its own dtype)."""
    raw = F.linear(hidden.float(), weight) if module is None else module(hidden).float()  # (n, V)
    logp, lse, _ = _stats(raw, bias, targets, 1.0 / temperature, False)
    if not want_entropy:
        return logp
    with torch.no_grad():  # out of the graph: a checkpointed backward does not recompute it
        entropy = _entropy(_tempered(raw, bias, 1.0 / temperature), lse)
    return logp, entropy


def token_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module | torch.Tensor,
                   target_ids: torch.Tensor, temperature: float, chunk_tokens: int = 1024,
                   return_entropy: bool = False, impl: str = "chunked"):
    """Log-probabilities of ``target_ids`` under ``softmax(lm_head(hidden) / temperature)``.

    Args:
        hidden: (B, T, H) final hidden states (after the final norm), any float dtype.
        lm_head: the output head: an ``nn.Linear`` (weight (V, H), optional bias) or its weight
            tensor (V, H). With ``chunked``, its weight and bias are cast to fp32 once per call (a
            no-op when already fp32), so the matmul, log-softmax and the weight-gradient accumulation
            over chunks are fp32; the gradient reaches the original parameter through the cast. Any
            other module (e.g. a wrapped head) is called on the hidden states in its own dtype and
            only its logits are promoted to fp32.
        target_ids: (B, T) long, the token whose probability is wanted at each position. Negative
            ids (e.g. -100 on padding) are ignored and give logprob 0.0.
        temperature: sampling temperature, > 0; the same one the actors sampled with.
        chunk_tokens: flattened positions per chunk (default 1024); full fp32 logits exist for at
            most this many positions at a time.
        return_entropy: also return the per-token entropy (nats) of the tempered distribution,
            computed from the same chunk without gradient.
        impl: ``"chunked"`` (the fp32 chunks above), ``"halfmm"`` (the same chunks, but the head's
            weight stays in its bf16/fp16 dtype and ``hidden`` is cast to it: half-precision matmuls
            with fp32 logits, see :class:`_FusedChunk`; needs a Linear or tensor head in a half
            dtype) or ``"cce"`` (Cut Cross-Entropy). Resolve ``--learner_head`` with
            :func:`head_impl`. With ``cce`` and ``return_entropy``, the entropy is computed exactly
            at a strided sample of at most ``ENTROPY_SAMPLE`` positions (by the chunked code, no
            gradient) and every other position holds that sample's mean, so its sum estimates the
            total without another pass over the vocabulary for every position.

    Returns:
        logprobs (B, T) float32 with gradient to ``hidden`` and the head; with ``return_entropy``,
        ``(logprobs, entropy)`` with entropy (B, T) float32, detached.

    Raises:
        ValueError: on mismatched shapes, ``temperature <= 0``, ``chunk_tokens < 1``, an unknown
            ``impl``, or ``impl="halfmm"`` with a head that is not a bf16/fp16 Linear or tensor.
    """
    if hidden.dim() != 3 or target_ids.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (B, T, H) and target_ids (B, T), got "
                         f"{tuple(hidden.shape)} and {tuple(target_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if impl not in ("chunked", "cce", "halfmm"):
        raise ValueError(f"impl must be 'chunked', 'cce' or 'halfmm', got {impl!r}")
    params = _head_params(lm_head)
    if impl == "halfmm" and (why := _cannot_run("halfmm", params, temperature)) is not None:
        raise ValueError(f"impl='halfmm' cannot run: {why}")
    b, t, h = hidden.shape
    if b * t == 0:
        empty = hidden.new_zeros((b, t), dtype=torch.float32) + 0.0 * hidden.sum()
        return (empty, empty.detach().clone()) if return_entropy else empty
    flat_hidden, flat_targets = hidden.reshape(b * t, h), target_ids.reshape(b * t).long()  # (N, H), (N,)
    if impl == "cce":
        logprobs, entropy = _cce_token_logprobs(flat_hidden, params[0], flat_targets, temperature, return_entropy)
    else:
        logprobs, entropy = _chunked_token_logprobs(flat_hidden, lm_head, params, flat_targets, temperature,
                                                    chunk_tokens, return_entropy, impl == "halfmm")
    return (logprobs.reshape(b, t), entropy.reshape(b, t)) if return_entropy else logprobs.reshape(b, t)


def _cce_token_logprobs(flat_hidden, weight, flat_targets, temperature: float, return_entropy: bool):
    """:func:`token_logprobs` with ``impl="cce"`` on (N, H) hidden states: ``(logprobs (N,), entropy (N,) or
    None)``; the entropy exact at a strided sample of at most ``ENTROPY_SAMPLE`` positions, the sample's
    mean elsewhere."""
    logprobs = _cce_logprobs(flat_hidden, weight, flat_targets)
    if not return_entropy:
        return logprobs, None
    with torch.no_grad():
        n = flat_hidden.shape[0]
        step = -(-n // ENTROPY_SAMPLE)
        _, sampled = _chunk(flat_hidden[::step], weight.float(), None, flat_targets[::step], temperature, None, True)
        entropy = sampled.mean().expand(n).clone()
        entropy[::step] = sampled
    return logprobs, entropy


def _chunked_token_logprobs(flat_hidden, lm_head, params, flat_targets, temperature: float, chunk_tokens: int,
                            return_entropy: bool, half: bool):
    """:func:`token_logprobs` with ``impl="chunked"`` or ``"halfmm"`` (``half``) on (N, H) hidden states, in
    chunks of ``chunk_tokens`` positions: ``(logprobs (N,), entropy (N,) or None)``. A Linear or tensor
    head (``params``) goes through :class:`_FusedChunk`; any other module through a checkpointed
    :func:`_chunk`."""
    module = lm_head if params is None else None
    weight = bias = None
    if half:  # the head's own half dtype; hidden cast to it once (gradient flows back through the cast)
        weight, bias = params
        flat_hidden = flat_hidden.to(weight.dtype)
    elif params is not None:
        weight = params[0].float()
        bias = None if params[1] is None else params[1].float()
    logps, entropies = [], []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        if module is None:
            logp, entropy = _FusedChunk.apply(flat_hidden[rows], weight, bias, flat_targets[rows], temperature,
                                              return_entropy, half)
        else:
            out = checkpoint(_chunk, flat_hidden[rows], weight, bias, flat_targets[rows], temperature, module,
                             return_entropy, use_reentrant=False)
            logp, entropy = out if return_entropy else (out, None)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), (torch.cat(entropies) if return_entropy else None)


def warm_up(lm_head: torch.nn.Module | torch.Tensor, hidden_size: int, dtype: torch.dtype, temperature: float,
            chunk_tokens: int, impl: str) -> None:
    """Compile the head's fused passes (:func:`_fused`, symbolic sizes) now, on 64 positions of zeros, forward
    and backward, so a learner on CUDA compiles them while its actors start and sample instead of in its first
    version (where it took seconds). No parameter's ``.grad`` is touched
    (``torch.autograd.grad`` on the hidden states only); a no-op off CUDA, where nothing compiles."""
    params = _head_params(lm_head)
    weight = params[0] if params is not None else next(lm_head.parameters())
    if not weight.is_cuda:
        return
    hidden = torch.zeros((1, 64, hidden_size), dtype=dtype, device=weight.device, requires_grad=True)
    targets = torch.arange(64, device=weight.device).unsqueeze(0) % weight.shape[0]
    logprobs, _ = token_logprobs(hidden, lm_head, targets, temperature, chunk_tokens, return_entropy=True, impl=impl)
    torch.autograd.grad(logprobs.sum(), hidden)
