"""The demo that learns: supervised warm start, async GRPO on the real stack, the end-of-run report.

`test_report_path` (CI, a 3-version run): `distrl train --warm_start_steps` writes `warm_start/`, actor 0
evaluates, and the run ends with curve.png, the rich table and one JSON line as the last stdout line.
`test_make_demo` (slow): `make demo` itself must raise held-out accuracy by at least 20 points.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_train import ENV, ROOT, scalars

REPORT_KEYS = {"accuracy_before", "accuracy_after", "wall_s", "versions", "curve_png", "tensorboard_dir", "run_dir"}


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
    run_dir, proc = warm_started_run  # the run's flags: tests/integration/conftest.py
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
