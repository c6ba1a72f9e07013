"""Bad inputs of issue 16 item 3 through the real `distrl` command, for every launcher: exit 2, at most two
lines on stderr naming the flag, no run directory, no Ray session (RAY_TMPDIR stays empty)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.cmd.config import TrainConfig

DISTRL = str(Path(sys.executable).with_name("distrl"))


def _rows(tmp: Path) -> str:
    """A jsonl whose rows have only prompt/gold (no task reads those columns)."""
    (tmp / "rows.jsonl").write_text(json.dumps({"prompt": "1+1=", "gold": "2"}) + "\n")
    return str(tmp / "rows.jsonl")


def _run_dir(tmp: Path) -> str:
    """A finished-looking run directory (config.json, segments/) whose config used the defaults."""
    run = tmp / "old"
    (run / "segments").mkdir(parents=True)
    (run / "config.json").write_text(TrainConfig(run_name="old", log_dir=str(tmp)).to_json())
    return str(run)


CASES = [  # (command and flags, with {rows} / {run} / {empty} filled in; the flag the message names)
    ("train --model /nonexistent", "--model"),
    ("train --dataset /nonexistent.jsonl", "--dataset"),
    ("train --dataset {rows}", "--dataset"),
    ("train --dataset {rows} --task math500", "--dataset"),
    ("train --temperature 0.005", "--temperature"),
    ("train --resume {run} --learning_rate 0.5 --batch_size 8 --max_steps 3", "--learning_rate"),
    ("learn --model /nonexistent", "--model"),
    ("learn --model {empty}", "--model"),
    ("rollout --model /nonexistent", "--model"),
    ("rollout --dataset /nonexistent.jsonl", "--dataset"),
    ("rollout --dataset {rows} --task gsm8k", "--dataset"),
    ("eval --model /nonexistent", "--model"),
    ("eval --model tiny --dataset /nonexistent.jsonl", "--dataset"),
    ("eval --model tiny --dataset {rows}", "--dataset"),
    ("buffer --resume {empty}", "--resume"),
    ("replay {empty}", "SOURCE"),
]


@pytest.mark.parametrize("command,flag", CASES, ids=[c for c, _ in CASES])
def test_bad_input_exits_2_in_two_lines_before_anything_starts(tmp_path, command, flag):
    (tmp_path / "empty").mkdir()
    ray_tmp, log_dir = tmp_path / "ray", tmp_path / "logs"
    ray_tmp.mkdir()
    args = command.format(rows=_rows(tmp_path), run=_run_dir(tmp_path), empty=tmp_path / "empty").split()
    if args[0] in ("train", "learn", "rollout", "replay"):
        args += ["--log_dir", str(log_dir), "--run_name", "new"]
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TMPDIR": str(tmp_path / "empty")}
    done = subprocess.run([DISTRL, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) <= 2 and lines[0].startswith(f"distrl {args[0]}: error: ") and flag in done.stderr, done.stderr
    assert not log_dir.exists() and not (tmp_path / "runs").exists()  # no run directory
    assert not list(ray_tmp.iterdir()) and not list((tmp_path / "empty").iterdir())  # no Ray session, no temp files
    assert not (Path(tmp_path / "old") / "summary.json").exists()
