"""Environments for the --env tests (tests/unit/test_envs.py), loaded as `path/to/env_scripts.py:Class` in the
actor's environment processes. The ones that misbehave do so in one episode only: the first episodes to claim a
numbered file in $DISTRL_TEST_ENV_DIR (O_EXCL, across processes)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def claim(name: str) -> bool:
    """True in the one process that creates $DISTRL_TEST_ENV_DIR/name first."""
    try:
        os.close(os.open(Path(os.environ["DISTRL_TEST_ENV_DIR"]) / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class Scripted:
    """Three model turns: `obs1`, `obs2`, then done with reward 1 (and the turn count in info)."""

    def reset(self, problem):
        self.turn = 0
        return None

    def step(self, model_text):
        self.turn += 1
        if self.turn < 3:
            return f"obs{self.turn}", 0.0, False, {}
        return None, 1.0, True, {"seen": 3.0}


class BlockOne:
    """One episode's step waits for $DISTRL_TEST_ENV_DIR/release (up to 60 s); every episode ends after one turn."""

    def reset(self, problem):  # the actor's start-up check plays a reset only: claims are made in step
        return None

    def step(self, model_text):
        self.blocks = claim("blocker")
        release = Path(os.environ["DISTRL_TEST_ENV_DIR"]) / "release"
        deadline = time.monotonic() + 60
        while self.blocks and not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return None, 1.0, True, {"blocked": float(self.blocks)}


class Faulty:
    """The first episode's step exits its process, the second's hangs, the third's raises; the others end well."""

    def reset(self, problem):
        return None

    def step(self, model_text):
        self.fault = next((f for f in ("crash", "hang", "raise") if claim(f)), None)
        if self.fault == "crash":
            os._exit(3)
        if self.fault == "hang":
            time.sleep(1000)
        if self.fault == "raise":
            raise RuntimeError("a bug in the environment")
        return None, 1.0, True, {}
