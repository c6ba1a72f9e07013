"""Tasks: where problems come from, how they are shown to the model, and how completions are scored.

A :class:`Task` gives a rollout actor three things:

- ``problems(seed)``: an endless, seeded stream of :class:`Problem` (dataset tasks shuffle, epoch after
  epoch; each actor passes its own seed, so actors see different orders);
- ``prompt(problem, tokenizer)``: the text handed to the engine (the tokenizer's chat template when
  it has one, else a plain template);
- ``reward(completion_text, completion_ids, problem)``: ``(reward, components)``, see `rollout.rewards`.

Tasks (names as in ``distrl.config.TASKS``): ``arith`` (built-in two-number arithmetic, no download),
``half_vocab`` (a toy reward a tiny random model can raise quickly), ``gsm8k`` and ``math500``
(datasets, scored with math_verify). :func:`load_task` picks one from ``--task`` / ``--dataset``.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from rollout.rewards import MathVerifier, half_vocab_fraction, integer_match, last_boxed

BOXED_INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."

# Hub ids whose config/split differ from (None, "train"), and the default dataset of each dataset task.
HUB_DEFAULTS = {"openai/gsm8k": ("main", "train"), "gsm8k": ("main", "train"),
                "HuggingFaceH4/MATH-500": (None, "test")}
DEFAULT_DATASETS = {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500"}


@dataclass
class Problem:
    """One problem instance: ``prompt_id`` is stable across epochs and actors; ``gold`` is the final answer."""

    prompt_id: str
    question: str
    gold: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """Prompt source, prompt template and reward of one kind of problem.

    Args:
        base_seed: the run's seed; ``problems(seed)`` depends on both, so runs differ as well as actors.
    """

    name: str = ""
    system_prompt: str = "You are a helpful assistant. " + BOXED_INSTRUCTION

    def __init__(self, base_seed: int = 0):
        self.base_seed = base_seed

    def rng(self, seed: int) -> random.Random:
        """A generator determined by (base_seed, seed) alone (string seeding ignores PYTHONHASHSEED)."""
        return random.Random(f"{self.name}/{self.base_seed}/{seed}")

    @abc.abstractmethod
    def problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream of problems, the same for the same seed."""

    def plain_prompt(self, problem: Problem) -> str:
        """Prompt for a tokenizer without a chat template."""
        return f"Question: {problem.question}\n{BOXED_INSTRUCTION}\nAnswer:"

    def prompt(self, problem: Problem, tokenizer: Any = None) -> str:
        """The engine's input text: system + user turns through the chat template, ending with the
        assistant's turn, when `tokenizer` has one; else :meth:`plain_prompt`."""
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return self.plain_prompt(problem)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": problem.question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @abc.abstractmethod
    def reward(self, completion_text: str, completion_ids: list[int], problem: Problem) -> tuple[float, dict[str, float]]:
        """``(reward, named components)`` of one completion of `problem`."""


class ArithTask(Task):
    """``a op b =`` with integers a, b in [0, max_operand] and op from `ops`; gold is the exact result.

    Without a chat template the prompt is the bare expression (``"37+45="``), within the characters
    ``0123456789+-*= `` of the tiny model's tokenizer. Reward: :func:`rollout.rewards.integer_match`.

    Raises:
        ValueError: `max_operand` < 1, or `ops` empty or not within ``+ - *``.
    """

    name = "arith"
    system_prompt = "Compute the result. Put the final answer within \\boxed{}."

    def __init__(self, base_seed: int = 0, max_operand: int = 99, ops: Sequence[str] = ("+", "-")):
        super().__init__(base_seed)
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not ops or set(ops) - {"+", "-", "*"}:
            raise ValueError(f"ops must be a non-empty subset of + - *, got {list(ops)}")
        self.max_operand, self.ops = max_operand, tuple(ops)

    def problems(self, seed: int) -> Iterator[Problem]:
        rng = self.rng(seed)
        while True:
            a, b, op = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand), rng.choice(self.ops)
            result = {"+": a + b, "-": a - b, "*": a * b}[op]
            expr = f"{a}{op}{b}="
            yield Problem(f"arith:{expr}", expr, str(result), {"a": a, "b": b, "op": op})

    def plain_prompt(self, problem: Problem) -> str:
        return problem.question

    def reward(self, completion_text, completion_ids, problem):
        return integer_match(completion_text, problem.gold)


class HalfVocabTask(ArithTask):
    """Arith prompts; reward = fraction of completion token ids that are even (``in_half``)."""

    name = "half_vocab"

    def reward(self, completion_text, completion_ids, problem):
        return half_vocab_fraction(completion_ids)


