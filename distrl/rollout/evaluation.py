"""Evaluation: sample a task's problems with a rollout engine, score them with the task's reward, summarize.

Per problem i with n samples of which c_i are correct (the reward's ``correct`` component; a reward
without one counts as correct when it is 1.0):

- ``pass@1`` (also ``accuracy``): mean over problems of c_i / n.
- ``pass@k``: mean over problems of the unbiased estimator of Chen et al. 2021 (Codex paper, eq. 1),
  ``1 - C(n - c, k) / C(n, k)``: the chance that at least one of k samples drawn without replacement
  from the n is correct. ``pass@1`` is its k = 1 case.
- ``maj@k``: mean over problems of the correctness of the majority vote over the canonical answers
  (``Task.extract_answer``) of the *first* k samples. Samples without an answer do not vote; ties go
  to the answer seen first; no answer at all counts as wrong. The voted answer is correct when the
  first sample that gave it is correct (equal canonical answers have equal correctness: the answer is
  canonicalized the way the reward parses it).
- ``mean_length``: mean completion length in tokens over all samples.

:func:`evaluate_engine` runs this with any :class:`distrl.rollout.engines.Engine` (whatever version it serves);
``distrl eval`` (:func:`distrl.cmd.evaluate.run`) evaluates a model, optionally with a published
version's weights, on a dataset.

Periodic evaluation during training (``--eval_every N``, :class:`PeriodicEval`), run by rollout actor 0
with its own engine (with ``--env``, whole episodes through its environment: :func:`evaluate_episodes`).
Every actor leaves the held-out problems (``Task.heldout(--eval_size, --seed)``) out of its training stream;
actor 0 also evaluates them (:func:`evaluate_engine`, the task's own reward) at version 0, at every
multiple of N it serves, and at the final version. Each evaluation is logged as ``eval/<metric>`` (and
``eval/by_group/<group>/accuracy``) to the actor's TensorBoard with step = policy version, and appended
as one JSON line to ``<run_dir>/eval.jsonl``::

    {"version": 2, "wall_s": 31.4, "eval_s": 1.2, "accuracy": 0.0, "pass@1": 0.0, ..., "by_group": {...}}

``wall_s`` is seconds since the actor started, ``eval_s`` the evaluation's own duration. Versions
already in eval.jsonl (a resumed or restarted actor) are not evaluated again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("distrl.actor")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `n` samples, `c` of them correct: ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: not ``0 <= c <= n`` or not ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"correct count must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """The most frequent answer that is not None; ties go to the answer seen first; None if there is none."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == top)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """1.0 when the majority vote over the first `k` `answers` is correct, else 0.0.

    ``correct[i]`` is sample i's correctness; the voted answer takes that of its first sample.

    Raises:
        ValueError: `answers` and `correct` differ in length, or not ``1 <= k <= len(answers)``.
    """
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must be in [1, {len(answers)}], got {k}")
    voted = majority_vote(answers[:k])
    return float(voted is not None and correct[list(answers).index(voted)])


def default_ks(n: int) -> list[int]:
    """The k of pass@k and maj@k reported for `n` samples: the powers of two below n, and n (n=8: 1 2 4 8)."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


@dataclass
class SampleRecord:
    """One scored completion: its text, canonical answer (or None), correctness, reward, length (tokens)."""

    text: str
    answer: str | None
    correct: bool
    reward: float
    length: int
    finish_reason: str


@dataclass
class ProblemRecord:
    """One problem's samples; ``groups`` holds its breakdown values (e.g. ``{"subject": "Algebra", "level": "3"}``)."""

    prompt_id: str
    gold: str
    groups: dict[str, str]
    samples: list[SampleRecord]


