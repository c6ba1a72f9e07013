"""The vLLM engine: vLLM's offline ``LLM`` in-process, processed (post-temperature) logprobs.

Weights by version:
- ``lora``: a new ``LoRARequest`` (int id = version) per version; the previous adapter is removed
  from the engine once the new one is the one requests use. Version 0 is the base model (no request).
  One ``generate`` call uses one LoRA request for all prompts: vLLM-CPU applies a LoRA to base requests
  when a call mixes them.
- ``full``: vLLM's in-place reload, ``collective_rpc("reload_weights", weights_path=...)`` (the
  model's own ``load_weights`` does not work on CPU), then ``reset_prefix_cache()`` so no cached KV
  of the previous version is reused. On CPU, a tied ``lm_head`` (``tie_word_embeddings``, e.g. the
  small Qwen2.5 models) is then re-packed: vLLM-CPU 0.32 packs each linear's weight into its GEMM
  kernel once, and the reload skips the tied head, so it would keep the previous version's packed
  embedding while ``embed_tokens`` has the new one (greedy output then differs from a fresh engine).
  The re-pack is a callable RPC, so full-weight updates on CPU need the in-process engine
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, :func:`cpu_engine_env`).
- full weights received as tensors (the ``nccl`` transport, :meth:`VLLMEngine.load_tensors`): the same
  reload with a ``weights_iterator``, copied into the running model with no file written, when the
  engine runs in this process (a worker process would get them through vLLM's own IPC: the base
  class's temporary safetensors directory is used instead).
- ``merge_lora``: the engine starts without LoRA support; each adapter is merged into the base
  weights, written once to a private scratch directory, and reloaded as full weights.

Reload warnings. vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer that holds a
tensor and received none, then puts the layer's previous tensors back. Two such layers hold nothing a checkpoint
loads: a rotary embedding (its only tensors are the cos/sin caches, non-persistent buffers computed from the
config) and a tied ``lm_head`` (its weight is ``embed_tokens.weight``, one Parameter: the model's
``load_weights`` skips ``lm_head.*`` and the embedding's load writes the new values into that Parameter, so
the head serves them too). Those warnings are dropped (:func:`_nothing_to_load`, :class:`_ReloadLog`); any other
layer that loaded nothing, or a checkpoint name vLLM reports as not loaded, is still logged and the load raises
RuntimeError (the engine would serve a mix of two versions). Filtering needs the model in this process (the
default); a worker process logs vLLM's warnings as they are.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Iterator

from distrl.rollout.engines.base import Completion, Engine, PromptResult, encode_prompt

CPU_CALL_TOKENS = 3072  # prompt tokens x samples queued at once on CPU (see VLLMEngine.generate_groups)


def cpu_engine_env(actor_index: int, cores: int | None = None) -> dict[str, str]:
    """Environment for an in-process vLLM engine on CPU: each actor bound to its own core."""
    cores = cores or os.cpu_count() or 1
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(actor_index % cores)}


def engine_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` the installed vLLM accepts that is >= ``rank``, from its
    ``MaxLoRARanks`` (1, 8, 16, 32, 64, 128, 256, 320, 512 in vLLM 0.32): ``--lora_rank 48`` gets an
    engine of ``max_lora_rank`` 64, which loads adapters of rank 48. Raises ValueError above the largest."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    accepted = sorted(get_args(MaxLoRARanks))
    for value in accepted:
        if value >= rank:
            return value
    raise ValueError(f"--lora_rank {rank}: vLLM loads LoRA adapters of rank at most {accepted[-1]}")


def _repack_tied_lm_head(worker) -> bool:
    """Run on the vLLM worker: re-pack a tied lm_head's CPU GEMM weights from the (reloaded) embedding.

    Returns whether the model has a tied head. A no-op off CPU, where nothing is pre-packed.
    """
    from vllm.platforms import current_platform

    model = worker.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is None:
        return False
    if head.weight.data_ptr() != embed.weight.data_ptr():
        return False
    if current_platform.is_cpu():
        head.quant_method.process_weights_after_loading(head)
    return True


def _nothing_to_load(worker) -> set[str]:
    """Run on the vLLM worker: class names of the layers that hold tensors a checkpoint never loads, and only
    those: non-persistent buffers (a rotary embedding's cos/sin caches) or parameters that are another layer's
    (a tied lm_head's weight is the embedding's). A class with any other instance is left out."""
    model = worker.get_model()
    owner: dict[int, object] = {}  # data_ptr -> the first layer holding that parameter
    for layer in model.modules():
        for param in layer._parameters.values():
            if param is not None:
                owner.setdefault(param.data_ptr(), layer)
    quiet, loud = set(), set()
    for layer in model.modules():
        params = [p for p in layer._parameters.values() if p is not None]
        buffers = {name for name, b in layer._buffers.items() if b is not None}
        if not params and not buffers:
            continue
        persistent = buffers - layer._non_persistent_buffers_set
        borrowed = all(owner[p.data_ptr()] is not layer for p in params)
        (quiet if not persistent and borrowed else loud).add(type(layer).__name__)
    return quiet - loud


class _ReloadLog(logging.Filter):
    """On vLLM's reload loggers for one reload: drops "<Layer>: Failed to load weights" for the layer classes in
    ``quiet`` (:func:`_nothing_to_load`), keeps every other record and collects the failures in ``failed``."""

    LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")

    def __init__(self, quiet: set[str]):
        super().__init__()
        self.quiet, self.failed = quiet, []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(": Failed to load weights"):
            layer = message.rsplit(":", 1)[0]
            if layer in self.quiet:
                return False
            self.failed.append(f"layer {layer} loaded none of its weights")
        elif message.startswith("Following weights were not loaded"):
            self.failed.append(message)
        return True

    def __enter__(self) -> "_ReloadLog":
        # the failures are read from these records: each logger is enabled at WARNING for the reload, whatever
        # configured logging since (a dictConfig disables the loggers that existed before it; a level may be raised)
        self.saved = {}
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self.saved[name] = (logger.disabled, logger.level)
            logger.disabled = False
            if logger.getEffectiveLevel() > logging.WARNING:
                logger.setLevel(logging.WARNING)
            logger.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.removeFilter(self)
            logger.disabled, level = self.saved[name]
            logger.setLevel(level)


def _in_process(llm) -> bool:
    """Whether `llm`'s model runs in this process (engine core in-process, one uniprocess worker)."""
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    client = llm.llm_engine.engine_core
    return isinstance(client, InprocClient) and isinstance(client.engine_core.model_executor, UniProcExecutor)


class VLLMEngine(Engine):
    """vLLM ``LLM`` in-process, with LoRA enabled (unless ``merge_lora``) and processed logprobs.

    Args:
        model: hub id or directory. tokenizer: optional other tokenizer.
        dtype: torch dtype name (``auto``: float32 on CPU, bfloat16 on GPU); max_lora_rank: largest
        adapter rank it will load (raised to the next rank vLLM accepts: :func:`engine_lora_rank`);
        max_model_len: prompt + completion limit in tokens; seed: sampling seed of the engine;
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only); merge_lora: load LoRA
        versions merged into the base weights (see the module docstring); lora: serve LoRA requests
        (``--finetune lora``); a full fine-tuning run's engine starts without vLLM's LoRA layers, which on
        CUDA rename the weights a full reload replaces (``embed_tokens.base_layer.weight``); max_num_seqs:
        most requests vLLM schedules at once (None: vLLM's default).
    """

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto", max_lora_rank: int = 16,
                 max_model_len: int | None = None, seed: int = 0, gpu_memory_utilization: float = 0.5,
                 merge_lora: bool = False, lora: bool = True, max_num_seqs: int | None = None):
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        # the engine core and its one worker in this process: full weights load in place from tensors
        # (load_tensors), and no process boundary sits between a weight update and the next generate
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu else "float32"
        kwargs = dict(gpu_memory_utilization=gpu_memory_utilization) if on_gpu else dict(enforce_eager=True)
        if max_num_seqs is not None:
            kwargs.update(max_num_seqs=max_num_seqs)
        if lora and not merge_lora:
            kwargs.update(enable_lora=True, max_lora_rank=engine_lora_rank(max_lora_rank), max_loras=2)
        self.llm = LLM(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       logprobs_mode="processed_logprobs", **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.model_config.max_model_len
        self.model, self.merge_lora, self._on_gpu = model, merge_lora, on_gpu
        self.device = torch.device("cuda" if on_gpu else "cpu")
        self._in_process = _in_process(self.llm)
        self.version = 0
        self._lora = None  # the LoRARequest of the version served; None for base or full weights
        self._scratch = None  # weakref.finalize deleting the merged weights of the served version
        self._quiet = None  # layer classes whose reload warnings are dropped (_nothing_to_load), once known

    def load_weights(self, version: int, fmt: str, path: str | Path) -> None:
        """Serve ``version`` from the next ``generate`` on; see the module docstring per format.

        Raises ValueError (bad format or version), and what vLLM raises for a payload it cannot load.
        """
        self._check_load(version, fmt)
        if fmt == "lora" and self.merge_lora:
            self._load_merged(path)
        elif fmt == "lora":
            self._load_lora(version, path)
        else:
            self._reload(weights_path=str(path))
        self.version = version

    def load_tensors(self, version: int, named: list) -> None:
        """Serve full weights given as (name, tensor) pairs (checkpoint names, e.g. a transformers model's
        ``named_parameters()``), copied into the running model by vLLM's ``reload_weights`` with a
        ``weights_iterator``: no file is written. An engine whose worker runs in another process (vLLM's
        multiprocessing, when ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` is set) would receive the tensors through
        vLLM's own IPC: it takes the base class's path through a temporary safetensors directory instead.

        Raises ValueError for a version not newer than the one served.
        """
        if not self._in_process:
            return super().load_tensors(version, named)
        self._check_load(version, "full")
        self._reload(weights_iterator=iter(named))
        self.version = version

    def canary_logprob(self) -> float:
        """See ``Engine.canary_logprob``: the canary as a prompt with ``prompt_logprobs=0``, with the served
        version's LoRA request (temperature 1, so vLLM's processed and raw logprobs are the same)."""
        from vllm import SamplingParams

        from distrl.weights.attest import canary_ids, prompt_canary

        ids = canary_ids(self.llm.model_config.hf_config.vocab_size)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, lora_request=self._lora, use_tqdm=False)
        return prompt_canary(ids, out[0].prompt_logprobs)

    def _load_lora(self, version: int, path: str | Path) -> None:
        from vllm.lora.request import LoRARequest

        old = self._lora
        self._lora = LoRARequest(f"policy-v{version}", version, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)

    def _reload(self, **source) -> None:
        """Replace the weights in place from `source` (``weights_path``: a safetensors checkpoint directory,
        or ``weights_iterator``: (name, tensor) pairs); drop cached prefixes. Raises RuntimeError when vLLM
        reports a layer or a checkpoint name not loaded (see the module docstring: Reload warnings)."""
        if self._quiet is None:
            self._quiet = self.llm.collective_rpc(_nothing_to_load)[0] if self._in_process else set()
        with _ReloadLog(self._quiet) as reload_log:
            self.llm.collective_rpc("reload_weights", kwargs=source)
        if reload_log.failed:
            raise RuntimeError("vLLM's in-place reload left weights of the previous version in place: "
                               + "; ".join(reload_log.failed))
        if not self._on_gpu:  # in-process on CPU (a callable RPC to a worker process would need pickle)
            self.llm.collective_rpc(_repack_tied_lm_head)
        self.llm.reset_prefix_cache()
        self._lora = None  # reload_weights removes every adapter from the engine

    def _load_merged(self, adapter_dir: str | Path) -> None:
        """Merge the adapter into the base weights, write them to a new scratch dir, reload from it."""
        from safetensors.torch import save_file

        from distrl.rollout.engines.merge import local_model_dir, merged_weights

        weights = dict(merged_weights(local_model_dir(self.model), adapter_dir))
        new = Path(tempfile.mkdtemp(prefix="distrl-merged-"))
        save_file(weights, str(new / "model.safetensors"), metadata={"format": "pt"})
        del weights
        self._reload(weights_path=str(new))
        self._drop_scratch()
        self._scratch = weakref.finalize(self, shutil.rmtree, str(new), ignore_errors=True)  # also at exit

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch()
            self._scratch = None

    def generate_groups(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                        between_steps=None, seed: int | None = None) -> Iterator[list[tuple[int, PromptResult]]]:
        """Sample ``n`` completions for each prompt with the served version, yielding each group as soon as
        its last completion ends (see ``Engine.generate_groups``).

        Request level: the groups' requests are queued (``LLM.enqueue``) and the engine stepped
        (``llm_engine.step``); a group is yielded at the step its last request finishes. On CPU a group
        is queued only while the prompt tokens x samples of the queued, unfinished groups stay within
        ``CPU_CALL_TOKENS`` (at least one group): vLLM-CPU 0.32 fails with "CPU Generator does not use
        offset" when seeded requests meet a prefill it splits over steps, which it does past 4096
        batched tokens. On GPU every group is queued at once. A generator closed early aborts its
        unfinished requests. Raises ValueError with ``between_steps`` (no in-flight updates).
        """
        if between_steps is not None:
            raise ValueError("in-flight weight updates need --engine hf (vLLM's offline LLM generates in one call)")
        from vllm import SamplingParams

        # vLLM refuses greedy sampling with n > 1: send each prompt n times with n = 1 instead.
        copies = n if temperature == 0 else 1
        requests = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]
        cost = [0 if self._on_gpu else len(self._prompt_ids(r)) * n for r in requests]
        owner: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, copy)
        outputs: dict[int, dict[int, object]] = {}
        queued, in_flight = 0, 0
        try:
            while queued < len(prompts) or owner:
                while queued < len(prompts) and (not owner or in_flight + cost[queued] <= CPU_CALL_TOKENS):
                    # detokenize=False: vLLM's per-token detokenizing (text and the sampled token's logprob
                    # entry) is Python work per row and step; the text is decoded once per completion instead
                    params = [SamplingParams(n=n // copies, temperature=temperature, top_p=1.0, top_k=-1,
                                             max_tokens=max_new_tokens, logprobs=0, detokenize=False,
                                             seed=None if seed is None else seed + queued * n + c)
                              for c in range(copies)]
                    ids = self.llm.enqueue([requests[queued]] * copies, params, lora_request=self._lora,
                                           use_tqdm=False)
                    # outputs carry the external id: enqueue returns "<external>-<8 random characters>"
                    owner.update({rid.rsplit("-", 1)[0]: (queued, c) for c, rid in enumerate(ids)})
                    outputs[queued], in_flight, queued = {}, in_flight + cost[queued], queued + 1
                ended = []
                for out in self.llm.llm_engine.step():
                    if out.finished and out.request_id in owner:
                        i, c = owner.pop(out.request_id)
                        outputs[i][c] = out
                        if len(outputs[i]) == copies:
                            in_flight -= cost[i]
                            done = outputs.pop(i)
                            ended.append((i, _result([done[c] for c in range(copies)], self.tokenizer)))
                if ended:
                    yield sorted(ended, key=lambda e: e[0])
        finally:
            if owner:  # closed early (or failed): nothing of this call stays queued
                self.llm.llm_engine.abort_request(list(owner))

    def _prompt_ids(self, request) -> list[int]:
        return request["prompt_token_ids"] if isinstance(request, dict) else encode_prompt(self.tokenizer, request)

    def close(self) -> None:
        """Delete the merged-weights scratch directory. The in-process engine is freed with the object."""
        self._drop_scratch()


def _result(outputs: list, tokenizer) -> PromptResult:
    """One prompt's vLLM RequestOutputs (its copies, in order; generated with ``detokenize=False``) as a
    PromptResult: token ids, processed logprobs of the sampled tokens, text (``tokenizer.batch_decode``,
    special tokens skipped, as vLLM's own detokenizer) and finish reason of each completion."""
    outs = [c for out in outputs for c in out.outputs]
    ids = [list(c.token_ids) for c in outs]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    completions = [Completion(t, [step[tok].logprob for step, tok in zip(c.logprobs, t)], text,
                              c.finish_reason or "stop") for c, t, text in zip(outs, ids, texts)]
    return PromptResult(list(outputs[0].prompt_token_ids), completions)
