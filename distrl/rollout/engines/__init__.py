"""Generation engines behind one interface (:class:`Engine`): vLLM (:mod:`.vllm`) and transformers
(:mod:`.hf`, a subpackage).

Importing this package is cheap: a backend imports vLLM or transformers only when it is built.
:func:`make_engine` lives here, above the backends, so that ``base`` imports none of them (no import cycle).
"""

from distrl.core.probe import probe
from distrl.rollout.engines.base import ENGINES, FORMATS, Completion, Engine, PromptResult
from distrl.rollout.engines.vllm import VLLMEngine, cpu_engine_env

__all__ = ["ENGINES", "FORMATS", "Completion", "Engine", "PromptResult", "VLLMEngine", "cpu_engine_env",
           "make_engine"]


def make_engine(kind: str, model: str, tokenizer: str | None = None, dtype: str = "auto", max_lora_rank: int = 16,
                max_model_len: int | None = None, seed: int = 0, merge_lora: bool = False,
                batching: str = "continuous", max_num_seqs: int | None = None, lora: bool = True,
                gpu_memory_utilization: float = 0.5) -> Engine:
    """The generation engine of ``kind`` (``--engine``): ``vllm`` or ``hf``.

    Args:
        kind: ``vllm`` (vLLM's offline LLM, in-process) or ``hf`` (transformers).
        model: hub id or directory of the causal LM (version 0).
        tokenizer: another tokenizer's hub id or directory (default: the model's).
        dtype: torch dtype name; ``auto`` is float32 on CPU and bfloat16 on GPU.
        max_lora_rank: largest LoRA rank vLLM will load (unused by ``hf`` and with ``merge_lora``).
        max_model_len: prompt + completion limit in tokens (default: the model's).
        seed: sampling seed of the engine.
        merge_lora: load LoRA versions by merging them into the base weights (W + B A alpha/r) and
            loading the result as full weights, for engines without LoRA support.
        batching: ``continuous`` or ``static`` (``hf``; vLLM's scheduler is continuous).
        max_num_seqs: most completions decoded at once (None: all of a call for ``hf``, vLLM's default).
        lora: the run trains LoRA adapters (``--finetune lora``); ``vllm`` then serves LoRA requests.
        gpu_memory_utilization: fraction of the GPU's memory ``vllm`` takes on CUDA (unused by ``hf``).
    Raises:
        ValueError: an unknown ``kind``.
        RuntimeError: ``vllm`` when importing it killed or failed a child process on this host
            (:func:`distrl.core.probe.probe`; the commands check this before any role starts).
    """
    if kind == "vllm":
        checked = probe("vllm")  # never import what could kill this process: cached, normally passed already
        if not checked.ok:
            raise RuntimeError(f"{checked.line()}: use --engine hf")
        return VLLMEngine(model, tokenizer, dtype, max_lora_rank, max_model_len, seed, merge_lora=merge_lora,
                          max_num_seqs=max_num_seqs, lora=lora, gpu_memory_utilization=gpu_memory_utilization)
    if kind == "hf":
        from distrl.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer, dtype, max_model_len, seed, merge_lora=merge_lora, batching=batching,
                        max_num_seqs=max_num_seqs)
    raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINES}")
