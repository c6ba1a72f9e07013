"""The built-in ``python`` environment: the model writes a fenced ```` ```python ```` block, the sandbox runs it,
its output comes back.

A turn holding a ```` ```python ... ``` ```` block (the last one, if several) is run in a fresh sandbox
(:mod:`distrl.rollout.envs.sandbox`: namespaces + Landlock + an unprivileged uid + rlimits, :class:`Limits`) and
answered with its stdout, at most ``Limits.output_bytes`` of it; a program that fails adds the last line of its
stderr (``Error: ZeroDivisionError: division by zero``), one stopped by a limit says so (``Killed: time
limit``). Nothing is kept between blocks: each runs alone, on the actor's base interpreter (its standard library;
a virtualenv's packages are not visible). A turn without a block is the answer, scored as
:mod:`.calculator` scores it: :func:`distrl.rollout.rewards.integer_match` against an integer gold (``arith``,
GSM8K), else :func:`distrl.rollout.rewards.check_answer` (math_verify) of its final answer (``\\boxed{}``, else
``answer is X``, else the last number). The turn stops at a closing fence on a line of its own (``\\n```\\n``);
the block must be tagged ``python`` (```` ```py ```` too).

The environment refuses to start (SandboxUnavailable) where the sandbox does not work: code is never run
unsandboxed. ``distrl train`` / ``distrl rollout`` check this in preflight (``--env python``: exit 2).
"""

from __future__ import annotations

import re

from distrl.rollout.envs import Environment
from distrl.rollout.envs.sandbox import Limits, require, run

BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.S)


def observation(result) -> str:
    """The text the model sees for one sandbox :class:`distrl.rollout.envs.sandbox.Result`: its stdout, then a
    line for what went wrong, if anything; ``(no output)`` for none."""
    lines = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.truncated:
        lines.append("[output truncated]")
    if result.status == "error":
        stderr = result.stderr.strip().splitlines()
        lines.append(f"Error: {stderr[-1] if stderr else f'exit status {result.returncode}'}")
    elif result.status == "killed":
        lines.append(f"Killed: signal {-result.returncode} (a CPU, memory or file limit)")
    elif result.status == "timeout":
        lines.append("Killed: time limit")
    return "\n".join(lines) or "(no output)"


def score(text: str, gold: str) -> tuple[float, dict[str, float]]:
    """The reward of a final answer ``text``: integer match against an integer ``gold``, else math_verify."""
    from distrl.rollout.answers import final_answer, normalize_text
    from distrl.rollout.rewards import check_answer, integer_match

    try:
        int(normalize_text(gold))
    except ValueError:  # a gold that is not an integer (MATH): mathematical equivalence
        correct = float(check_answer(gold, final_answer(text))["correct"])
        return correct, {"correct": correct}
    return integer_match(text, gold)


class PythonEnv(Environment):
    """```` ```python ```` blocks run in the sandbox, their output comes back; a turn without one is the answer
    (see the module docstring). Raises SandboxUnavailable on construction where the sandbox does not work."""

    stop = ("\n```\n",)
    limits = Limits()

    def __init__(self):
        require()

    def reset(self, problem) -> None:
        self.problem = problem
        return None

    def step(self, model_text: str):
        blocks = BLOCK.findall(model_text)
        if blocks:
            result = run(blocks[-1], self.limits)
            failed = float(result.status != "ok")
            return observation(result), 0.0, False, {"calls": 1, "errors": failed}
        reward, components = score(model_text, self.problem.gold)
        return None, reward, True, components
