"""distrl.learn.checkpoint round trip on the tiny model: weights, optimizer, LR schedule, RNG, version, config,
baseline; the restored learner continues exactly like the one that never stopped."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pytest
import torch

from distrl.cmd.assemble import learner_sections
from distrl.cmd.config import TrainConfig
from distrl.learn.checkpoint import checkpoint_dir, latest_checkpoint
from distrl.learn.learner import Learner
from tests.helpers import make_group

ADDRESS = "tcp://127.0.0.1:9"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0))


def batch(seed: int) -> pa.Table:
    g = torch.Generator().manual_seed(seed)
    return pa.concat_tables([make_group(f"g{seed}-{i}", rewards=torch.rand(4, generator=g).tolist())
                             for i in range(2)])


def draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_round_trip_continues_identically(tiny, tmp_path, finetune):
    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", learner="pg", pg_baseline="running_mean",
                      finetune=finetune, learning_rate=1e-2, lr_warmup_steps=3, lr_schedule="cosine", max_steps=6,
                      seed=3)
    a = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)
    for v in range(2):
        a.train_step(batch(v))
        a.version += 1
    path = a.save_checkpoint(checkpoint_dir(tmp_path, a.version))
    assert latest_checkpoint(tmp_path) == path and path.name == "v000002"
    expected_draws = draws()
    a.train_step(batch(2))  # the uninterrupted learner goes on

    b = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)  # a fresh learner (same seed: version-0 weights)
    state = b.load_checkpoint(path)
    assert draws() == expected_draws  # RNG restored (torch, python, numpy)
    assert b.version == 2 and state["finetune"] == finetune
    restored = TrainConfig.from_json(state["config_json"])  # the learner's sections (no run name: a fresh default)
    assert (restored.learn, restored.shared, restored.staleness) == (cfg.learn, cfg.shared, cfg.staleness)
    assert b.baseline.value == state["extra"]["baseline"]["value"] is not None
    assert b.scheduler.last_epoch == 2 and b.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    b.train_step(batch(2))
    for pa_, pb in zip(a.params, b.params):
        assert torch.equal(pa_, pb)  # same weights, same AdamW moments -> the same step, bit for bit
    assert json.loads((path / "state.json").read_text())["version"] == 2


def test_errors(tiny, tmp_path):
    lora = Learner(*learner_sections(TrainConfig(model=tiny, backend="hf")), 0, 1, ADDRESS, tiny)
    path = lora.save_checkpoint(tmp_path / "v000000")
    with pytest.raises(FileExistsError):
        lora.save_checkpoint(path)
    full = Learner(*learner_sections(TrainConfig(model=tiny, backend="hf", finetune="full")), 0, 1, ADDRESS, tiny)
    with pytest.raises(ValueError, match="holds lora weights"):
        full.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        lora.load_checkpoint(tmp_path / "v000009")
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_a_moving_staleness_bound_is_restored(tiny, tmp_path):
    """`--max_staleness auto`: the bound in force and the controller's patience count come back on resume."""
    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", max_staleness="auto:3", max_steps=4)
    a = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)
    assert a.max_staleness == 0 and a.controller.ceiling == 3
    a.controller.bound, a.controller.calm = 2, 1
    a.max_staleness, a.version = 2, 1
    path = a.save_checkpoint(checkpoint_dir(tmp_path, a.version))
    b = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)
    state = b.load_checkpoint(path)
    assert state["extra"]["staleness"] == {"bound": 2, "calm": 1}
    assert (b.max_staleness, b.controller.bound, b.controller.calm) == (2, 2, 1)
    assert TrainConfig.from_json(state["config_json"]).max_staleness == "auto:3"
