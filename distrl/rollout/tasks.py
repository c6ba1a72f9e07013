"""Tasks: where problems come from, how they are shown to the model, and how completions are scored.

A :class:`Task` gives a rollout actor three things:

- ``problems(seed)``: an endless, seeded stream of :class:`Problem` (dataset tasks shuffle, epoch after
  epoch; each actor passes its own seed, so actors see different orders);
- ``prompt(problem, tokenizer)``: the text handed to the engine (the tokenizer's chat template when
  it has one, else a plain template; ``set_prompt`` applies ``--prompt_template``/``--chat_template``);
- ``reward(completion_text, completion_ids, problem)``: ``(reward, components)``, see `distrl.rollout.rewards`.

For evaluation (`distrl.rollout.evaluation`) a task also gives ``extract_answer(completion_text)`` (the final
answer in canonical form, for majority votes), ``heldout(n, seed)`` (a seeded held-out set of problems
that ``problems`` never yields afterwards) and ``group_keys`` (``Problem.meta`` keys that metrics are
broken down by, e.g. MATH-500's ``subject`` and ``level``).

Tasks (names as in ``distrl.rollout.config.TASKS``): ``arith`` (built-in two-number arithmetic, no download),
``half_vocab`` (a toy reward a tiny random model can raise quickly), ``gsm8k`` and ``math500``
(datasets, scored with math_verify). :func:`load_task` picks one from ``--task`` / ``--dataset``.
"""

from __future__ import annotations

import abc
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

from distrl.rollout.answers import integer_answer, last_boxed
from distrl.rollout.rewards import MathVerifier, Problem, half_vocab_fraction, integer_match

BOXED_INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."

# Hub ids whose config/split differ from (None, "train"), and the default dataset of each dataset task.
HUB_DEFAULTS = {"openai/gsm8k": ("main", "train"), "gsm8k": ("main", "train"),
                "HuggingFaceH4/MATH-500": (None, "test")}
DEFAULT_DATASETS = {"gsm8k": "openai/gsm8k", "math500": "HuggingFaceH4/MATH-500"}


