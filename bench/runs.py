"""Helpers of the experiments: run `distrl train` as a user does, read its metrics back from TensorBoard."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
       "PYTHONUNBUFFERED": "1"}


def command(flags: list[str]) -> str:
    """The shell command a user types for these flags (recorded in docs/)."""
    return "distrl train " + " ".join(shlex.quote(f) for f in flags)


def train(flags: list[str], log_dir: Path, timeout_s: int = 7200) -> tuple[Path, float]:
    """Run `python -m distrl train FLAGS --log_dir LOG_DIR`; returns (run_dir, wall seconds).

    `flags` must contain `--run_name`. Raises RuntimeError with the run's output tail if it fails.
    """
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "distrl", "train", *flags, "--log_dir", str(log_dir)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{command(flags)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    run_name = flags[flags.index("--run_name") + 1]
    return Path(log_dir).resolve() / run_name, time.time() - start


def scalars(run_dir: Path, tag: str, role: str = "learner0") -> dict[int, float]:
    """{policy version: value} of one TensorBoard scalar of a run."""
    from distrl.cmd.report import read_scalars

    return dict(read_scalars(run_dir / "tb" / role, (tag,)).get(tag, []))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def sparkline(values: list[float], lo: float, hi: float) -> str:
    """A one-line text curve, for the terminal."""
    bars = "▁▂▃▄▅▆▇█"
    span = (hi - lo) or 1.0
    return "".join(bars[min(len(bars) - 1, max(0, int((v - lo) / span * len(bars))))] for v in values)
