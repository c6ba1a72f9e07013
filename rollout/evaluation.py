"""Periodic evaluation during training (``--eval_every N``), run by rollout actor 0 with its own engine.

Every actor leaves the held-out problems (``Task.heldout(--eval_size, --seed)``) out of its training
stream; actor 0 also evaluates them (:func:`distrl.cmd.evaluate.evaluate_engine`, the task's own reward)
at version 0, at every multiple of N it serves, and at the final version. Each evaluation is logged
as ``eval/<metric>`` (and ``eval/by_group/<group>/accuracy``) to the actor's TensorBoard with step =
policy version, and appended as one JSON line to ``<run_dir>/eval.jsonl``::

    {"version": 2, "wall_s": 31.4, "eval_s": 1.2, "accuracy": 0.0, "pass@1": 0.0, ..., "by_group": {...}}

``wall_s`` is seconds since the actor started, ``eval_s`` the evaluation's own duration. Versions
already in eval.jsonl (a resumed or restarted actor) are not evaluated again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from distrl.cmd.evaluate import eval_line, evaluate_engine

log = logging.getLogger("distrl.actor")


class PeriodicEval:
    """When to evaluate, and what to write: one instance in actor 0.

    Args:
        cfg: the run's TrainConfig (``eval_every``, ``eval_num_samples``, ``eval_temperature``,
            ``max_new_tokens``, ``seed``).
        task: the actor's task; problems: its held-out problems.
        log_path: the eval.jsonl file (appended to; created on first use).
    """

    def __init__(self, cfg, task, problems: list, log_path: str | Path):
        self.cfg, self.task, self.problems = cfg, task, problems
        self.every = cfg.eval_every
        self.log_path = Path(log_path)
        self.done: set[int] = set()
        if self.log_path.is_file():
            self.done = {json.loads(line)["version"] for line in self.log_path.read_text().splitlines() if line.strip()}
        self.start = time.time()

    def due(self, version: int, final: bool = False) -> bool:
        """Whether `version` is to be evaluated now: a multiple of --eval_every (or the final one), not yet done."""
        return version not in self.done and (final or version % self.every == 0)

    def skipped(self, served: int, newest: int) -> int | None:
        """The newest multiple of --eval_every strictly between `served` and `newest` not evaluated yet, else None."""
        target = newest // self.every * self.every
        return target if served < target < newest and target not in self.done else None

    def evaluate(self, engine, metrics) -> dict:
        """Evaluate the version `engine` serves; log it to `metrics` (a distrl.core.metrics.Metrics) and
        eval.jsonl; return the eval.jsonl line."""
        t0 = time.perf_counter()
        report = evaluate_engine(engine, self.task, self.problems, num_samples=self.cfg.eval_num_samples,
                                 temperature=self.cfg.eval_temperature, max_new_tokens=self.cfg.max_new_tokens,
                                 seed=self.cfg.seed)
        line = eval_line(report, time.time() - self.start, time.perf_counter() - t0)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        scalars = {f"eval/{k}": v for k, v in report.metrics.items() if not k.startswith("num_")}
        scalars.update({f"eval/by_group/{g}/accuracy": m["accuracy"] for g, m in report.by_group.items()})
        metrics.scalars(scalars, step=report.version)
        self.done.add(report.version)
        log.info("eval: policy version %d, accuracy %.4f on %d held-out problems (%.1f s)", report.version,
                 report.metrics["accuracy"], len(self.problems), line["eval_s"])
        return line