class Task(abc.ABC):
    """Prompt source, prompt template and reward of one kind of problem.

    Args:
        base_seed: the run's seed; ``problems(seed)`` depends on both, so runs differ as well as actors.
    """

    name: str = ""
    system_prompt: str = "You are a helpful assistant. " + BOXED_INSTRUCTION
    template: str | None = None  # --prompt_template text (set_prompt); None: the task's own
    chat: str = "auto"  # --chat_template
    group_keys: tuple[str, ...] = ()  # Problem.meta keys evaluation metrics are broken down by

    def __init__(self, base_seed: int = 0):
        self.base_seed = base_seed
        self.excluded: set[str] = set()  # prompt_ids of held-out problems, never yielded by problems()

    def rng(self, seed: int) -> random.Random:
        """A generator determined by (base_seed, seed) alone (string seeding ignores PYTHONHASHSEED)."""
        return random.Random(f"{self.name}/{self.base_seed}/{seed}")

    def problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream of problems, the same for the same seed, without the held-out ones (:meth:`heldout`)."""
        return (p for p in self._stream(seed) if p.prompt_id not in self.excluded)

    @abc.abstractmethod
    def _stream(self, seed: int) -> Iterator[Problem]:
        """Endless stream of all problems, the same for the same seed."""

    def heldout(self, n: int, seed: int) -> list[Problem]:
        """`n` distinct problems chosen by `seed` (and the task's base seed), in a fixed order; from then on
        :meth:`problems` never yields them (call it before taking problems from a stream).

        Raises:
            ValueError: `n` < 1, or `n` leaves no problem to train on.
        """
        if n < 1:
            raise ValueError(f"held-out size must be >= 1, got {n}")
        problems = self._choose_heldout(n, random.Random(f"{self.name}/heldout/{self.base_seed}/{seed}"))
        self.excluded.update(p.prompt_id for p in problems)
        return problems

    @abc.abstractmethod
    def _choose_heldout(self, n: int, rng: random.Random) -> list[Problem]:
        """`n` distinct problems drawn with `rng`; ValueError if that leaves none for training."""

    def extract_answer(self, completion_text: str) -> str | None:
        """The completion's final answer in canonical form, compared as the reward compares answers
        (equal strings: equal correctness); None when it has none. Base: no answers (None)."""
        return None

    def plain_prompt(self, problem: Problem) -> str:
        """Prompt for a tokenizer without a chat template."""
        return f"Question: {problem.question}\n{BOXED_INSTRUCTION}\nAnswer:"

    def set_prompt(self, template: str | None = None, chat: str = "auto") -> None:
        """Use ``--prompt_template`` (text with ``{question}``, or a file holding it; None: the task's
        own) and ``--chat_template`` (auto | on | off) in :meth:`prompt`.

        Raises ValueError naming the flag: a template without ``{question}``, an unknown ``chat``.
        """
        from distrl.rollout.config import read_prompt_template

        if chat not in ("auto", "on", "off"):
            raise ValueError(f"--chat_template must be auto, on or off, got {chat!r}")
        self.template = None if template is None else read_prompt_template(template)
        self.chat = chat

    def prompt(self, problem: Problem, tokenizer: Any = None) -> str:
        """The engine's input text. Chat (``--chat_template`` on, or auto and `tokenizer` has a chat
        template): system + user turns through the chat template, ending with the assistant's turn; the
        user turn is the question, or the template with ``{question}`` replaced. Plain: the template with
        ``{question}`` replaced, else :meth:`plain_prompt`.

        Raises ValueError with ``--chat_template on`` when `tokenizer` has no chat template.
        """
        template, chat = self.template, self.chat
        has_chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        if chat == "on" and not has_chat:
            raise ValueError("--chat_template on, but the tokenizer has no chat template: use auto or off")
        if chat == "off" or not has_chat:
            return self.plain_prompt(problem) if template is None else template.replace("{question}", problem.question)
        user = problem.question if template is None else template.replace("{question}", problem.question)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @abc.abstractmethod
    def reward(self, completion_text: str, completion_ids: list[int],
               problem: Problem) -> tuple[float, dict[str, float]]:
        """``(reward, named components)`` of one completion of `problem`."""

    def rewards(self, items: Sequence[tuple[str, list[int], Problem]]) -> list[tuple[float, dict[str, float]]]:
        """:meth:`reward` of each ``(completion_text, completion_ids, problem)`` (a task that checks in child
        processes checks them in parallel)."""
        return [self.reward(*item) for item in items]


class ArithTask(Task):
    """``a op b =`` with integers a, b in [0, max_operand] and op from `ops`; gold is the exact result.

    Without a chat template the prompt is the bare expression (``"37+45="``), within the characters
    ``0123456789+-*= `` of the tiny model's tokenizer. Reward: :func:`distrl.rollout.rewards.integer_match`.

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

    group_keys = ("op",)

    def _stream(self, seed: int) -> Iterator[Problem]:
        rng = self.rng(seed)
        while True:
            yield self._draw(rng)

    def _draw(self, rng: random.Random) -> Problem:
        a, b, op = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand), rng.choice(self.ops)
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        expr = f"{a}{op}{b}="
        return Problem(f"arith:{expr}", expr, str(result), {"a": a, "b": b, "op": op})

    def _choose_heldout(self, n, rng):
        total = (self.max_operand + 1) ** 2 * len(self.ops)
        if n > total // 2:
            raise ValueError(f"held-out size {n} (--eval_size / --limit) is more than half of the {total} "
                             f"{self.name} expressions (max_operand {self.max_operand}, ops {''.join(self.ops)})")
        chosen: dict[str, Problem] = {}
        while len(chosen) < n:
            problem = self._draw(rng)
            chosen.setdefault(problem.prompt_id, problem)
        return list(chosen.values())

    def extract_answer(self, completion_text):
        """The integer :func:`distrl.rollout.rewards.integer_match` checks, as a decimal string."""
        answer = integer_answer(completion_text)
        return None if answer is None else str(answer)

    def plain_prompt(self, problem: Problem) -> str:
        return problem.question

    def reward(self, completion_text, completion_ids, problem):
        return integer_match(completion_text, problem.gold)


class HalfVocabTask(ArithTask):
    """Arith prompts; reward = fraction of completion token ids that are even (``in_half``)."""

    name = "half_vocab"

    def reward(self, completion_text, completion_ids, problem):
        return half_vocab_fraction(completion_ids)

    def extract_answer(self, completion_text):
        return None  # no final answer: the reward is about token ids


