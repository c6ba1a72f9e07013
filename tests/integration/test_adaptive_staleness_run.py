"""`--max_staleness auto:2` end to end: the learner moves the bound, announces it with each GET, the buffer
enforces it and records it in consumed.jsonl, TensorBoard has `learner/max_staleness` each version."""

from __future__ import annotations

from pathlib import Path

from distrl.buffer.segments import read_consumed
from tests.integration.test_train import distrl, run, scalars

VERSIONS = 8


def test_auto_bound_moves_and_is_never_exceeded(tmp_path: Path):
    # --learner_chunk_size 1 slows the learner so the actor can run ahead up to the bound (bench/staleness.py);
    # --staleness_patience 1 lets the bound reach its ceiling within a few versions
    run(distrl("--model", "tiny", "--task", "half_vocab", "--batch_size", "4", "--group_size", "4",
               "--max_new_tokens", "8", "--learning_rate", "1e-3", "--learner_chunk_size", "1",
               "--max_staleness", "auto:2", "--staleness_patience", "1", "--off_policy", "decoupled",
               "--torch_threads", "1", "--engine", "hf", "--max_steps", str(VERSIONS), "--run_name", "auto"), tmp_path)
    run_dir = tmp_path / "auto"
    bounds = scalars(run_dir, "learner0", "learner/max_staleness")  # step v + 1: the bound of version v's batch
    assert sorted(bounds) == list(range(1, VERSIONS + 1))
    assert bounds[1] == 0 and all(0 <= b <= 2 for b in bounds.values())
    assert max(bounds.values()) >= 1  # the tiny model's signals stay in band at this learning rate: it rose
    records = read_consumed(run_dir)
    assert sorted({r["learner_version"] for r in records}) == list(range(VERSIONS))
    for r in records:  # the bound column, the same bound the learner logged, and never exceeded
        assert r["max_staleness"] == bounds[r["learner_version"] + 1]
        assert all(0 <= r["learner_version"] - v <= r["max_staleness"] for v in r["policy_versions"])
    staleness = scalars(run_dir, "learner0", "learner/staleness_max")
    assert all(staleness[v] <= bounds[v] for v in bounds)
