"""verl's custom reward function for bench/vs_peer.py: distrl's own task reward on the same problems.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` per completion; each row of the
parquet files bench/vs_peer.py writes carries its distrl problem (JSON fields) in ``extra_info["problem"]`` and
the task's settings in ``extra_info["task"]`` (JSON), so the reward is distrl's ``Task.reward``, exactly.
"""

from __future__ import annotations

import json
import threading

_TASKS: dict[str, object] = {}
# verl scores from several threads of one process; two first calls building the task at once ran `datasets`'
# file resolution (tqdm's thread_map) concurrently, and tqdm's class-level lock raced: "type object 'tqdm' has no
# attribute '_lock'" ended a verl run (2026-12-07). One build at a time.
_BUILD = threading.Lock()


def task_of(spec: str):
    """The distrl task of a JSON spec ``{"name", "dataset", "template"}`` (built once per process)."""
    if spec not in _TASKS:
        with _BUILD:
            if spec not in _TASKS:
                _TASKS[spec] = _build(spec)
    return _TASKS[spec]


def _build(spec: str):
    from distrl.rollout.tasks import load_task

    s = json.loads(spec)
    extra = {"arith_ops": ("+", "-"), "arith_max_operand": 99} if s["name"] == "arith" else {}
    task = load_task(s["name"], s.get("dataset"), seed=1, **extra)
    if s.get("template"):
        task.set_prompt(s["template"])
    return task


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw) -> float:
    from distrl.rollout.rewards import Problem

    problem = Problem(**json.loads(extra_info["problem"]))
    return float(task_of(extra_info["task"]).reward(solution_str, [], problem)[0])
