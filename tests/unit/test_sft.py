"""The supervised warm start (distrl/learn/sft.py) on the embedded tiny model: masks, and the loss drops."""

from __future__ import annotations

import pytest
import torch

from distrl.core.tiny import build_tiny_model, build_tokenizer
from distrl.learn.sft import sft_batch, warm_start
from distrl.rollout.tasks import ArithTask


def test_sft_batch_masks_prompt_and_padding():
    tok = build_tokenizer()
    ids, mask, labels = sft_batch(tok, ["3+4=", "12+30="], ["7", "42"])
    eos = tok.eos_token_id
    # "3+4=" is 4 tokens, then "7" and EOS; the second row is 6 + 2 + 1 = 9 tokens, the widest.
    assert ids.shape == mask.shape == labels.shape == (2, 9)
    assert labels[0].tolist() == [-100] * 4 + [tok.convert_tokens_to_ids("7"), eos] + [-100] * 3
    assert labels[1, 6:].tolist() == [tok.convert_tokens_to_ids("4"), tok.convert_tokens_to_ids("2"), eos]
    assert mask[0].tolist() == [1] * 6 + [0] * 3 and mask[1].sum() == 9
    assert ids[0, :6].tolist() == tok("3+4=7")["input_ids"] + [eos]


def test_sft_batch_needs_eos():
    tok = build_tokenizer()
    tok.eos_token = None
    with pytest.raises(ValueError, match="EOS"):
        sft_batch(tok, ["1+1="], ["2"])


def test_warm_start_loss_drops_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path / "tiny", seed=0)
    task = ArithTask(0, 99, ("+",))
    result = warm_start(base, tmp_path / "ws", task, steps=40, learning_rate=3e-3, batch_size=32)
    # Random init: ~ln(52) = 3.9 nats per answer token; 40 steps learn at least the digit/EOS format.
    assert result.first_loss > 3.0
    assert result.last_loss < 0.6 * result.first_loss
    saved = AutoModelForCausalLM.from_pretrained(str(result.model_dir))
    original = AutoModelForCausalLM.from_pretrained(str(base))
    assert (result.model_dir / "tokenizer.json").is_file()
    assert not torch.equal(saved.lm_head.weight, original.lm_head.weight)


def test_warm_start_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        warm_start(tmp_path, tmp_path / "ws", ArithTask(), steps=0, learning_rate=1e-3, batch_size=4)


def test_exact_match_is_greedy_correctness():
    from distrl.learn.sft import exact_match

    # 2 rows, 4 positions, vocabulary 3; labels are -100 on the prompt (position 0-1) and padding.
    labels = torch.tensor([[-100, -100, 2, 1], [-100, -100, 2, -100]])
    logits = torch.zeros(2, 4, 3)
    logits[0, 1, 2] = logits[0, 2, 1] = 1.0  # row 0: predicts 2 then 1 -> correct
    logits[1, 1, 0] = 1.0  # row 1: predicts 0 where 2 is labelled -> wrong
    assert exact_match(logits, labels) == 0.5


def test_warm_start_stops_at_target_accuracy(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", seed=0)
    task = ArithTask(0, 9, ("+",))  # one-digit sums: learnt within a few dozen steps
    result = warm_start(base, tmp_path / "ws", task, steps=400, learning_rate=3e-3, batch_size=32,
                        until_accuracy=0.5)
    assert result.steps < 400 and result.exact_match >= 0.5


@pytest.mark.parametrize("flag, value", [("arith_ops", "/"), ("arith_ops", ""), ("arith_max_operand", 0),
                                         ("warm_start_steps", -1), ("warm_start_lr", 0.0),
                                         ("warm_start_batch_size", 0), ("warm_start_until_accuracy", 1.5),
                                         ("torch_threads", 0)])
def test_bad_flags_are_named(flag, value):
    from distrl.cmd.config import TrainConfig

    with pytest.raises(ValueError, match=f"--{flag}"):
        TrainConfig(**{flag: value})


def test_arith_flags_reach_the_task():
    from distrl.rollout.tasks import load_task

    task = load_task("arith", None, seed=0, arith_ops="+", arith_max_operand=9)
    stream = task.problems(1)
    problems = [next(stream) for _ in range(200)]
    assert {p.meta["op"] for p in problems} == {"+"}
    assert max(max(p.meta["a"], p.meta["b"]) for p in problems) == 9
    assert all(int(p.gold) == p.meta["a"] + p.meta["b"] for p in problems)
