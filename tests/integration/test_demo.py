"""The demo that learns: supervised warm start, async GRPO on the real stack, the end-of-run report.

`test_report_path` (CI, a 3-version run): `distrl train --warm_start_steps` writes `warm_start/`, actor 0
evaluates, and the run ends with curve.png, the rich table and one JSON line as the last stdout line; `distrl
replay` of that run starts from its warm start.
`test_make_demo` (slow): `make demo` itself must raise held-out accuracy by at least 20 points.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_replay import replay
from tests.integration.test_train import ENV, ROOT, distrl, run, scalars

REPORT_KEYS = {"accuracy_before", "accuracy_after", "wall_s", "versions", "curve_png", "tensorboard_dir", "run_dir"}


@pytest.fixture(scope="module")
def warm_started_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 3-version `distrl train` warm-started for 5 supervised steps at lr 1e-2 (tiny model, one-digit sums, full
    fine-tuning on the HF backend, HF engine, held-out evaluation every 2 versions, weights through files: actor 0
    then evaluates version 2 even when it never served it, which `shm`'s two slots do not allow): (its run
    directory, the finished process). One-digit sums: some completions are right, so groups whose rewards vary give
    the learner's versions a behaviour-vs-learner logprob gap to measure (the replay test reads its replays').
    test_report_path checks the run's report, the replay test replays it into other run names; no test writes
    into it."""
    log_dir = tmp_path_factory.mktemp("warm_started")
    proc = run(distrl("--model", "tiny", "--task", "arith", "--arith_ops", "+", "--arith_max_operand", "9",
                      "--warm_start_steps", "5", "--warm_start_lr", "1e-2", "--warm_start_batch_size", "16",
                      "--finetune", "full", "--backend", "hf", "--engine", "hf", "--torch_threads", "1",
                      "--max_steps", "3", "--batch_size", "4", "--group_size", "4", "--learning_rate", "2e-4",
                      "--max_new_tokens", "5", "--eval_every", "2", "--eval_size", "16", "--run_name", "report",
                      "--weights_transport", "fs"),
                log_dir)
    return log_dir / "report", proc


def last_json_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def check_report(report: dict, run_dir: Path, versions: int) -> None:
    assert REPORT_KEYS <= set(report)
    assert report["run_dir"] == str(run_dir) and report["versions"] == versions
    assert 0.0 <= report["accuracy_before"] <= 1.0 and 0.0 <= report["accuracy_after"] <= 1.0
    assert Path(report["curve_png"]).read_bytes()[:4] == b"\x89PNG"
    tb = Path(report["tensorboard_dir"])
    assert list((tb / "learner0").glob("events.out.tfevents.*")) and list((tb / "actor0").glob("events.out.tfevents.*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy_after"] == report["accuracy_after"] and summary["versions"] == versions
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert report["accuracy_before"] == min(evals, key=lambda e: e["version"])["accuracy"]
    assert report["accuracy_after"] == max(evals, key=lambda e: e["version"])["accuracy"]


def test_report_path(warm_started_run):
    run_dir, proc = warm_started_run  # the run's flags: warm_started_run above
    report = last_json_line(proc.stdout)
    check_report(report, run_dir, versions=3)
    assert report["eval_versions"] == [0, 2, 3]
    assert "distrl run report" in proc.stdout and "held-out accuracy" in proc.stdout
    # the warm-started model is every role's base model
    assert (run_dir / "warm_start" / "config.json").is_file() and (run_dir / "warm_start" / "tokenizer.json").is_file()
    assert "warm start: 5 steps" in (run_dir / "logs" / "driver.log").read_text()
    assert sorted(scalars(run_dir, "actor0", "eval/accuracy")) == [0, 2, 3]
    assert json.loads((run_dir / "config.json").read_text())["arith_ops"] == "+"


@pytest.mark.slow
def test_make_demo(tmp_path):
    """The acceptance run: `make demo` raises held-out greedy accuracy by >= 20 points (2-core CPU, no GPU)."""
    proc = subprocess.run(["make", "demo", f"DEMO_LOG_DIR={tmp_path}"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = last_json_line(proc.stdout)
    run_dir = Path(report["run_dir"])
    assert run_dir.parent == tmp_path
    check_report(report, run_dir, versions=300)
    assert report["accuracy_after"] - report["accuracy_before"] >= 0.20, report


def test_replay_of_a_warm_started_run_starts_from_its_warm_start(warm_started_run):
    """A run warm-started for a few steps (this file's warm_started_run): the replay
    starts from `<run>/warm_start` (and says so), so the first version's behavior-vs-learner logprob gap is at the
    float32 level; told to start from the pre-warm-start model instead, it warns that the gap is far above the
    bf16 level."""
    source = warm_started_run[0]
    flags = ("--replay_ratio", "2", "--staleness_model", "restamp", "--max_steps", "3")
    out = replay(source, "right", *flags)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == str(source / "warm_start")
    assert "replay starts from " + str(source / "warm_start") in (out / "logs" / "replay.log").read_text()
    assert summary["first_logprob_gap"] < 1e-3, summary  # float32 on CPU: ~1e-7
    assert "logprob gap" not in (out / "logs" / "replay.log").read_text()
    wrong = replay(source, "wrong", *flags, "--model", str(source / "model"))
    assert json.loads((wrong / "summary.json").read_text())["first_logprob_gap"] > 0.1
    assert "the model replayed from is not the one that generated the log" in (
        wrong / "logs" / "replay.log").read_text()