class MathDatasetTask(Task):
    """A task over dataset rows with a gold final answer, scored by math_verify equivalence.

    Args:
        rows: a `datasets.Dataset` or a list of dicts with at least `required_fields`.
        base_seed: see :class:`Task`.
        verify_timeout_s: seconds one answer check may take (None: unbounded, in the calling thread);
            see :class:`distrl.rollout.rewards.MathVerifier`.
        verify_workers: child processes that check answers in parallel (:meth:`rewards`).

    Raises:
        ValueError: `rows` is empty or lacks a required field.
    """

    required_fields: tuple[str, ...] = ()

    def __init__(self, rows: Sequence[dict], base_seed: int = 0, verify_timeout_s: float | None = 5.0,
                 verify_workers: int = 1):
        super().__init__(base_seed)
        if len(rows) == 0:
            raise ValueError(f"{self.name}: the dataset has no rows")
        missing = self.missing_fields(rows[0])
        if missing:
            raise ValueError(f"{self.name} needs fields {self.missing_fields({})}; "
                             f"missing {missing}, seen {sorted(rows[0])}")
        self.rows = rows
        self.verifier = MathVerifier(verify_timeout_s, verify_workers)

    @classmethod
    def missing_fields(cls, row: dict) -> list[str]:
        """The fields this task needs that `row` lacks ([]: none; ``missing_fields({})``: all it needs)."""
        return [f for f in cls.required_fields if f not in row]

    @abc.abstractmethod
    def to_problem(self, row: dict, index: int) -> Problem:
        """The Problem of dataset row `index`."""

    def _stream(self, seed: int) -> Iterator[Problem]:
        rng = self.rng(seed)
        order = list(range(len(self.rows)))
        while True:
            rng.shuffle(order)
            for i in order:
                yield self.to_problem(self.rows[i], i)

    def _choose_heldout(self, n, rng):
        if n >= len(self.rows):
            raise ValueError(f"held-out size {n} (--eval_size / --limit) leaves none of the {len(self.rows)} "
                             f"{self.name} rows to train on")
        return [self.to_problem(self.rows[i], i) for i in rng.sample(range(len(self.rows)), n)]

    def reward(self, completion_text, completion_ids, problem):
        return self.verifier.score(completion_text, problem.gold)

    def rewards(self, items):
        return self.verifier.score_many([text for text, _, _ in items], [problem.gold for _, _, problem in items])

    def extract_answer(self, completion_text):
        """The answer the reward checks (:func:`distrl.rollout.answers.final_answer`), normalized by math_verify's
        parsing (:func:`distrl.rollout.rewards.normalize_answer`), under the verifier's time limit."""
        return self.verifier.normalize(completion_text)


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
    group_keys = ("subject", "level")

    @classmethod
    def missing_fields(cls, row):
        return super().missing_fields(row) + ([] if {"answer", "solution"} & set(row) else ["answer (or solution)"])

    def to_problem(self, row, index):
        gold = row["answer"] if "answer" in row else (last_boxed(row["solution"]) or "")
        meta = {k: row[k] for k in ("subject", "level") if k in row}
        return Problem(str(row.get("unique_id") or f"math500:{index}"), row["problem"], gold, meta)


DATASET_TASKS = {"gsm8k": GSM8KTask, "math500": MATH500Task}
BUILTIN_TASKS = {"arith": ArithTask, "half_vocab": HalfVocabTask}


LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # suffix -> `datasets` builder


def first_rows(dataset: str, n: int = 1) -> list[dict] | None:
    """The first `n` rows of a local file that :func:`load_rows` would load (.jsonl/.json/.parquet), read
    without `datasets` and without reading the rest (preflight); None for a hub id or a folder.

    Raises OSError when the file cannot be read, ValueError when it does not parse.
    """
    import json

    path = Path(dataset).expanduser()
    builder = LOCAL_BUILDERS.get(path.suffix)
    if builder is None or not path.is_file():
        return None
    if builder == "parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
        return [] if batch is None else batch.to_pylist()[:n]
    with open(path) as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith("["):  # one JSON array (`datasets` reads it too)
            return json.load(f)[:n]
        rows = []
        for line in f:  # JSON lines
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) == n:
                break
        return rows


def load_rows(dataset: str, config_name: str | None = None, split: str | None = None):
    """Load a dataset with `datasets`: a local .jsonl/.json/.parquet file, or a hub id (or local dataset folder).

    Hub ids use `HUB_DEFAULTS` for config and split when not given (else no config, split "train").

    Raises:
        ValueError: a local path with another suffix. Errors of `datasets.load_dataset` pass through.
    """
    from datasets import load_dataset

    path = Path(dataset)
    builder = LOCAL_BUILDERS.get(path.suffix)
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
              verify_timeout_s: float | None = 5.0, verify_workers: int = 1, arith_ops: Sequence[str] = ("+", "-"),
              arith_max_operand: int = 99) -> Task:
    """The task of a run, from ``--task`` and ``--dataset``.

    - `task` arith/half_vocab: built-in problems; `dataset` is ignored.
    - `task` gsm8k/math500: rows from `dataset`, default its hub dataset (`DEFAULT_DATASETS`).
    - no `task`: inferred from the dataset's fields (:func:`infer_task`); no dataset either: arith.

    `seed` is the run's seed (each actor then passes its own seed to ``problems``). `verify_timeout_s` and
    `verify_workers` set gsm8k/math500's :class:`distrl.rollout.rewards.MathVerifier`.
    `arith_ops` and `arith_max_operand` (``--arith_ops``, ``--arith_max_operand``) shape arith/half_vocab.

    Raises:
        ValueError: unknown `task`; a dataset whose fields match no task while `task` is None (the
            message names the fields seen); a dataset lacking the fields `task` needs.
    """
    if task is not None and task not in BUILTIN_TASKS and task not in DATASET_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(BUILTIN_TASKS) + sorted(DATASET_TASKS)}")
    if task in BUILTIN_TASKS or (task is None and dataset is None):
        return BUILTIN_TASKS[task or "arith"](base_seed=seed, max_operand=arith_max_operand, ops=tuple(arith_ops))
    rows = load_rows(dataset or DEFAULT_DATASETS[task], config_name, split)
    if task is None:
        task = infer_task(rows, dataset)
        if task is None:
            seen = sorted(rows[0]) if len(rows) else []
            raise ValueError(f"--dataset {dataset}: cannot infer the task from fields {seen} (gsm8k needs "
                             f"question+answer with '####', math500 problem+answer); pass --task")
    return DATASET_TASKS[task](rows, base_seed=seed, verify_timeout_s=verify_timeout_s, verify_workers=verify_workers)
