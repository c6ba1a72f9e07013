"""distrl installs one top-level package, ``distrl``: the roles are ``distrl.rollout``, ``distrl.learn`` and
``distrl.buffer``, so a user's module of the same short name in the working directory shadows nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_only_the_distrl_package():
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(ROOT), include=include)
    assert {p.split(".")[0] for p in packages} == {"distrl"}
    assert {"distrl.rollout", "distrl.learn", "distrl.buffer", "distrl.core", "distrl.cmd"} <= set(packages)


def test_commands_start_beside_a_users_rollout_learn_and_buffer_modules(tmp_path):
    for name in ("rollout", "learn", "buffer"):  # importing any of them is an error
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"}
    for command in ("learn", "rollout", "buffer"):
        # python -m puts the working directory first on sys.path, before site-packages
        proc = subprocess.run([sys.executable, "-m", "distrl", command, "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "--batch_size" in proc.stdout
