"""A test-only ``--env`` with a deliberately slow slice: the built-in calculator, whose answers to a
multiplication problem's calls (the slice: ``*``, the long answers and the hard ones with ``--arith_ops '+*'``)
come after a ``DISTRL_SLOW_TOOL_S`` sleep (default 1.0 s), so those episodes end late while the others go on
decoding, as a slow tool does under continuous batching. It demonstrates its episodes as the calculator does,
so ``--warm_start_steps`` teaches the call format.

    distrl train --task arith --arith_ops '+*' --env tests/data/slow_tool_env.py:SlowCalculator ...
"""

from __future__ import annotations

import os
import time

from distrl.rollout.envs.calculator import Calculator
from distrl.rollout.envs.demonstrations import calculator_turns

SLOW_S = float(os.environ.get("DISTRL_SLOW_TOOL_S", "1.0"))


class SlowCalculator:
    """The calculator (held, not inherited); a ``*`` problem's observations come ``SLOW_S`` late."""

    stop = Calculator.stop

    def __init__(self):
        self.calculator, self.slow = Calculator(), False

    def reset(self, problem):
        self.slow = (problem.meta or {}).get("op") == "*"
        return self.calculator.reset(problem)

    def step(self, model_text):
        observation, reward, done, info = self.calculator.step(model_text)
        if self.slow and observation is not None:
            time.sleep(SLOW_S)
        return observation, reward, done, info

    demonstrate = staticmethod(calculator_turns)