@dataclass
class EvalReport:
    """What :func:`evaluate_engine` returns.

    Attributes:
        metrics: ``accuracy`` (= ``pass@1``), ``pass@{k}`` and ``maj@{k}`` for each k, ``mean_length``
            (tokens), ``num_problems``, ``num_samples`` (per problem).
        by_group: ``"<key>=<value>"`` (e.g. ``"subject=Algebra"``, ``"level=3"``) -> the same metrics
            over that group's problems.
        records: per-problem sample records (what the metrics were computed from).
        version: the policy version the engine served.
        settings: the sampling settings (num_samples, temperature, max_new_tokens, seed, ks).
    """

    metrics: dict[str, float]
    by_group: dict[str, dict[str, float]]
    records: list[ProblemRecord] = field(default_factory=list)
    version: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready dict: version, settings, metrics, by_group and ``problems`` (the records)."""
        return {"version": self.version, "settings": self.settings, "metrics": self.metrics,
                "by_group": self.by_group, "problems": [dataclasses.asdict(r) for r in self.records]}


def score_problem(task, problem, completions: Sequence[tuple[str, list[int], str]]) -> ProblemRecord:
    """Score `completions` of `problem` (each ``(text, token_ids, finish_reason)``) with the task's reward
    and :meth:`Task.extract_answer`. Training rewards and evaluation go through this same function."""
    samples = []
    for text, token_ids, finish in completions:
        reward, components = task.reward(text, list(token_ids), problem)
        correct = bool(components["correct"] > 0) if "correct" in components else reward >= 1.0
        samples.append(SampleRecord(text, task.extract_answer(text), correct, float(reward), len(token_ids), finish))
    groups = {key: str(problem.meta[key]) for key in task.group_keys if key in problem.meta}
    return ProblemRecord(problem.prompt_id, problem.gold, groups, samples)


def summarize(records: Sequence[ProblemRecord], ks: Sequence[int]) -> dict[str, float]:
    """The metrics of `records` (see the module docstring); every problem must have the same sample count.

    Raises:
        ValueError: no records, unequal sample counts, or a k outside [1, n].
    """
    if not records:
        raise ValueError("no problems to summarize")
    n = len(records[0].samples)
    if any(len(r.samples) != n for r in records):
        raise ValueError("every problem needs the same number of samples")
    correct = [[s.correct for s in r.samples] for r in records]
    metrics = {"accuracy": sum(sum(c) / n for c in correct) / len(records)}
    metrics["pass@1"] = metrics["accuracy"]
    for k in ks:
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(c), k) for c in correct) / len(records)
    for k in ks:
        metrics[f"maj@{k}"] = sum(maj_at_k([s.answer for s in r.samples], c, k)
                                  for r, c in zip(records, correct)) / len(records)
    metrics["mean_length"] = sum(s.length for r in records for s in r.samples) / (n * len(records))
    metrics["num_problems"] = float(len(records))
    metrics["num_samples"] = float(n)
    return metrics


def summarize_by_group(records: Sequence[ProblemRecord], ks: Sequence[int]) -> dict[str, dict[str, float]]:
    """``"<key>=<value>"`` -> :func:`summarize` of the records with that group value, sorted by name."""
    members: dict[str, list[ProblemRecord]] = {}
    for record in records:
        for key, value in record.groups.items():
            members.setdefault(f"{key}={value}", []).append(record)
    return {name: summarize(members[name], ks) for name in sorted(members)}


def _checked_ks(problems, num_samples: int, temperature: float, ks: Sequence[int] | None) -> list[int]:
    """The k of pass@k and maj@k (default :func:`default_ks`); ValueError for an evaluation that cannot run."""
    if not problems:
        raise ValueError("no problems to evaluate")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    ks = default_ks(num_samples) if ks is None else sorted(set(ks))
    if any(not 1 <= k <= num_samples for k in ks):
        raise ValueError(f"every k must be in [1, num_samples={num_samples}], got {list(ks)}")
    return ks


def evaluate_engine(engine, task, problems, *, num_samples: int = 1, temperature: float = 0.0,
                    max_new_tokens: int, seed: int = 0, ks: Sequence[int] | None = None) -> EvalReport:
    """Sample `num_samples` completions per problem with `engine` (the version it serves), score them.

    Args:
        engine: a :class:`distrl.rollout.engines.Engine`.
        task: the :class:`distrl.rollout.tasks.Task` that makes the prompts and rewards.
        problems: the :class:`distrl.rollout.tasks.Problem` list to evaluate (e.g. ``task.heldout(n, seed)``).
        num_samples: completions per problem (n).
        temperature: sampling temperature; 0 is greedy.
        max_new_tokens: most tokens per completion.
        seed: sampling seed (sample j of prompt i of the whole list uses ``seed + i * num_samples + j``
            with vLLM).
        ks: the k of pass@k and maj@k (default :func:`default_ks`), each in [1, num_samples].
    Returns:
        An :class:`EvalReport` with the metrics, the per-group metrics and the per-sample records.
    Raises:
        ValueError: no problems, num_samples < 1, temperature < 0, or a k outside [1, num_samples].
    """
    ks = _checked_ks(problems, num_samples, temperature, ks)
    prompts = [task.prompt(p, engine.tokenizer) for p in problems]
    results = engine.generate(prompts, num_samples, temperature, max_new_tokens, seed=seed)
    records = [score_problem(task, problem, [(c.text, c.token_ids, c.finish_reason) for c in result.completions])
               for problem, result in zip(problems, results)]
    settings = {"num_samples": num_samples, "temperature": temperature, "max_new_tokens": max_new_tokens,
                "seed": seed, "ks": list(ks)}
    return EvalReport(summarize(records, ks), summarize_by_group(records, ks), records, engine.version, settings)


def evaluate_episodes(runner, task, problems, *, num_samples: int = 1, temperature: float = 0.0, seed: int = 0,
                      ks: Sequence[int] | None = None) -> EvalReport:
    """:func:`evaluate_engine` with ``--env``: each sample is a whole episode that ``runner`` plays.

    ``runner`` is the actor's :class:`distrl.rollout.envs.episodes.EpisodeRunner` (its engine, environment and
    limits: ``--max_new_tokens`` per turn); each problem's prompt is templated as in training and the episode's
    reward is the environment's final reward: a sample is correct when its ``correct`` component is > 0 (else
    when the reward is 1.0), its answer is :meth:`Task.extract_answer` of the episode's text (the final turn
    comes last) and its length counts every completion token (model and observations). The runner's cumulative
    counts (episodes, turns, errors, cut) are left as they were: they describe training. Raises as
    :func:`evaluate_engine`.
    """
    ks = _checked_ks(problems, num_samples, temperature, ks)
    tokenizer = runner.engine.tokenizer
    prompts = [tokenizer(task.prompt(p, tokenizer))["input_ids"] for p in problems]
    counts = (runner.episodes, runner.turns, runner.errors, runner.cut)
    results = {}
    try:
        for finished in runner.run(list(problems), prompts, num_samples, temperature, seed=seed):
            results.update(finished)
    finally:
        runner.episodes, runner.turns, runner.errors, runner.cut = counts
    records = []
    for i, problem in enumerate(problems):
        samples = [SampleRecord(c.text, task.extract_answer(c.text),
                                bool(c.components["correct"] > 0) if "correct" in c.components else c.reward >= 1.0,
                                float(c.reward), len(c.token_ids), c.finish_reason) for c in results[i].completions]
        groups = {key: str(problem.meta[key]) for key in task.group_keys if key in problem.meta}
        records.append(ProblemRecord(problem.prompt_id, problem.gold, groups, samples))
    settings = {"num_samples": num_samples, "temperature": temperature, "max_new_tokens": runner.max_new_tokens,
                "seed": seed, "ks": list(ks), "env": runner.pool.spec}
    return EvalReport(summarize(records, ks), summarize_by_group(records, ks), records, runner.engine.version,
                      settings)


def eval_line(report: EvalReport, wall_s: float, eval_s: float) -> dict:
    """One line of ``<run_dir>/eval.jsonl``: ``{"version", "wall_s", "eval_s", <metrics>..., "by_group"}``.

    `wall_s`: seconds since the actor started; `eval_s`: seconds the evaluation took.
    """
    return {"version": report.version, "wall_s": wall_s, "eval_s": eval_s, **report.metrics,
            "by_group": report.by_group}


class PeriodicEval:
    """When to evaluate, and what to write: one instance in actor 0.

    Args:
        every: --eval_every (policy versions between evaluations).
        task: the actor's task; problems: its held-out problems.
        log_path: the eval.jsonl file (appended to; created on first use).
        num_samples, temperature: --eval_num_samples, --eval_temperature; max_new_tokens, seed: the run's.
        episodes: with --env, the actor's episode runner: each sample is an episode (:func:`evaluate_episodes`).
    """

    def __init__(self, every: int, task, problems: list, log_path: str | Path, *, num_samples: int = 1,
                 temperature: float = 0.0, max_new_tokens: int = 256, seed: int = 0, episodes=None):
        self.task, self.problems, self.episodes = task, problems, episodes
        self.every, self.num_samples, self.temperature = every, num_samples, temperature
        self.max_new_tokens, self.seed = max_new_tokens, seed
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
        if self.episodes is not None:
            report = evaluate_episodes(self.episodes, self.task, self.problems, num_samples=self.num_samples,
                                       temperature=self.temperature, seed=self.seed)
        else:
            report = evaluate_engine(engine, self.task, self.problems, num_samples=self.num_samples,
                                     temperature=self.temperature, max_new_tokens=self.max_new_tokens, seed=self.seed)
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
