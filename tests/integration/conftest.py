"""Fixtures shared by integration test files: runs several files read (each run takes half a minute or more)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def warm_started_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 3-version `distrl train` warm-started for 5 supervised steps at lr 1e-2 (tiny model, one-digit sums, full
    fine-tuning on the HF backend, HF engine, held-out evaluation every 2 versions, weights through files: actor 0
    then evaluates version 2 even when it never served it, which `shm`'s two slots do not allow): (its run
    directory, the finished process). One-digit sums: some completions are right, so groups whose rewards vary give
    the learner's versions a behaviour-vs-learner logprob gap to measure (test_replay.py reads its replays').
    test_demo.py checks the run's report, test_replay.py replays it into other run names; no test writes into it."""
    from tests.integration.test_train import distrl, run

    log_dir = tmp_path_factory.mktemp("warm_started")
    proc = run(distrl("--model", "tiny", "--task", "arith", "--arith_ops", "+", "--arith_max_operand", "9",
                      "--warm_start_steps", "5", "--warm_start_lr", "1e-2", "--warm_start_batch_size", "16",
                      "--finetune", "full", "--backend", "hf", "--engine", "hf", "--torch_threads", "1",
                      "--max_steps", "3", "--batch_size", "4", "--group_size", "4", "--learning_rate", "2e-4",
                      "--max_new_tokens", "5", "--eval_every", "2", "--eval_size", "16", "--run_name", "report",
                      "--weights_transport", "fs"),
                log_dir)
    return log_dir / "report", proc
