"""The transformers engine (``--engine hf``): batched sampling with a KV cache, for machines without vLLM.

Batching (``batching``): ``continuous`` (the default) keeps ``max_num_seqs`` rows decoding and gives a
row's slot to a waiting row as soon as it ends (:mod:`distrl.rollout.engines.hf.continuous`); ``static`` runs
batches of ``max_num_seqs`` rows, each to its longest row. Either way :meth:`HFEngine.generate_groups`
yields each group when its last completion ends (the actor scores and PUTs it then).

Static sampling: each prompt is repeated ``n`` times, the batch is left-padded (positions count real tokens
only), and one loop samples every row with the KV cache of ``model(..., past_key_values=...)``. At
each step the head runs in fp32 on the last hidden state, as the learner's does (``distrl/learn/logprobs.py``):
``logp = log_softmax(linear(h.float(), W_head.float()) / T)``; the token is drawn from ``exp(logp)``
(no top-k/top-p) and its ``logp`` is the behavior logprob. A row ends after a stop token (the
tokenizer's and the generation config's EOS ids; kept in the ids, left out of the text, finish reason
``stop``, as vLLM does) or at its budget (``length``). ``temperature == 0`` is greedy, with logprobs
of ``log_softmax(logits)``.

Weights by version:
- ``lora``: the first adapter is loaded into a ``PeftModel``; later versions of the same shape are
  copied into its tensors in place (another shape replaces the adapter).
- ``full``: the safetensors tensors are copied in place into the model's parameters.
- ``merge_lora``: the adapter is merged into the base checkpoint's weights
  (:func:`distrl.rollout.engines.merge.merged_weights`) and copied in place like full weights.

Fast path (``fast``, on by default on CUDA): :class:`distrl.rollout.engines.hf.static.StaticSampler` samples the
same way over a static KV cache with the decode step captured once in a CUDA graph (same tokens and
logprobs; see that module); continuous batching captures its own step the same way. Loads that change
modules rather than values (the first adapter, another adapter shape, unloading it) drop the graphs,
which are captured again at the next step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from distrl.core.dtypes import resolve_dtype
from distrl.rollout.engines.base import Completion, Engine, PromptResult, encode_prompt
from distrl.rollout.engines.hf.continuous import ContinuousSampler, Finished
from distrl.rollout.engines.hf.decode import supports_static
from distrl.rollout.engines.hf.static import StaticSampler
from distrl.rollout.engines.merge import (
    checkpoint_shapes,
    iter_safetensors,
    local_model_dir,
    merged_weights,
    read_safetensors,
)

INFLIGHT_INTERVAL = 8  # decode steps between checks for a newer version during an in-flight update
BATCHING = ("continuous", "static")


class HFEngine(Engine):
    """A transformers causal LM on one device, sampled by :meth:`generate` (see the module docstring).

    Args:
        model: hub id or directory. tokenizer: optional other tokenizer. dtype: torch dtype name
        (``auto``: float32 on CPU, bfloat16 on GPU). max_model_len: prompt + completion limit in
        tokens (default: the model's ``max_position_embeddings``). seed: sampling seed.
        merge_lora: load LoRA versions merged into the base weights. device: default ``cuda`` when
        available, else ``cpu``. fast: sample with the static-cache fast path (CUDA graphs on CUDA,
        eager elsewhere); default: on when the device is CUDA and the model has no sliding-window layers.
        fast_compile: run the fast path's decode step through ``torch.compile`` before capturing it
        (fuses its elementwise kernels, docs/generate_fast.md; costs tens of seconds of compiling, once: sizes
        are symbolic, so later shapes only capture a graph); default: on with the fast path on CUDA (static and
        continuous batching alike).
        batching: ``continuous`` (rows refilled as they end, :mod:`distrl.rollout.engines.hf.continuous`; a model
        with sliding-window layers is batched statically) or ``static`` (batches of ``max_num_seqs``
        rows, each run to its longest row, through the fast path or the engine's own loop).
        max_num_seqs: most rows (completions) decoded at once; default: all rows of a call.
    """

    supports_inflight = True

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, merge_lora: bool = False,
                 device: str | None = None, fast: bool | None = None, fast_compile: bool | None = None,
                 batching: str = "continuous", max_num_seqs: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        base = AutoModelForCausalLM.from_pretrained(model, dtype=resolve_dtype(dtype)).to(self.device).eval()
        self._setup(base, AutoTokenizer.from_pretrained(tokenizer or model), model, max_model_len, seed, merge_lora)
        cuda = self.device.type == "cuda"
        fast = cuda and supports_static(base.config) if fast is None else fast
        self._batching(batching, max_num_seqs, fast, cuda if fast_compile is None else fast_compile)

    def _batching(self, batching: str, max_num_seqs: int | None, fast: bool, compile_step: bool) -> None:
        """Set up the sampler of ``batching`` (see __init__; ``fast``: CUDA graphs on CUDA, the static
        path's StaticSampler). Raises ValueError for an unknown batching or ``max_num_seqs`` < 1."""
        if batching not in BATCHING:
            raise ValueError(f"unknown batching {batching!r}; expected one of {BATCHING}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        args = (lambda: self.base, self.pad_id, self.stop_ids, self.generator)
        kwargs = dict(cuda_graphs=fast and self.device.type == "cuda", interval=INFLIGHT_INTERVAL,
                      compile_step=fast and compile_step)
        if batching == "continuous" and supports_static(self.base.config):
            self._continuous = ContinuousSampler(*args, **kwargs)
        elif fast:
            self._fast = StaticSampler(*args, **kwargs)

    @classmethod
    def sharing(cls, model, tokenizer, max_model_len: int | None = None, seed: int = 0, batching: str = "continuous",
                max_num_seqs: int | None = None) -> "HFEngine":
        """An engine that samples with an existing ``model`` object (e.g. the learner's, LoRA-wrapped or
        not): no copy, so it always serves the model's current weights; its ``version`` stays 0 (the model's
        owner holds the policy version: distrl.rollout.learner_generates reads the learner's).
        Never call ``load_weights`` on it (the owner changes the weights). ``tokenizer``: a tokenizer.
        On CUDA it samples through the fast path (captured graphs stay valid: optimizers update the
        weights in place) unless the model is PEFT-wrapped (its adapters may be swapped).
        ``batching``, ``max_num_seqs``: as in __init__."""
        engine = cls.__new__(cls)
        engine.device = next(model.parameters()).device
        engine._setup(model, tokenizer, getattr(model, "name_or_path", "shared"), max_model_len, seed, False)
        fast = engine.device.type == "cuda" and not hasattr(model, "peft_config") and supports_static(model.config)
        engine._batching(batching, max_num_seqs, fast, compile_step=True)
        return engine

    def _setup(self, base, tokenizer, model_name: str, max_model_len: int | None, seed: int,
               merge_lora: bool) -> None:
        """Everything but loading: stop ids, padding, generator, version 0 (see __init__)."""
        self.base, self.tokenizer = base, tokenizer
        self.model_name, self.merge_lora = model_name, merge_lora
        self.max_model_len = max_model_len or self.base.config.max_position_embeddings
        eos = self.base.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"{model_name}: neither the tokenizer nor the generation config names an EOS token")
        self.stop_ids = torch.tensor(sorted(set(eos)), device=self.device)  # (E,)
        pad = self.tokenizer.pad_token_id
        self.pad_id = eos[0] if pad is None else pad
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.version = 0
        self._peft = None  # the PeftModel wrapping self.base while a LoRA version is served
        self._between_steps = None
        self._adapter: str | None = None
        self._adapter_shape: tuple | None = None  # (r, alpha, targets) of the served adapter
        self._fast = None  # the fast path's StaticSampler (static batching); None: the loop of _sample
        self._continuous = None  # the ContinuousSampler (continuous batching); None: static batching
        self.max_num_seqs = None  # most rows decoded at once (None: all rows of a call)

    def graph_captures(self) -> int:
        return sum(s.captures for s in (self._fast, self._continuous) if s is not None)

    # -- generation -----------------------------------------------------------------------------

    def warm_up(self, rows: int | None = None) -> None:
        """On CUDA's fast path: a greedy call of two rows of two tokens compiles the decode step (with symbolic
        sizes: a later call's state only captures its graphs, under a second) and the LM head's passes; on CPU
        nothing (no compilation there). It draws from the engine's generator like any call. ``rows`` (continuous
        batching): the most rows a later call decodes at once (capped by ``max_num_seqs``), reserved in every
        state's K/V first, which makes the compilation shorter (``ContinuousSampler.reserve``)."""
        if self.device.type == "cuda" and (self._continuous is not None or self._fast is not None):
            if rows and self._continuous is not None:
                self._continuous.reserve(min(rows, self.max_num_seqs or rows))
            self.generate(["Hello", "Hi"], 1, 0.0, 2)

    def generate_groups(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                        between_steps=None, seed: int | None = None) -> Iterator[list[tuple[int, PromptResult]]]:
        """Sample ``n`` completions for each prompt with the served version, yielding each group as soon
        as its last completion ends (see ``Engine.generate_groups``).

        ``between_steps``: called every ``INFLIGHT_INTERVAL`` decode steps; it may load a newer version
        in place (the running rows go on with it: an in-flight update) or raise to abort the call.
        Each completion's ``versions`` are the served versions at its first and last token (static
        batching: at the start and end of its batch).
        Raises ValueError for a prompt of ``max_model_len`` tokens or more, or a negative temperature.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if seed is not None:
            self.generator.manual_seed(seed)
        prompt_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        rows = [ids for ids in prompt_ids for _ in range(n)]
        budget = self._budgets(rows, max_new_tokens)
        self._between_steps = between_steps
        pending: dict[int, list] = {p: [None] * n for p in range(len(prompt_ids))}
        for finished in self._rows(rows, budget, temperature):
            ended = []
            for f in finished:
                p, j = divmod(f.row, n)
                pending[p][j] = self._completion(f)
                if all(c is not None for c in pending[p]):
                    ended.append((p, PromptResult(list(prompt_ids[p]), pending.pop(p))))
            if ended:
                yield sorted(ended, key=lambda e: e[0])

    def _completion(self, f: Finished) -> Completion:
        shown = f.tokens[:-1] if f.stopped else f.tokens  # as vLLM: the stop token is not in the text
        return Completion(f.tokens, f.logprobs, self.tokenizer.decode(shown, skip_special_tokens=True),
                          "stop" if f.stopped else "length", f.versions)

    def _budgets(self, rows: list[list[int]], max_new_tokens: int) -> list[int]:
        """Each row's most new tokens under max_model_len; ValueError for a prompt that leaves no room."""
        too_long = [len(r) for r in rows if len(r) >= self.max_model_len]
        if too_long:
            raise ValueError(f"a prompt of {too_long[0]} tokens leaves no room under max_model_len "
                             f"{self.max_model_len}")
        return [min(max_new_tokens, self.max_model_len - len(r)) for r in rows]

    def _rows(self, rows: list[list[int]], budget: list[int], temperature: float) -> Iterator[list[Finished]]:
        """Every row sampled, yielded as it ends (continuous) or per batch of ``max_num_seqs`` rows (static)."""
        if not rows:
            return
        if self._continuous is not None:
            yield from self._continuous.run(rows, budget, temperature, self.max_num_seqs,
                                            between_steps=self._between_steps, stamp=lambda: self.version)
            return
        size = self.max_num_seqs or len(rows)
        for start in range(0, len(rows), size):
            first = self.version
            out = self._sample(rows[start:start + size], temperature, budget[start:start + size])
            tokens, logps, lengths, stopped = (x.tolist() for x in out)
            yield [Finished(start + i, tokens[i][:n], logps[i][:n], stopped[i], (first, self.version))
                   for i, n in enumerate(lengths)]

    @torch.inference_mode()
    def _sample(self, rows: list[list[int]], temperature: float, budget: list[int]):
        """Sample every row to its stop token or budget (one static batch).

        Args: rows: B prompt id lists. temperature: as in ``generate``. budget: B most-new-token counts.
        Returns: tokens (B, S) long (pad after each row's end), logprobs (B, S) fp32 (0 after the
        end), lengths (B,) long, stopped (B,) bool (ended on a stop token), with S the most steps run.
        """
        b, longest = len(rows), max(len(r) for r in rows)
        if self._fast is not None:
            return self._fast.sample(rows, budget, temperature, self._between_steps)
        budget = torch.tensor(budget, device=self.device)
        ids = torch.full((b, longest), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((b, longest), dtype=torch.long, device=self.device)
        for i, r in enumerate(rows):  # left padding
            ids[i, longest - len(r):] = torch.tensor(r, device=self.device)
            mask[i, longest - len(r):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): real tokens count from 0
        steps = int(budget.max())
        tokens = torch.full((b, steps), self.pad_id, dtype=torch.long, device=self.device)
        logps = torch.zeros((b, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        done = budget <= 0
        logits, cache = self._forward(ids, mask, positions, None)
        for t in range(steps):
            tok, lp = self._pick(logits, temperature)  # (B,), (B,)
            active = ~done
            tokens[:, t] = torch.where(active, tok, self.pad_id)
            logps[:, t] = torch.where(active, lp, 0.0)
            lengths += active.long()
            hit = active & torch.isin(tok, self.stop_ids)
            stopped |= hit
            done |= hit | (lengths >= budget)
            if bool(done.all()):
                return tokens[:, : t + 1], logps[:, : t + 1], lengths, stopped
            if self._between_steps is not None and (t + 1) % INFLIGHT_INTERVAL == 0:
                self._between_steps()
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
            logits, cache = self._forward(tokens[:, t : t + 1], mask, positions, cache)
        return tokens, logps, lengths, stopped

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache):
        """One cached forward: ids (B, L), mask (B, past + L), positions (B, L) -> last logits (B, V) fp32.

        The head runs in fp32 on the final hidden state, as the learner computes its logprobs.
        """
        out = self.base.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions,
                                      past_key_values=cache, use_cache=True)
        head = self.base.get_output_embeddings()
        bias = None if head.bias is None else head.bias.float()
        logits = F.linear(out.last_hidden_state[:, -1].float(), head.weight.float(), bias)  # (B, V)
        return logits, out.past_key_values

    def _pick(self, logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, V) fp32 -> (sampled token (B,), its logprob under softmax(logits / T) (B,))."""
        if temperature > 0:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    # -- weights --------------------------------------------------------------------------------

    def canary_logprob(self) -> float:
        """See ``Engine.canary_logprob``: the decoder and the fp32 head, as the learner computes it."""
        from distrl.weights.attest import canary_logprob

        return canary_logprob(self.base.get_decoder(), self.base.get_output_embeddings(), self.base.config.vocab_size)

    def load_weights(self, version: int, fmt: str, path: str | Path) -> None:
        """Serve ``version`` from the next ``generate`` on; see the module docstring per format.

        Raises ValueError (bad format or version; a checkpoint whose tensor names or shapes do not
        match the model), and what peft raises for an adapter it cannot load.
        """
        self._check_load(version, fmt)
        if fmt == "lora" and not self.merge_lora:
            self._load_lora(version, path)
        elif fmt == "lora":
            base_dir = local_model_dir(self.model_name)
            self._copy_in(merged_weights(base_dir, path), checkpoint_shapes(base_dir), path)
        else:
            if self._peft is not None:  # a full version replaces the adapter too
                self.base, self._peft, self._adapter, self._adapter_shape = self._peft.unload(), None, None, None
                self._modules_changed()
            self._copy_in(iter_safetensors(path), checkpoint_shapes(path), path)
        self.version = version

    def load_tensors(self, version: int, named: list) -> None:
        """Copy full weights given as (name, tensor) pairs into the model in place."""
        self._check_load(version, "full")
        if self._peft is not None:
            self.base, self._peft, self._adapter, self._adapter_shape = self._peft.unload(), None, None, None
            self._modules_changed()
        self._copy_in(iter(named), {n: tuple(t.shape) for n, t in named}, "broadcast")
        self.version = version

    @torch.inference_mode()  # always: a load from an in-flight update runs inside _sample's inference mode
    def _load_lora(self, version: int, path: str | Path) -> None:
        """Serve the adapter at `path`. The first one is wrapped into a PeftModel; a later one with the
        same shape (rank, alpha, target modules) is copied into the served adapter's tensors in place,
        which is much faster than building new adapter layers; another shape replaces the adapter."""
        import json

        from peft import PeftModel, set_peft_model_state_dict

        path = Path(path)
        config = json.loads((path / "adapter_config.json").read_text())
        shape = (config.get("r"), config.get("lora_alpha"), sorted(config.get("target_modules") or []))
        name = f"v{version}"
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.base, str(path), adapter_name=name, is_trainable=False)
        elif shape == self._adapter_shape:
            weights = {k: t.to(self.device) for k, t in read_safetensors(path / "adapter_model.safetensors")}
            result = set_peft_model_state_dict(self._peft, weights, adapter_name=self._adapter)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"{path}: adapter tensors {result.unexpected_keys[:3]} match no LoRA layer")
            name = self._adapter  # the served adapter now holds this version's tensors
        else:
            self._peft.load_adapter(str(path), adapter_name=name, is_trainable=False)
            self._peft.set_adapter(name)
            self._peft.delete_adapter(self._adapter)
        self._peft.eval()
        if name != self._adapter:  # new LoRA layers (or none): the fast path's graphs are stale
            self._modules_changed()
        self._adapter, self._adapter_shape = name, shape

    def _modules_changed(self) -> None:
        """The model's modules changed (not only their values): drop the fast path's captured graphs."""
        for sampler in (self._fast, self._continuous):
            if sampler is not None:
                sampler.reset()

    @torch.inference_mode()
    def _copy_in(self, tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple], source) -> None:
        """Copy checkpoint tensors into the parameters of the same names, after checking every name and shape.

        A parameter tied to another (the head and the embedding) counts as loaded when one of its names is.
        """
        params = dict(self.base.named_parameters(remove_duplicate=False))
        unknown = [k for k in shapes if k not in params or tuple(params[k].shape) != shapes[k]]
        if unknown:
            k = unknown[0]
            raise ValueError(f"{source}: tensor {k} {shapes[k]} does not match the model "
                             f"({tuple(params[k].shape) if k in params else 'no such parameter'})")
        loaded = {id(params[k]) for k in shapes}
        missing = [k for k, p in params.items() if id(p) not in loaded]
        if missing:
            raise ValueError(f"{source}: no weights for {missing[:3]} ({len(missing)} parameters)")
        for name, tensor in tensors:
            params[name].copy_(tensor.to(self.device))
