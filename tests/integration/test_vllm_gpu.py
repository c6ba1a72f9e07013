"""vLLM for CUDA serving distrl's weight updates (issue 22, needs an NVIDIA GPU and vLLM for CUDA).

``VLLMEngine`` (the engine ``distrl rollout --engine vllm`` builds) serves two LoRA versions
(``load_weights(v, "lora", dir)``, a ``--finetune lora`` run's engine), then, in a ``--finetune full`` run's
engine (no LoRA layers), full weights from a checkpoint directory (``load_weights(v, "full", dir)``, the fs
and zmq transports) and full weights as tensors copied in place (``load_tensors``, the nccl transport: no
file written). Each version's greedy tokens must equal those of a fresh vLLM engine started
on the same weights. Then the behavior logprobs vLLM returns for sampled completions (temperature 1) are
compared with the learner's teacher-forced logprobs (transformers, bf16 weights, fp32 log-softmax): the
two must agree at the bf16 level (mean |difference| < 0.05 nats per token).

    DISTRL_GPU_MODEL=<SmolLM2 .gguf or HF dir> pytest -m gpu tests/integration/test_vllm_gpu.py

Writes its numbers to ``$DISTRL_GPU_RESULT`` (JSON) when set (bench/gpu_vllm.py reads them).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "Question: what is 17 + 25? Answer:", "The three laws of motion are", "import numpy as np\n",
           "My favourite colour is", "In 1969, the first person to walk on the moon"]
NEW_TOKENS = 32


def _model_dir() -> str:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    model = os.environ.get("DISTRL_GPU_MODEL")
    if not model:
        pytest.skip("set DISTRL_GPU_MODEL to SmolLM2-135M-Instruct (.gguf or HF directory)")
    from distrl.core.gguf import resolve_model

    return resolve_model(model)


def _greedy(engine) -> list[list[int]]:
    results = engine.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, seed=0)
    return [r.completions[0].token_ids for r in results]


def _free(engine) -> None:
    """Drop an in-process vLLM engine and its GPU memory, so that the next one starts clean."""
    import torch
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    del engine.llm
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    torch.cuda.empty_cache()


def _perturbed(model_dir: str, scale: float, seed: int) -> dict:
    """The model's weights plus seeded noise of `scale` x each tensor's std (bf16, on the GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        noise = torch.randn(p.shape, generator=gen).to(p.dtype) * (p.float().std() * scale).to(p.dtype)
        out[name] = (p + noise).contiguous()
    return out


def _save_full(model_dir: str, weights: dict, out: Path) -> Path:
    """A checkpoint directory for `weights` (config and tokenizer copied from `model_dir`)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".json.index")):
            shutil.copy(f, out / f.name)
    shared = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # tied head: embed_tokens holds it
    save_file({k: v.cpu() for k, v in shared.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _save_lora(model_dir: str, out: Path, seed: int) -> tuple[Path, float]:
    """A random (non-zero) rank-16 LoRA adapter on the attention and MLP projections; seconds to save it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    cfg = LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    t0 = time.perf_counter()
    peft_model.save_pretrained(str(out))
    return out, time.perf_counter() - t0


def _teacher_logprobs(weights_dir: str, results) -> list[float]:
    """|behavior - learner| per completion token: the learner's logprobs by teacher forcing (bf16, fp32 softmax)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.bfloat16).cuda().eval()
    diffs = []
    with torch.no_grad():
        for r in results:
            for c in r.completions:
                ids = torch.tensor([list(r.prompt_ids) + list(c.token_ids)], device="cuda")
                logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
                lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(r.prompt_ids):, None])[:, 0]
                diffs += (lp.cpu() - torch.tensor(c.logprobs)).abs().tolist()
    del model
    torch.cuda.empty_cache()
    return diffs


def test_vllm_serves_lora_and_full_updates_like_a_fresh_engine(tmp_path):
    model_dir = _model_dir()
    from distrl.rollout.engines.vllm import VLLMEngine

    lora1, _ = _save_lora(model_dir, tmp_path / "lora1", seed=1)
    lora2, lora_save_s = _save_lora(model_dir, tmp_path / "lora2", seed=2)
    full3 = _save_full(model_dir, _perturbed(model_dir, 0.05, seed=3), tmp_path / "full3")
    tensors4 = _perturbed(model_dir, 0.05, seed=4)
    full4 = _save_full(model_dir, tensors4, tmp_path / "full4")
    numbers: dict = {}
    latency = {}

    def serve(engine, version, fmt, source):
        t0 = time.perf_counter()
        if fmt == "tensors":
            engine.load_tensors(version, [(k, v.cuda()) for k, v in source.items()])
        else:
            engine.load_weights(version, fmt, source)
        engine.generate(PROMPTS[:1], n=1, temperature=0.0, max_new_tokens=1)  # serving: the first token
        latency[version] = time.perf_counter() - t0
        return _greedy(engine)

    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.15, lora=True)  # a --finetune lora run's actor
    assert engine._in_process, "the GPU engine must run in this process (in-place loads, no temporary files)"
    served = {0: _greedy(engine)}
    served[1] = serve(engine, 1, "lora", lora1)
    served[2] = serve(engine, 2, "lora", lora2)
    _free(engine)
    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.15, lora=False)  # a --finetune full run's actor
    numbers["base_greedy_equal_with_and_without_lora_layers"] = _greedy(engine) == served[0]
    served[3] = serve(engine, 3, "full", full3)
    served[4] = serve(engine, 4, "tensors", tensors4)
    sampled = engine.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=NEW_TOKENS, seed=7)
    _free(engine)

    assert served[1] != served[0] and served[2] != served[1] and served[3] != served[0] and served[4] != served[3]
    fresh = VLLMEngine(model_dir, gpu_memory_utilization=0.15, lora=True)
    fresh.load_weights(2, "lora", lora2)
    numbers["greedy_equal_lora"] = _greedy(fresh) == served[2]
    _free(fresh)
    fresh = VLLMEngine(str(full3), gpu_memory_utilization=0.15, lora=False)
    numbers["greedy_equal_full"] = _greedy(fresh) == served[3]
    _free(fresh)
    fresh = VLLMEngine(str(full4), gpu_memory_utilization=0.15, lora=False)
    numbers["greedy_equal_full_tensors"] = _greedy(fresh) == served[4]
    _free(fresh)

    diffs = _teacher_logprobs(str(full4), sampled)
    numbers.update(logprob_abs_diff_mean=statistics.fmean(diffs), logprob_abs_diff_max=max(diffs),
                   logprob_tokens=len(diffs),
                   logprob_abs_diff_p99=sorted(diffs)[int(0.99 * (len(diffs) - 1))],
                   weight_latency_lora_s=lora_save_s + latency[2], lora_load_and_first_token_s=latency[2],
                   lora_save_s=lora_save_s, weight_latency_full_path_s=latency[3],
                   weight_latency_full_tensors_s=latency[4])
    print(json.dumps(numbers), flush=True)
    if os.environ.get("DISTRL_GPU_RESULT"):
        Path(os.environ["DISTRL_GPU_RESULT"]).write_text(json.dumps(numbers, indent=1))
    assert numbers["greedy_equal_lora"] and numbers["greedy_equal_full"] and numbers["greedy_equal_full_tensors"]
    assert numbers["logprob_abs_diff_mean"] < 0.05, numbers
