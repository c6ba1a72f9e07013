"""Prompts longer than the engine leaves room for: measured as templated, handled by ``--long_prompts``.

A prompt's length is the number of token ids the engine receives for it (:func:`prompt_ids`: the
task's template, chat template included, encoded as the engines encode text,
:func:`distrl.rollout.engines.base.encode_prompt`; the actor hands the engine exactly these ids). A prompt is
*long* when that number exceeds ``limit = max_model_len - max_new_tokens`` (``--max_model_len``, else the
model's ``max_position_embeddings``; no limit when neither is known). ``--long_prompts``:

- ``skip`` (default): the actor never generates for it: it draws the next problem instead (no credit is
  spent on it) and counts it (TensorBoard ``rollout/long_prompts_skipped``, the summary's
  ``long_prompts_skipped``). Preflight refuses a run whose every prompt is long.
- ``truncate``: the actor keeps the prompt's *last* ``limit`` tokens. The end is what the model answers
  after: the question's last sentence and, with a chat template, the assistant header; cutting the end
  instead would leave the model continuing the user's turn. vLLM's ``truncate_prompt_tokens`` and TRL's
  GRPO (``truncation_side="left"``) keep the end the same way. The system prompt and the start of the
  question are what is lost. Counted as ``rollout/long_prompts_truncated``.
- ``error``: :func:`check_prompt_lengths` (preflight) refuses the run before anything starts.

:func:`check_prompt_lengths` needs a tokenizer and the model's config only (no weights): MATH-500's
500 prompts take well under a second once the tokenizer is loaded; a repeated launch reads chat-templated
lengths from distrl's cache directory (:func:`prompt_lengths`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Sequence

from distrl.core.errors import PreflightError
from distrl.core.probe import cache_dir, installed, write_cache_file
from distrl.core.run_options import SharedOptions
from distrl.rollout.config import PromptOptions, TaskOptions
from distrl.rollout.engines.base import encode_prompt

POLICIES = ("skip", "truncate", "error")
BUILTIN_SAMPLE = 1000  # problems of an endless built-in task (arith, half_vocab) that preflight measures


@dataclass(frozen=True)
class PromptFit:
    """What :func:`check_prompt_lengths` measured: ``total`` prompts, ``long`` of them over ``limit``
    tokens (None: no limit known), the ``longest`` templated prompt in tokens, and the ``policy``."""

    total: int
    long: int
    longest: int
    limit: int | None
    policy: str = "skip"


def prompt_limit(max_model_len: int | None, max_new_tokens: int, model_max: int | None) -> int | None:
    """Most prompt tokens that leave `max_new_tokens` under `max_model_len` (else `model_max`, the model's
    ``max_position_embeddings``); None when neither is known (no check)."""
    total = max_model_len or model_max
    return None if total is None else total - max_new_tokens


def prompt_ids(task, problem, tokenizer) -> tuple[str, list[int]]:
    """``(text, ids)`` of `problem`'s prompt as the engine receives it: ``task.prompt`` (the chat template
    when it applies), encoded by :func:`distrl.rollout.engines.base.encode_prompt`."""
    text = task.prompt(problem, tokenizer)
    return text, encode_prompt(tokenizer, text)


class LongPrompts:
    """Applies ``--long_prompts`` to an actor's stream of problems.

    Args:
        task, tokenizer: the actor's task and its engine's tokenizer.
        limit: most prompt tokens (:func:`prompt_limit`); None: every prompt fits.
        policy: one of `POLICIES`. max_new_tokens: only named in the error's fix.
    Attributes: skipped, truncated: prompts met so far that were long, per policy.
    """

    def __init__(self, task, tokenizer, limit: int | None, policy: str = "skip", max_new_tokens: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"--long_prompts must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.task, self.tokenizer, self.limit, self.policy = task, tokenizer, limit, policy
        self.max_new_tokens = max_new_tokens
        self.skipped = self.truncated = 0

    def fits(self, problem) -> bool:
        """Whether `problem`'s prompt fits whole (not counted)."""
        return self.limit is None or len(prompt_ids(self.task, problem, self.tokenizer)[1]) <= self.limit

    def fit(self, problem) -> tuple[str, list[int]] | None:
        """``(text, ids)`` to generate from for `problem`, truncated to the last `limit` ids under
        ``truncate``; None when it is long under ``skip`` (counted).

        Raises:
            PreflightError: a long prompt under ``error`` (preflight should have refused the run).
        """
        text, ids = prompt_ids(self.task, problem, self.tokenizer)
        if self.limit is None or len(ids) <= self.limit:
            return text, ids
        if self.policy == "skip":
            self.skipped += 1
            return None
        if self.policy == "truncate" and self.limit > 0:
            self.truncated += 1
            ids = ids[-self.limit:]
            return self.tokenizer.decode(ids), ids
        raise PreflightError("--max_model_len", f"prompt {problem.prompt_id} has {len(ids)} tokens as templated, "
                             f"over the {self.limit} left by --max_new_tokens", _fix(len(ids) + self.max_new_tokens))

    def stream(self, problems: Iterator, max_skips: int = 100_000) -> Iterator[tuple[Any, str, list[int]]]:
        """``(problem, text, ids)`` for each problem of `problems` that `fit` keeps.

        Raises:
            PreflightError: `max_skips` long prompts in a row (no prompt of the task fits).
        """
        in_a_row = 0
        for problem in problems:
            kept = self.fit(problem)
            if kept is not None:
                in_a_row = 0
                yield (problem, *kept)
                continue
            in_a_row += 1
            if in_a_row >= max_skips:
                raise PreflightError("--max_model_len", f"{in_a_row} prompts in a row are longer than the "
                                     f"{self.limit} tokens left by --max_new_tokens", "raise --max_model_len")