class MathDatasetTask(Task):
    """A task over dataset rows with a gold final answer, scored by math_verify equivalence.

    Args:
        rows: a `datasets.Dataset` or a list of dicts with at least `required_fields`.
        base_seed: see :class:`Task`.
        verify_timeout_s: seconds one answer check may take (None: unbounded, in the calling thread);
            see :class:`rollout.rewards.MathVerifier`.

    Raises:
        ValueError: `rows` is empty or lacks a required field.
    """

    required_fields: tuple[str, ...] = ()

    def __init__(self, rows: Sequence[dict], base_seed: int = 0, verify_timeout_s: float | None = 5.0):
        super().__init__(base_seed)
        if len(rows) == 0:
            raise ValueError(f"{self.name}: the dataset has no rows")
        missing = [f for f in self.required_fields if f not in rows[0]]
        if missing:
            raise ValueError(f"{self.name} needs fields {list(self.required_fields)}; "
                             f"missing {missing}, seen {sorted(rows[0])}")
        self.rows = rows
        self.verifier = MathVerifier(verify_timeout_s)

    @abc.abstractmethod
    def to_problem(self, row: dict, index: int) -> Problem:
        """The Problem of dataset row `index`."""

    def problems(self, seed: int) -> Iterator[Problem]:
        rng = self.rng(seed)
        order = list(range(len(self.rows)))
        while True:
            rng.shuffle(order)
            for i in order:
                yield self.to_problem(self.rows[i], i)

    def reward(self, completion_text, completion_ids, problem):
        return self.verifier.score(completion_text, problem.gold)


class GSM8KTask(MathDatasetTask):
    """GSM8K rows ``{question, answer}``; gold = text after the last ``####`` with commas removed ("" if none)."""

    name = "gsm8k"
    required_fields = ("question", "answer")

    def to_problem(self, row, index):
        answer = row["answer"]
        gold = answer.rsplit("####", 1)[1].strip().replace(",", "") if "####" in answer else ""
        return Problem(f"gsm8k:{index}", row["question"], gold, {})


class MATH500Task(MathDatasetTask):
    """MATH rows ``{problem, answer}`` (+ ``subject``, ``level``, ``unique_id`` as prompt_id).

    Rows with a ``solution`` but no ``answer`` (the original MATH files) take the last ``\\boxed{}``
    of the solution as gold.
    """

    name = "math500"
    required_fields = ("problem",)

    def __init__(self, rows, base_seed=0, verify_timeout_s=5.0):
        super().__init__(rows, base_seed, verify_timeout_s)
        if "answer" not in rows[0] and "solution" not in rows[0]:
            raise ValueError(f"math500 needs an 'answer' or 'solution' field, seen {sorted(rows[0])}")

    def to_problem(self, row, index):
        gold = row["answer"] if "answer" in row else (last_boxed(row["solution"]) or "")
        meta = {k: row[k] for k in ("subject", "level") if k in row}
        return Problem(str(row.get("unique_id") or f"math500:{index}"), row["problem"], gold, meta)


DATASET_TASKS = {"gsm8k": GSM8KTask, "math500": MATH500Task}
BUILTIN_TASKS = {"arith": ArithTask, "half_vocab": HalfVocabTask}


def load_rows(dataset: str, config_name: str | None = None, split: str | None = None):
    """Load a dataset with `datasets`: a local .jsonl/.json/.parquet file, or a hub id (or local dataset folder).

    Hub ids use `HUB_DEFAULTS` for config and split when not given (else no config, split "train").

    Raises:
        ValueError: a local path with another suffix. Errors of `datasets.load_dataset` pass through.
    """
    from datasets import load_dataset

    path = Path(dataset)
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if builder is not None:
        return load_dataset(builder, data_files=str(path), split=split or "train")
    if path.is_file():
        raise ValueError(f"--dataset {dataset}: local files must be .jsonl, .json or .parquet")
    default_config, default_split = HUB_DEFAULTS.get(dataset, (None, "train"))
    return load_dataset(dataset, config_name or default_config, split=split or default_split)


def infer_task(rows, dataset: str) -> str | None:
    """``gsm8k`` for ``question``+``answer`` rows whose answer has ``####`` (or a name containing gsm8k);
    ``math500`` for ``problem`` + ``answer``/``solution`` rows; else None."""
    fields = set(rows[0]) if len(rows) else set()
    if {"question", "answer"} <= fields and ("####" in str(rows[0]["answer"]) or "gsm8k" in dataset.lower()):
        return "gsm8k"
    if "problem" in fields and fields & {"answer", "solution"}:
        return "math500"
    return None


def load_task(task: str | None = None, dataset: str | None = None, seed: int = 0, *,
              config_name: str | None = None, split: str | None = None,
              verify_timeout_s: float | None = 5.0) -> Task:
    """The task of a run, from ``--task`` and ``--dataset``.

    - `task` arith/half_vocab: built-in problems; `dataset` is ignored.
    - `task` gsm8k/math500: rows from `dataset`, default its hub dataset (`DEFAULT_DATASETS`).
    - no `task`: inferred from the dataset's fields (:func:`infer_task`); no dataset either: arith.

    `seed` is the run's seed (each actor then passes its own seed to ``problems``).

    Raises:
        ValueError: unknown `task`; a dataset whose fields match no task while `task` is None (the
            message names the fields seen); a dataset lacking the fields `task` needs.
    """
    if task is not None and task not in BUILTIN_TASKS and task not in DATASET_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(BUILTIN_TASKS) + sorted(DATASET_TASKS)}")
    if task in BUILTIN_TASKS or (task is None and dataset is None):
        return BUILTIN_TASKS[task or "arith"](base_seed=seed)
    rows = load_rows(dataset or DEFAULT_DATASETS[task], config_name, split)
    if task is None:
        task = infer_task(rows, dataset)
        if task is None:
            seen = sorted(rows[0]) if len(rows) else []
            raise ValueError(f"--dataset {dataset}: cannot infer the task from fields {seen} (gsm8k needs "
                             f"question+answer with '####', math500 problem+answer); pass --task")
    return DATASET_TASKS[task](rows, base_seed=seed, verify_timeout_s=verify_timeout_s)
