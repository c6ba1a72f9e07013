"""A `distrl train` run with the slow long-answer slice (tests/data/slow_slice_reward.py) and
``--bias_correction reweight``: the buffer's monitor counts every stage consistently with its other counters, the
end-of-run report has its section and bias.md, and the learner trained every version with the weights the
buffer's histograms gave (TensorBoard ``learner/bias_weight_*``). Which groups go stale depends on the clock, so
the gaps' signs are checked on the scripted slice (test_bias_monitor.py) and measured by bench/bias_correction.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distrl.cmd.report import read_scalars
from distrl.learn.reweight import CLIP_HIGH, CLIP_LOW
from tests.integration.test_train import ENV, ROOT

STEPS, BATCH = 4, 4


@pytest.mark.slow
def test_slow_slice_run_counts_every_stage_and_reweights(tmp_path):
    reward = f"{ROOT / 'tests' / 'data' / 'slow_slice_reward.py'}:reward"
    proc = subprocess.run([sys.executable, "-m", "distrl", "train", "--model", "tiny", "--task", "arith",
                           "--arith_ops", "+*", "--arith_max_operand", "20", "--reward", reward,
                           "--reward_timeout_s", "None", "--max_steps", str(STEPS), "--batch_size", str(BATCH),
                           "--group_size", "4", "--max_new_tokens", "8", "--number_of_actors", "2",
                           "--max_staleness", "1", "--bias_correction", "reweight", "--log_dir", str(tmp_path),
                           "--run_name", "slice"],
                          cwd=ROOT, env={**ENV, "DISTRL_SLOW_SLICE_S": "0.05"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "slice"
    summary = json.loads((run / "summary.json").read_text())
    buffer, bias = summary["buffer"], summary["buffer"]["bias"]
    assert bias["generated"]["groups"] == buffer["groups_put"]
    assert bias["trained"]["groups"] == STEPS * BATCH and bias["trained_once"] == STEPS * BATCH
    assert bias["evicted"]["groups"] == buffer["evicted_stale"] + buffer["evicted_zero_variance"]
    assert bias["issued"] == buffer["credits_granted"]
    assert sum(row["trained"]["groups"] for row in bias["by_version"]) == STEPS * BATCH
    assert summary["bias_len_gap"] == bias["len_gap"] and summary["bias_untrained_share"] == bias["untrained_share"]
    assert "# Sampling bias" in (run / "bias.md").read_text()
    learner = read_scalars(run / "tb" / "learner0", ("learner/bias_weight_min", "learner/bias_weight_max"))
    assert [step for step, _ in learner["learner/bias_weight_min"]] == list(range(1, STEPS + 1))
    low, high = CLIP_LOW / CLIP_HIGH, CLIP_HIGH / CLIP_LOW  # after normalising to mean 1
    assert all(low <= w <= high for series in learner.values() for _, w in series)
