"""A test-only ``--reward`` with a deliberately slow slice: arith's own reward (exact integer match), but scoring a
completion of a multiplication problem (the slice: ``*``, whose answers are the long ones, up to 3 digits
against 2 for ``+`` with ``--arith_max_operand 20``, and the hard ones) first sleeps ``SLOW_S`` seconds
(``DISTRL_SLOW_SLICE_S``, default 0.1), so its groups finish late, as long answers do.

    distrl train --task arith --arith_ops '+*' --arith_max_operand 20 --reward tests/data/slow_slice_reward.py:reward \
        --reward_timeout_s none ...
"""

from __future__ import annotations

import os
import time

from distrl.rollout.rewards import integer_match

SLOW_S = float(os.environ.get("DISTRL_SLOW_SLICE_S", "0.1"))


def reward(completion_text, problem):
    """(reward, components) of arith; a ``*`` problem's completion is scored after a ``SLOW_S`` s sleep."""
    if problem.meta.get("op") == "*":
        time.sleep(SLOW_S)
    return integer_match(completion_text, problem.gold)
