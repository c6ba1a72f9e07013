"""Acceptance 5 of issue 4: a 200-version CPU run stays stable (bench/long_run.py has the setup).

Slow (about 3 minutes per run on 2 cores). With DISTRL_BENCH_OUT=<dir> the run's report is also
written there (`DISTRL_BENCH_OUT=docs` regenerates docs/long_run_<finetune>.md from this very run).
The full fine-tuning run needs actors that reload full weights (distrl/rollout/engines, format `full`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import long_run


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_long_run_is_stable(finetune, tmp_path):
    result = long_run.run(200, tmp_path, finetune)
    checks = long_run.checks(result)
    print("\n" + long_run.report(result))
    long_run.write(result, Path(os.environ.get("DISTRL_BENCH_OUT", tmp_path)))
    assert checks["versions"] == 200 and len(result["curves"]["loss"]) == 200
    assert checks["nan_or_inf"] == 0
    assert checks["entropy_min"] > long_run.ENTROPY_FLOOR
    assert checks["k3_max"] < long_run.K3_BOUND
    assert checks["mismatch_mean_abs_max"] < long_run.MISMATCH_BOUND
    assert checks["reward_last10"] > checks["reward_first10"] + 0.1
