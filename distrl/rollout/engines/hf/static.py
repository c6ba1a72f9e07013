"""The HF engine's static-batch sampler, its fast path on GPU: prefill, then one decode step over a static KV
cache, captured once in a CUDA graph and replayed per token.

What the engine's own loop (:meth:`distrl.rollout.engines.hf.engine.HFEngine._sample`) does per token with a growing
(dynamic) cache and many small launches, :class:`StaticSampler` does with fixed buffers, so the whole
step can be recorded once (``torch.cuda.CUDAGraph``) and replayed:

1. Prefill: the left-padded prompts (B, P) run through the decoder into a transformers ``StaticCache``
   of ``L = P + S`` slots per row; a (B, L) bool ``valid`` marks the slots holding real tokens.
2. Decode step (the graph): mark the next slot valid, run the decoder on the last tokens (B, 1) with
   the 4-D mask ``valid[:, None, None, :]`` and the rows' positions, take fp32 logits at the head,
   pick the token (argmax for T = 0; otherwise ``argmax(logits / T - log E)`` with ``E ~ Exp(1)``, an
   exact draw from ``softmax(logits / T)``, the trick vLLM's sampler uses), take its logprob
   ``logits[tok] / T - logsumexp(logits / T)`` in fp32 (:func:`.decode.pick`), and write token, logprob, length,
   stop flag and done flag into the static output buffers at the step index. Finished rows keep decoding
   padding but are masked out of every output, as in the engine's loop.
3. The host replays the graph once per token and looks at ``done`` only every ``interval`` steps (one
   device sync per interval, where the engine's in-flight hook runs too), stopping when every row is
   done; outputs are cut to the longest row.

Departures from the engine's loop (same tokens and logprobs; see ``tests/integration/test_hf_fast.py``):
attention is :func:`.decode.grouped_attention` (heads of a group share their K/V without copying them, as
``repeat_kv`` would), the sampled tokens come from another random stream (Exp(1) noise instead of
``multinomial``), and prompt and completion lengths are rounded up to ``.decode.PAD_MULTIPLE`` so calls of
similar size reuse one cache and one captured graph.

``compile_step`` runs the step through ``torch.compile`` (inductor, no cudagraphs of its own) before
capturing it: the graph then replays a few fused Triton kernels instead of about a thousand small eager
ones (:func:`.decode.compiled_step`; timings in ``docs/generate_fast.md``).

Weights: the graph holds pointers to the parameters, so new versions must be copied into the same
tensors (``copy_``), never rebound; the engine's full, merged-LoRA and same-shape LoRA loads do that.
A load that changes the modules (the first LoRA adapter, an adapter of another shape, unloading it)
must call :meth:`StaticSampler.reset`, which drops the graphs; the next step captures them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from distrl.rollout.engines.hf.decode import (
    ATTENTION,
    PAD_MULTIPLE,
    compiled_step,
    grouped_attention,
    has_mm_out_dtype,
    head_logits,
    pick,
    round_up,
    step_graph,
    supports_static,
)


@dataclass
class _State:
    """The static buffers of one (B, P, S) shape; captured graphs point into them (L = P + S)."""

    cache: object  # transformers StaticCache with L slots per row
    valid: torch.Tensor  # (B, L) bool: slot holds a real token
    tok: torch.Tensor  # (B, 1) long: the tokens the next step feeds
    pos: torch.Tensor  # (B, 1) long: their positions (real tokens counted from 0)
    slot: torch.Tensor  # (1,) long: the cache slot the next step writes
    step: torch.Tensor  # (1,) long: the output column the next record writes
    tokens: torch.Tensor  # (B, S) long, pad after each row's end
    logps: torch.Tensor  # (B, S) fp32, 0 after each row's end
    lengths: torch.Tensor  # (B,) long
    stopped: torch.Tensor  # (B,) bool: ended on a stop token
    done: torch.Tensor  # (B,) bool
    budget: torch.Tensor  # (B,) long: most tokens per row
    temperature: torch.Tensor  # () fp32, 0 when greedy
    graphs: dict = field(default_factory=dict)  # one torch.cuda.CUDAGraph (key 0) for greedy and sampled calls


class StaticSampler:
    """Samples rows to their stop token or budget with a static cache (see the module docstring).

    Args:
        model_fn: returns the causal LM to run (called at each ``sample``: the engine may rebind it).
        pad_id: token fed to and written for finished rows.
        stop_ids: (E,) long tensor of stop tokens on the model's device; E = 0 never stops early.
        generator: torch.Generator on the model's device, for the Exp(1) noise.
        cuda_graphs: capture the decode step in a CUDA graph (needs a CUDA model); False runs the same
            code eagerly (CPU, or to check the graph against).
        interval: decode steps between looks at ``done`` (and calls of ``between_steps``).
        compile_step, compile_dynamic: run the decode step through ``torch.compile`` before capturing it
            (:func:`.decode.compiled_step`).
    Raises:
        ValueError: ``cuda_graphs`` without CUDA, or a model with sliding-window layers.
    """

    def __init__(self, model_fn: Callable, pad_id: int, stop_ids: torch.Tensor, generator: torch.Generator,
                 cuda_graphs: bool, interval: int = 8, compile_step: bool = False, compile_dynamic: bool = True):
        from transformers import AttentionInterface

        model = model_fn()
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA model, not one on {model.device}")
        if not supports_static(model.config):
            raise ValueError("the static-cache fast path supports full-attention models only (sliding window found)")
        AttentionInterface.register(ATTENTION, grouped_attention)
        self.model_fn, self.pad_id, self.stop_ids, self.generator = model_fn, pad_id, stop_ids, generator
        self.cuda_graphs, self.interval = cuda_graphs, interval
        self.captures = 0  # graphs captured so far
        self._state: _State | None = None
        self._mm_fp32 = model.device.type == "cuda" and has_mm_out_dtype(model.device)
        self._decode_fn = compiled_step(self._decode, compile_step, compile_dynamic)

    def reset(self) -> None:
        """Drop the captured graphs; call after the model's modules (not only their values) changed."""
        if self._state is not None:
            self._state.graphs.clear()

    @torch.inference_mode()
    def sample(self, rows: list[list[int]], budget: list[int], temperature: float, between_steps=None):
        """Sample every row to its stop token or budget.

        Args:
            rows: B prompt id lists (each non-empty). budget: B most-new-token counts (>= 1 to sample).
            temperature: 0 is greedy; > 0 samples from softmax(logits / T).
            between_steps: called every ``interval`` decode steps while rows are running (it may copy
                new weights in place, or change modules and call :meth:`reset`).
        Returns:
            tokens (B, S) long (pad after each row's end), logprobs (B, S) fp32 (0 after the end),
            lengths (B,) long, stopped (B,) bool, with S the longest row; on the model's device.
        """
        model = self.model_fn()
        steps = max(budget)
        st = self._prepare(model, len(rows), round_up(max(len(r) for r in rows), PAD_MULTIPLE),
                           round_up(steps, PAD_MULTIPLE))
        config = model.config
        previous, config._attn_implementation = config._attn_implementation, ATTENTION
        try:
            if steps > 0:
                self._prefill(model, st, rows, budget, temperature)
            for t in range(steps - 1):  # t: the last recorded step
                if (t + 1) % self.interval == 0:
                    if bool(st.done.all()):
                        break
                    if between_steps is not None:
                        between_steps()
                self._step(model, st)
        finally:
            config._attn_implementation = previous
        n = int(st.lengths.max()) if steps > 0 else 0
        return st.tokens[:, :n].clone(), st.logps[:, :n].clone(), st.lengths.clone(), st.stopped.clone()

    # -- buffers, prefill, one step -----------------------------------------------------------

    def _prepare(self, model, b: int, p: int, s: int) -> _State:
        """The state for shape (B, P, S), reused when the last call had the same one."""
        st = self._state
        if st is not None and st.tokens.shape == (b, s) and st.valid.shape == (b, p + s):
            return st
        from transformers import StaticCache

        self._state = None  # free the old buffers and graphs first
        dev = model.device
        long = dict(dtype=torch.long, device=dev)
        st = _State(cache=StaticCache(config=model.config, max_cache_len=p + s),
                    valid=torch.zeros((b, p + s), dtype=torch.bool, device=dev),
                    tok=torch.zeros((b, 1), **long), pos=torch.zeros((b, 1), **long),
                    slot=torch.zeros(1, **long), step=torch.zeros(1, **long),
                    tokens=torch.zeros((b, s), **long), logps=torch.zeros((b, s), dtype=torch.float32, device=dev),
                    lengths=torch.zeros(b, **long), stopped=torch.zeros(b, dtype=torch.bool, device=dev),
                    done=torch.zeros(b, dtype=torch.bool, device=dev), budget=torch.zeros(b, **long),
                    temperature=torch.ones((), dtype=torch.float32, device=dev))
        self._state = st
        return st

    def _prefill(self, model, st: _State, rows, budget, temperature: float) -> None:
        """Reset the state, run the prompts into the cache and record step 0."""
        b, p = len(rows), st.valid.shape[1] - st.tokens.shape[1]
        ids = torch.full((b, p), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, p), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding
            ids[i, p - len(r):] = torch.tensor(r)
            mask[i, p - len(r):] = 1
        ids, mask = ids.to(st.tok.device), mask.to(st.tok.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        st.cache.reset()
        st.valid.zero_()
        st.valid[:, :p] = mask.bool()
        slots = torch.arange(st.valid.shape[1], device=ids.device)
        causal = slots[None, :] <= slots[:p, None]  # (P, L)
        out = model.get_decoder()(input_ids=ids, attention_mask=st.valid[:, None, None, :] & causal,
                                  position_ids=positions, past_key_values=st.cache, use_cache=True)
        st.budget.copy_(torch.tensor(budget))
        for buf in (st.lengths, st.stopped, st.step, st.logps):
            buf.zero_()
        st.done.copy_(st.budget <= 0)
        st.tokens.fill_(self.pad_id)
        st.temperature.fill_(temperature)
        self._record(st, self._logits(model, out.last_hidden_state[:, -1]))
        st.pos.copy_(positions[:, -1:] + 1)
        st.slot.fill_(p)

    def _decode(self, model, st: _State) -> None:
        """One decode step on the static buffers (what the graph records)."""
        st.valid.index_fill_(1, st.slot, True)
        out = model.get_decoder()(input_ids=st.tok, attention_mask=st.valid[:, None, None, :],
                                  position_ids=st.pos, past_key_values=st.cache, use_cache=True)
        self._record(st, self._logits(model, out.last_hidden_state[:, -1]))
        st.pos.add_(1)
        st.slot.add_(1)

    def _step(self, model, st: _State) -> None:
        """Replay the captured step; without one, run it eagerly, then (CUDA graphs) capture it."""
        if step_graph(st.graphs, 0, lambda: self._decode_fn(model, st), self.generator,
                      self.cuda_graphs, st.tok.device):
            self.captures += 1

    def _logits(self, model, h: torch.Tensor) -> torch.Tensor:
        """h (B, hidden) in the model's dtype -> fp32 logits (B, V) at the head (:func:`head_logits`)."""
        return head_logits(model, h, self._mm_fp32)

    def _record(self, st: _State, logits: torch.Tensor) -> None:
        """Pick a token per row from logits (B, V) fp32 and record it at column ``st.step``."""
        tok, lp = pick(logits, st.temperature, self.generator)
        active = ~st.done
        tok = torch.where(active, tok, self.pad_id)
        st.tokens.index_copy_(1, st.step, tok[:, None])
        st.logps.index_copy_(1, st.step, torch.where(active, lp, 0.0)[:, None])
        st.lengths.add_(active.long())
        hit = active & (tok[:, None] == self.stop_ids).any(-1)
        st.stopped.logical_or_(hit)
        st.done.logical_or_(hit | (st.lengths >= st.budget))
        st.tok.copy_(tok[:, None])
        st.step.add_(1)
