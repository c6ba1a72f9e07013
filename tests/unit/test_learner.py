"""distrl.learn.learner on the tiny model (transformers + peft backend, CPU): micro-batching equals the full
batch for every aggregation mode, zero-signal versions skip the step, full fine-tuning, the KL
reference, the running-mean baseline, the LR schedule and the torchrun environment."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pytest
import torch

from distrl.cmd.assemble import learner_sections
from distrl.cmd.config import TrainConfig, loss_aggregation
from distrl.learn.distributed import init_distributed_from_env
from distrl.learn.learner import Learner, loss_config
from distrl.learn.optim import lr_factor
from distrl.weights import DirectoryPublisher, WeightSubscriber
from tests.helpers import make_group

ADDRESS = "tcp://127.0.0.1:9"  # never contacted: these tests call train_step / accumulate directly


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("learner") / "tiny", seed=0))


def learner(tiny, **kw) -> Learner:
    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", learning_rate=1e-2, max_new_tokens=8, **kw)
    return Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)


def batch(seed=0) -> pa.Table:
    """3 groups of 4 completions (lengths 3..6), behavior logprobs -0.5, rewards with spread."""
    g = torch.Generator().manual_seed(seed)
    return pa.concat_tables([make_group(f"g{i}", rewards=torch.rand(4, generator=g).tolist(), completion_len=3)
                             for i in range(3)])


def grads(lrn: Learner, table: pa.Table) -> list[torch.Tensor]:
    norm, adv, _ = lrn.prepare(table)
    lrn.accumulate(table, adv, norm)
    out = [p.grad.clone() for p in lrn.params]
    lrn.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"])
def test_micro_batches_equal_full_batch_on_the_model(tiny, aggregation):
    # A first step makes the LoRA B matrices non-zero, so the adapter, the ratio and the KL term all matter.
    lrn = learner(tiny, learner="grpo", loss_aggregation=aggregation, kl_coef=0.1, off_policy="decoupled",
                  learner_chunk_size=12)
    table = batch()
    lrn.train_step(batch(seed=1))
    lrn.learn.learner_chunk_size = 12
    full = grads(lrn, table)
    for chunk in (1, 5):
        lrn.learn.learner_chunk_size = chunk
        for f, m in zip(full, grads(lrn, table)):
            torch.testing.assert_close(m, f, atol=1e-6, rtol=1e-4)
    lrn.learn.learner_chunk_size = None  # by token budget: rows taken widest first (batch.widest_first)
    for budget in (9, 30):
        lrn.learn.learner_chunk_tokens = budget
        for f, m in zip(full, grads(lrn, table)):
            torch.testing.assert_close(m, f, atol=1e-6, rtol=1e-4)
    assert sum(float(f.abs().sum()) for f in full) > 0


def test_zero_advantage_batch_skips_the_step(tiny):
    lrn = learner(tiny, learner="grpo")
    lrn.train_step(batch())  # AdamW now has momentum: a zero-gradient step would still move weights
    before = [p.detach().clone() for p in lrn.params]
    flat = pa.concat_tables([make_group(f"z{i}", rewards=[1.0] * 4, advantages=[0.0] * 4) for i in range(2)])
    stats = lrn.train_step(flat)
    assert stats["learner/skipped_step"] == 1.0 and stats["learner/loss"] == 0.0
    assert all(torch.equal(b, p) for b, p in zip(before, lrn.params))
    assert lrn.scheduler.last_epoch == 2  # the LR schedule still follows the version
    assert all(v == v for v in stats.values() if isinstance(v, float))  # no NaN


def test_skipped_first_version_changes_nothing_and_warns_nothing(tiny):
    """A run whose first version has no signal: no torch "lr_scheduler.step() before optimizer.step()"
    warning, no optimizer state, unchanged weights; the schedule still follows the version."""
    import warnings

    lrn = learner(tiny, learner="grpo", lr_warmup_steps=2)
    before = [p.detach().clone() for p in lrn.params]
    flat = pa.concat_tables([make_group(f"z{i}", rewards=[1.0] * 4, advantages=[0.0] * 4) for i in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lrn.train_step(flat)["learner/skipped_step"] == 1.0
    assert all(torch.equal(b, p) for b, p in zip(before, lrn.params)) and not lrn.optimizer.state
    assert lrn.scheduler.last_epoch == 1 and lrn.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_zero_advantage_batch_with_kl_still_steps(tiny):
    lrn = learner(tiny, learner="grpo", kl_coef=0.5)
    lrn.train_step(batch())
    flat = pa.concat_tables([make_group(f"z{i}", rewards=[1.0] * 4, advantages=[0.0] * 4) for i in range(2)])
    stats = lrn.train_step(flat)
    assert stats["learner/skipped_step"] == 0.0 and stats["learner/kl_ref"] > 0


def test_lora_reference_is_the_base_model(tiny):
    lrn = learner(tiny, learner="grpo", kl_coef=0.1)
    stats = lrn.train_step(batch())
    assert stats["learner/kl_ref"] == 0.0  # version 0: adapter B = 0, policy == reference
    stats = lrn.train_step(batch(seed=2))
    assert stats["learner/kl_ref"] > 0  # the adapter moved away from the base model


def test_full_finetuning_trains_every_weight_and_publishes_full(tiny, tmp_path):
    lrn = learner(tiny, learner="pg", finetune="full", kl_coef=0.1, max_grad_norm=0.5)
    n_params = sum(1 for _ in lrn.model.parameters())
    assert len(lrn.params) == n_params and lrn.reference is not None
    before = [p.detach().clone() for p in lrn.params]
    stats = lrn.train_step(batch())
    assert stats["learner/kl_ref"] == 0.0 and stats["learner/grad_norm"] > 0
    assert all(not torch.equal(b, p) for b, p in zip(before, lrn.params))

    lrn.publisher = DirectoryPublisher(tmp_path / "weights")  # the fs/zmq transports' publisher
    lrn.version = 1  # as run() does after the step
    try:
        lrn._publish()
        assert lrn.publisher.addresses and lrn.publisher.flush(timeout_s=0)
        payload = tmp_path / "weights" / "v000001"
        assert json.loads((payload / "config.json").read_text())["model_type"] == "qwen2"
        assert list(payload.glob("*.safetensors"))  # a full model directory: format full
        subscriber = WeightSubscriber(*lrn.publisher.addresses)
        ann = subscriber.request_latest()
        subscriber.close()
        assert (ann.version, ann.format, ann.location) == (1, "full", str(payload))
    finally:
        lrn.publisher.close()


def test_running_mean_baseline(tiny):
    lrn = learner(tiny, learner="pg", pg_baseline="running_mean", baseline_decay=0.5)
    rows = batch().to_pylist()
    mean = sum(r["reward"] for r in rows) / len(rows)
    _, adv, _ = lrn.prepare(batch())
    assert adv.tolist() == pytest.approx([r["reward"] - mean for r in rows])  # version 0: the batch's own mean
    stats = lrn.train_step(batch())
    assert stats["learner/baseline"] == pytest.approx(mean)
    rows2 = batch(seed=5).to_pylist()
    _, adv2, _ = lrn.prepare(batch(seed=5))
    assert adv2.tolist() == pytest.approx([r["reward"] - mean for r in rows2])  # the running value, not the new mean


def test_load_in_4bit_refused_on_cpu(tiny):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError, match="--load_in_4bit needs an NVIDIA GPU"):
        Learner(*learner_sections(TrainConfig(model=tiny, load_in_4bit=True)), 0, 1, ADDRESS, tiny)


def test_loss_config_from_flags():
    cfg = TrainConfig(learner="dr_grpo", clip_eps_high=0.28, off_policy="tis", is_level="sequence", is_cap=3.0)
    lc = loss_config(cfg.learn, cfg.shared)
    assert lc.kind == "grpo" and (lc.clip_eps_low, lc.clip_eps_high) == (0.2, 0.28)
    assert (lc.off_policy.method, lc.off_policy.level, lc.off_policy.cap) == ("tis", "sequence", 3.0)
    assert loss_aggregation(cfg.learn, cfg.shared) == "sequence-mean-token-sum-norm"
    assert cfg.shared.advantage_estimator == "dr_grpo"
    assert loss_aggregation(TrainConfig().learn, TrainConfig().shared) == "token-mean"


def test_lr_schedule_by_hand():
    # warm-up 2 of 10 versions: 1/2, 1; then p = (s - 2) / 8
    assert [lr_factor(s, 2, 10, "constant") for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 2, 10, "linear") for s in (2, 6, 9)] == pytest.approx([1.0, 0.5, 0.125])
    assert [lr_factor(s, 2, 10, "cosine") for s in (2, 6)] == pytest.approx([1.0, 0.5])
    assert lr_factor(0, 0, 10, "cosine") == 1.0


def test_learner_lr_follows_schedule(tiny):
    lrn = learner(tiny, lr_warmup_steps=2, lr_schedule="linear", max_steps=4)
    lrs = [lrn.train_step(batch(seed=s))["learner/lr"] for s in range(4)]
    # factors: 1/2, 1, then p = 0, 1/2 -> 1, 1/2
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3])


def test_init_distributed_from_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert init_distributed_from_env() == (0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set"):
        init_distributed_from_env()


@pytest.mark.parametrize("flags,message", [
    ({"clip_eps_low": 1.0}, "--clip_eps_low must be in (0, 1)"),
    ({"clip_eps_high": 0.0}, "--clip_eps_high must be > 0"),
    ({"loss_norm_tokens": 0}, "--loss_norm_tokens must be >= 1"),
    ({"pg_baseline": "running_mean"}, "--pg_baseline running_mean needs --learner pg"),
    ({"baseline_decay": 1.0}, "--baseline_decay must be in [0, 1)"),
    ({"kl_coef": -0.1}, "--kl_coef must be >= 0"),
    ({"is_cap": 0.5}, "--is_cap must be >= 1"),
    ({"is_level": "sequence", "off_policy": "decoupled"}, "--is_level sequence needs --off_policy tis"),
    ({"is_mask_low": 2.0, "is_mask_high": 1.0}, "--is_mask_high must be > --is_mask_low"),
    ({"max_grad_norm": -1.0}, "--max_grad_norm must be >= 0"),
    ({"lr_warmup_steps": -1}, "--lr_warmup_steps must be >= 0"),
    ({"lora_target_modules": ()}, "--lora_target_modules must name at least one module"),
    ({"load_in_4bit": True, "finetune": "full"}, "--load_in_4bit is QLoRA through Unsloth"),
])
def test_learner_flags_are_validated(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**flags)