def measure(task, problems: Sequence, tokenizer, limit: int | None, policy: str = "skip") -> PromptFit:
    """Count the prompts of `problems` (as templated: :func:`prompt_lengths`) over `limit` tokens."""
    lengths = prompt_lengths(task, problems, tokenizer)
    long = 0 if limit is None else sum(n > limit for n in lengths)
    return PromptFit(len(lengths), long, max(lengths, default=0), limit, policy)


CACHED_CODE = ("rollout/tasks.py", "rollout/prompt_fit.py", "rollout/engines/base.py", "core/prompt_encoder.py")
# the code whose source names cached prompt lengths (with the task class's own module), relative to distrl/


def prompt_lengths(task, problems: Sequence, tokenizer) -> list[int]:
    """(n,) tokens of each of `problems`' prompts as templated (:func:`prompt_ids`), read from distrl's cache
    directory where a run with the same inputs measured them.

    Only prompts through a chat template rendered by a :class:`distrl.core.prompt_encoder.PromptEncoder` are
    cached: that renderer is transformers' and its import (1-2 s, most of a driver's time before Ray starts) is
    what a repeated launch saves. The key is a digest of all the rendering reads: the task's class, system
    prompt, template and chat setting, every problem's question, the tokenizer's file, chat template and special
    tokens, the installed files of transformers, tokenizers and jinja2 and the source of the code that renders
    (`CACHED_CODE`); any change measures anew. A cache that cannot be read or written is left alone."""
    key = _cache_key(task, problems, tokenizer)
    path = None if key is None else cache_dir() / "prompt_lengths" / f"{key}.json"
    if path is not None and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, list) and len(cached) == len(problems):
                return cached
        except (OSError, ValueError):
            pass
    lengths = [len(prompt_ids(task, p, tokenizer)[1]) for p in problems]
    if path is not None:
        write_cache_file(path, json.dumps(lengths))
    return lengths


def _cache_key(task, problems: Sequence, tokenizer) -> str | None:
    """The digest naming `problems`' prompt lengths (:func:`prompt_lengths`), or None where nothing is cached."""
    from distrl.core.prompt_encoder import PromptEncoder

    if not isinstance(tokenizer, PromptEncoder) or tokenizer.digest is None or not tokenizer.chat_template:
        return None
    if getattr(task, "chat", "off") == "off":
        return None
    root = Path(__file__).resolve().parents[1]
    code = [root / f for f in CACHED_CODE] + [Path(sys.modules[type(task).__module__].__file__)]
    inputs = {"task": type(task).__qualname__, "system": getattr(task, "system_prompt", None),
              "template": getattr(task, "template", None), "chat": task.chat, "tokenizer": tokenizer.digest,
              "chat_template": tokenizer.chat_template, "special_tokens": tokenizer.special_tokens,
              "libraries": [installed(name) for name in ("transformers", "tokenizers", "jinja2")],
              "code": [hashlib.sha256(f.read_bytes()).hexdigest() for f in code]}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode())
    for problem in problems:
        digest.update(problem.question.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()[:40]


def load_tokenizer(model: str, tokenizer: str | None = None) -> tuple[Any, int | None]:
    """The tokenizer the engines use (`tokenizer`, else the model's) and the model's ``max_position_embeddings``
    (None when its config does not say), without loading any weights. Where the files allow, the tokenizer is a
    :class:`distrl.core.prompt_encoder.PromptEncoder` (all :func:`measure` calls; the driver then imports neither
    transformers' tokenizers nor torch); else transformers' ``AutoTokenizer``."""
    from distrl.core.prompt_encoder import PromptEncoder

    if model == "tiny":
        from distrl.core.tiny import TINY_ARCH, prompt_encoder

        model_max = TINY_ARCH["max_position_embeddings"]
        if tokenizer is None:
            return prompt_encoder(), model_max
    else:
        model_max = _max_position_embeddings(Path(model))
    source = tokenizer or model
    encoder = PromptEncoder.from_dir(source) if Path(source).is_dir() else None
    if encoder is not None:
        return encoder, model_max
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source), model_max


