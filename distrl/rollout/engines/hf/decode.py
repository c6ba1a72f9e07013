"""The parts of a decode step that both HF samplers (:mod:`.static`, :mod:`.continuous`) share.

- :func:`grouped_attention`: masked attention where the G query heads of a group read their one K/V head in
  place (no ``repeat_kv`` copy), registered in transformers as :data:`ATTENTION`; where the continuous
  sampler's CUDA kernels run it hands over to :func:`distrl.rollout.engines.hf.kernels.slot_attention`.
- :func:`head_logits`: fp32 logits at the head, as the learner computes them.
- :func:`pick`: one token per row and its logprob, with no host sync (so a CUDA graph can hold it).
- :func:`compiled_step`, :func:`step_graph`: the step run through ``torch.compile`` and captured once in a
  CUDA graph, then replayed.
- :data:`PAD_MULTIPLE`, :func:`round_up`: prompt and completion lengths rounded up, so calls of similar size
  reuse one cache and one captured graph.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ATTENTION = "distrl_grouped"  # the name grouped_attention is registered under in transformers
PAD_MULTIPLE = 64  # prompt and completion lengths are rounded up to a multiple of this (tokens)


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0,
                      slot_lengths: torch.Tensor | None = None, slot_attention_impl: str = "triton",
                      prefill_causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """Masked softmax attention where the G query heads of a group share one K/V head, read in place.

    Args:
        query: (B, H, Q, D); key, value: (B, Hkv, L, D) with H = G * Hkv (query head h uses K/V head
            h // G, as transformers' ``repeat_kv`` orders them). Any strides with D contiguous: each K/V head
            is read as a strided view, never copied.
        attention_mask: (B, 1, Q, L) bool, True where a query may attend. A query row with no True
            gets uniform weights (finite: its output is never read by a real token).
        scaling: the score scale (default D ** -0.5). dropout: must be 0 (inference only).
        slot_lengths: (B,) int32, given by the continuous sampler's decode step where its CUDA kernels run
            (:func:`distrl.rollout.engines.hf.kernels.available`): Q = 1 and row b attends to its positions
            0 .. slot_lengths[b] - 1 only (what the mask says too), read by
            :func:`distrl.rollout.engines.hf.kernels.slot_attention` (kernel ``slot_attention_impl``: ``triton``, the
            split-K kernel, or ``flash``); the mask is not used then.
        prefill_causal: given by the continuous sampler's prefill of right-padded prompts, where key and value are
            the rows' own (B, Hkv, Q, D) and query position i attends to positions 0 .. i: torch's
            ``scaled_dot_product_attention(is_causal=True)`` (FlashAttention on CUDA for bf16/fp16, scores in fp32),
            which never holds the (B, H, Q, Q) scores; ``attention_mask`` may be None then. A padding position's
            output is not read.
    Returns:
        the output (B, Q, H, D) in the query's dtype (the layout transformers' attention functions
        return) and None (no attention weights). Scores are in the input dtype, the softmax in fp32,
        as transformers' eager attention does.
    Raises:
        ValueError: a non-zero dropout or a mask that is not 4-D bool.
    """
    if dropout:
        raise ValueError(f"{ATTENTION} attention is for inference only (dropout {dropout})")
    b, h, q, d = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    g = h // hkv
    scale = d ** -0.5 if scaling is None else scaling
    if slot_lengths is not None:
        from distrl.rollout.engines.hf.kernels import slot_attention

        return slot_attention(query, key, value, slot_lengths, scale, slot_attention_impl), None
    if prefill_causal:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=g > 1)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        raise ValueError(f"{ATTENTION} attention needs a 4-D bool mask (B, 1, Q, L)")
    outs = []
    for j in range(hkv):  # a group's G queries against its one K/V head (a strided view: no copy)
        qg = query[:, j * g:(j + 1) * g].reshape(b, g * q, d)  # (B, G*Q, D)
        scores = torch.matmul(qg, key[:, j].transpose(-1, -2)) * scale  # (B, G*Q, L)
        scores = torch.where(attention_mask, scores.view(b, g, q, kv_len), torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype).view(b, g * q, kv_len)
        outs.append(torch.matmul(probs, value[:, j]).view(b, g, q, d))  # (B, G, Q, D)
    out = outs[0] if hkv == 1 else torch.cat(outs, dim=1)  # (B, H, Q, D)
    return out.transpose(1, 2).contiguous(), None


class grouped_attention_mode:  # noqa: N801  (used as a function, like torch.inference_mode)
    """Run the model with :func:`grouped_attention` (4-D bool masks) inside the block, restored after."""

    def __init__(self, model):
        self.config = model.config

    def __enter__(self):
        self.previous, self.config._attn_implementation = self.config._attn_implementation, ATTENTION

    def __exit__(self, *exc):
        self.config._attn_implementation = self.previous


def supports_static(config) -> bool:
    """True when every decoder layer is full attention (no sliding window), which the static path assumes."""
    types = getattr(config.get_text_config(decoder=True), "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types)


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`, at least `multiple` (a length that reuses a cache and a graph)."""
    return max(multiple, -(-n // multiple) * multiple)


def compiled_step(decode: Callable, compile_step: bool, dynamic: bool = True) -> Callable:
    """``decode`` run through ``torch.compile`` (inductor, no cudagraphs of its own: the sampler captures the
    step itself), or ``decode`` itself without ``compile_step``.

    ``dynamic`` (the default): sizes are symbolic where the sampler marks them
    (``torch._dynamo.maybe_mark_dynamic``: slots, cache positions, output columns; weights, heads and head sizes
    stay fixed), so a later state, tail bucket or temperature reuses the compiled code and only captures its
    graph; any other size that changes is made symbolic at its first change (torch's automatic dynamic shapes).
    Compiled per shape instead (``dynamic=False``), each new shape compiles the whole model again (tens of
    seconds) at whatever point of a run a call first reaches it.
    """
    if not compile_step:
        return decode
    if not dynamic:  # one compilation per state x bucket: more than dynamo's default of 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(decode, dynamic=None if dynamic else False)


def step_graph(graphs: dict, key, decode: Callable[[], None], generator: torch.Generator, cuda_graphs: bool,
               device: torch.device) -> bool:
    """Run one decode step: replay ``graphs[key]``; without one, run ``decode()`` eagerly, then (with
    ``cuda_graphs``) capture it into ``graphs[key]`` (warm-up on a side stream, then recorded, not run; the
    graph advances ``generator``, whose noise every step draws: :func:`pick`). Returns True when a graph was
    captured. ``decode`` must work on static buffers only."""
    graph = graphs.get(key)
    if graph is not None:
        graph.replay()
        return False
    if not cuda_graphs:
        decode()
        return False
    side = torch.cuda.Stream(device=device)  # warm-up: this step, run for real, off the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if hasattr(graph, "register_generator_state"):
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # recorded, not run
        decode()
    graphs[key] = graph
    return True


def head_logits(model, h: torch.Tensor, mm_fp32: bool) -> torch.Tensor:
    """h (B, hidden) in the model's dtype -> fp32 logits (B, V) at the head.

    As the learner computes them: products of the model's own values, summed in fp32. With ``mm_fp32``
    (CUDA, :func:`has_mm_out_dtype`) and half-precision weights one matrix product with fp32 output does
    that without an fp32 copy of the head (``torch.mm(..., out_dtype=float32)``).
    """
    head = model.get_output_embeddings()
    w, bias = head.weight, head.bias
    if mm_fp32 and w.dtype in (torch.bfloat16, torch.float16) and h.dtype == w.dtype:
        logits = torch.mm(h, w.t(), out_dtype=torch.float32)
        return logits if bias is None else logits + bias.float()
    return F.linear(h.float(), w.float(), None if bias is None else bias.float())


def pick(logits: torch.Tensor, temperature: torch.Tensor | None, generator: torch.Generator | None = None):
    """One token per row and its logprob: logits (B, V) fp32 -> (tokens (B,) long, logprobs (B,) fp32).

    ``temperature`` None is greedy (argmax; logprob under ``softmax(logits)``), drawing nothing. Otherwise a
    0-dim or (1,) fp32 tensor T: T > 0 picks ``argmax(logits / T - log E)`` with ``E ~ Exp(1)`` i.i.d. per entry
    (from ``generator``), an exact draw from ``softmax(logits / T)`` (the exponential race: the row's
    log-normalizer shifts every entry alike, so it is left out of the argmax), with no host sync, so it can run
    inside a CUDA graph; T = 0 draws E too but picks the argmax (the same tokens and logprobs as None), so one
    compiled step and one graph serve greedy and sampled calls. The logprob is
    ``logits[tok] / T - logsumexp(logits / T)`` (T = 1 when greedy): no (B, V) log-softmax is written (under
    torch.compile the normalizer is one reduction over the logits).
    """
    if temperature is None:
        scaled = logits
        tok = scaled.argmax(-1)
    else:
        sampling = temperature > 0
        scaled = logits / torch.where(sampling, temperature, 1.0)
        noise = torch.empty_like(scaled).exponential_(generator=generator)
        tok = (scaled - torch.where(sampling, noise.log_(), 0.0)).argmax(-1)  # argmax(p / E): a draw from p
    return tok, scaled.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def has_mm_out_dtype(device: torch.device) -> bool:
    """Whether this torch computes ``torch.mm(bf16, bf16, out_dtype=float32)`` on ``device``."""
    try:
        a = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False
