"""Issue 16, item 6: what an actor or a learner keeps per policy version stays bounded.

An actor loads every version's weights from safetensors files. `safe_open(framework="pt")` (safetensors
0.8.0) left two Python objects behind per tensor read, ~1.4 KB per version of the tiny model, so the
actor's RSS grew ~2 MB per 1,000 versions; distrl.rollout.engines.merge.read_safetensors reads the files itself.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from distrl.core.tiny import build_tiny_model
from distrl.rollout.engines.hf import HFEngine
from distrl.rollout.engines.merge import read_safetensors


def test_read_safetensors_equals_safetensors(tmp_path):
    tensors = {"w": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "half": torch.randn(2, 2).half(),
               "scalar": torch.tensor(3), "empty": torch.empty(0, 4), "ids": torch.arange(10), "flags":
               torch.tensor([True, False])}
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    expected, got = load_file(str(tmp_path / "m.safetensors")), dict(read_safetensors(tmp_path / "m.safetensors"))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_read_safetensors_refuses_a_truncated_file(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        list(read_safetensors(tmp_path / "m.safetensors"))


def _traced_growth(step, warmup: int, n: int) -> int:
    """Bytes of Python allocations still alive after `n` calls of `step(i)` (after `warmup` calls)."""
    for i in range(warmup):
        step(i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(warmup, warmup + n):
            step(i)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


def test_loading_a_version_keeps_nothing_per_version(tmp_path):
    """200 full-weight versions loaded into the HF engine leave under 20 KB of Python objects (before the
    fix: ~1.4 KB per version, 280 KB)."""
    model = build_tiny_model(tmp_path / "model")
    engine = HFEngine(str(model), dtype="float32", device="cpu")

    def load(i: int) -> None:
        engine.load_weights(i + 1, "full", model)

    growth = _traced_growth(load, warmup=20, n=200)
    assert growth < 20_000, f"{growth} bytes kept after 200 versions"


def test_learner_history_is_compact():
    """The learner's returned history holds 40 bytes a version, not each version's stats dict."""
    from distrl.learn.step_stats import History

    history = History()
    for v in range(10_000):
        stats = {f"learner/metric_{i}": float(i) for i in range(30)}  # what a version logs, and more
        stats.update({"learner/loss": v / 2, "learner/reward_mean": 0.5, "learner/grad_norm": 1.0,
                      "learner/staleness_mean": 0.5, "learner/staleness_max": v % 2})
        history.append(stats)
    assert history.nbytes == 40 * 10_000
    rows = history.rows()
    assert len(rows) == 10_000 and rows[-1] == {"learner/loss": 4999.5, "learner/reward_mean": 0.5,
                                                 "learner/grad_norm": 1.0, "learner/staleness_mean": 0.5,
                                                 "learner/staleness_max": 1}