def _max_position_embeddings(model: Path) -> int | None:
    """``max_position_embeddings`` of a model directory's config.json (or its ``text_config``'s); else, for a hub
    id, transformers' ``AutoConfig``; None when unknown (e.g. a GGUF file: preflight checks the path)."""
    if model.is_dir():
        path = model / "config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        return config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(str(model)), "max_position_embeddings", None)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class PromptSource:
    """The prompts a preflight measures and the context they must fit: a run's (:meth:`of_run`, from an actor's
    sections) or `distrl eval`'s (its own options; it cannot skip a prompt: ``long_prompts`` None is ``error``)."""

    prompt: PromptOptions
    model: str
    tokenizer: str | None
    seed: int
    max_model_len: int | None
    max_new_tokens: int
    long_prompts: str | None = None
    split: str | None = None  # `distrl eval --split`
    limit: int | None = None  # `distrl eval --limit`: the first N rows only

    @classmethod
    def of_run(cls, prompt: PromptOptions, generation: TaskOptions, shared: SharedOptions) -> PromptSource:
        return cls(prompt, shared.model, shared.tokenizer, shared.seed, shared.max_model_len, shared.max_new_tokens,
                   generation.long_prompts)


def check_prompt_lengths(source: PromptSource, task=None, problems: Sequence | None = None) -> PromptFit:
    """Preflight: measure every prompt of the run's task as templated against ``--max_model_len -
    --max_new_tokens`` and apply ``--long_prompts`` (``error`` when ``source`` has none).

    Args:
        source: the prompt options, model, tokenizer, seed and lengths (:class:`PromptSource`).
        task: the task already loaded from ``source.prompt`` (None: loaded here).
        problems: the prompts to measure (None: every dataset row, the first ``source.limit`` when given
            (`distrl eval --limit`), or the first `BUILTIN_SAMPLE` problems of a built-in task).
    Raises:
        PreflightError: ``--max_new_tokens`` leaves no room for a prompt; any long prompt under
            ``error``; every prompt long under ``skip``.
    """
    tokenizer, model_max = load_tokenizer(source.model, source.tokenizer)
    prompt = source.prompt
    if task is None:
        from distrl.rollout.tasks import load_task

        task = load_task(prompt.task, prompt.dataset, seed=source.seed, split=source.split,
                         arith_ops=tuple(prompt.arith_ops), arith_max_operand=prompt.arith_max_operand)
        task.set_prompt(prompt.prompt_template, prompt.chat_template)
    if problems is None:
        rows = getattr(task, "rows", None)
        count = len(rows) if rows is not None else BUILTIN_SAMPLE
        count = min(count, source.limit or count)
        problems = (list(islice(task.problems(source.seed), count)) if rows is None
                    else [task.to_problem(rows[i], i) for i in range(count)])
    limit = prompt_limit(source.max_model_len, source.max_new_tokens, model_max)
    fit = measure(task, problems, tokenizer, limit, source.long_prompts or "error")
    refuse(fit, source.max_new_tokens, can_skip=source.long_prompts is not None)
    return fit


def refuse(fit: PromptFit, max_new_tokens: int, can_skip: bool = True) -> None:
    """Raise PreflightError when `fit` cannot run under its policy: no room for any prompt, a long prompt
    under ``error``, or every prompt long under ``skip``. The fix names the --max_model_len that fits all,
    and ``--long_prompts skip`` when some fit and the command has that flag (`can_skip`)."""
    limit = fit.limit
    if limit is None:
        return
    if limit < 1:
        raise PreflightError("--max_new_tokens", f"{max_new_tokens} leaves no room for a prompt under "
                             f"--max_model_len {limit + max_new_tokens}",
                             f"lower --max_new_tokens or raise --max_model_len to {fit.longest + max_new_tokens}")
    if fit.long and (fit.policy == "error" or (fit.policy == "skip" and fit.long == fit.total)):
        every = "all" if fit.long == fit.total else f"{fit.long} of the"
        verb = "is" if fit.long == 1 and fit.total > 1 else "are"
        raise PreflightError("--max_model_len", f"{every} {fit.total} prompts {verb} longer as templated (up to "
                             f"{fit.longest} tokens) than the {limit} that --max_new_tokens {max_new_tokens} "
                             f"leaves under {limit + max_new_tokens}",
                             _fix(fit.longest + max_new_tokens, can_skip and fit.long < fit.total))


def _fix(needed: int, skip_helps: bool = True) -> str:
    """The fix line of a long-prompt error: the --max_model_len that fits them all (and --long_prompts skip)."""
    return f"raise --max_model_len to {needed}" + (", or pass --long_prompts skip" if skip_helps else "")
