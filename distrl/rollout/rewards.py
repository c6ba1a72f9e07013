"""Rewards: final-answer checking, used by the tasks in `distrl.rollout.tasks` (answers read by
`distrl.rollout.answers`).

Three scorers, each returning ``(reward, components)`` with ``reward`` in [0, 1]:

- :func:`integer_match` — exact match of one integer (the built-in ``arith`` task).
- :func:`half_vocab_fraction` — fraction of completion token ids that are even (``half_vocab``).
- :class:`MathVerifier` — mathematical equivalence of the completion's final answer and a gold answer
  with HuggingFace's `math_verify` (``gsm8k``, ``math500``).

Besides the task's own: :class:`UserReward` calls a user's ``--reward module:function`` (in a child
process with a timeout, like MathVerifier), and :func:`apply_truncation` applies ``--truncation`` to
completions that hit the length limit.

math_verify and threads. math_verify's own timeouts use ``signal.alarm`` (SIGALRM), which works only in
a process's main thread: with them on, ``parse``/``verify`` called from any other thread raise
ValueError. Rollout actors may score in a non-main thread, so every call here passes
``parse(..., parsing_timeout=None)`` and ``verify(..., timeout_seconds=None)``, which turns the
signal machinery off (and :func:`_math_verify` marks math_verify's once-per-process "Timeout is
disabled" warning as already shown: it says nothing new here). That alone leaves no bound on time:
sympy does not return on some short answers (``\\boxed{9^{9^{9^{9}}}}`` ran for over a minute), and
SIGALRM could not stop a long C-level big-integer power anyway. So by default (``timeout_s`` set)
:class:`MathVerifier` checks in child processes of its own (:class:`distrl.rollout.reward_workers.WorkerPool`:
started on first use, JSON lines over pipes, nothing pickled, ``workers`` of them checking a list of answers
in parallel), killing and restarting one when an answer takes longer than ``timeout_s``. With
``timeout_s=None`` it checks in the calling thread, unbounded.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

from distrl.rollout.answers import final_answer, integer_answer, last_boxed, normalize_text
from distrl.rollout.reward_workers import WorkerPool, child_code, serve_lines


@dataclasses.dataclass
class Problem:
    """One problem instance: ``prompt_id`` is stable across epochs and actors; ``gold`` is the final answer.

    Tasks (`distrl.rollout.tasks`) yield it; rewards, a user's ``--reward`` function included, read it.
    """

    prompt_id: str
    question: str
    gold: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def integer_match(completion_text: str, gold: str) -> tuple[float, dict[str, float]]:
    """1.0 when the completion's final integer (:func:`distrl.rollout.answers.integer_answer`: the last number of
    the last ``\\boxed{}``, else of the stated ``answer is X``, else of the completion; integral) equals
    `gold` (an integer literal, unicode signs and digits allowed: :func:`distrl.rollout.answers.normalize_text`),
    else 0.0. Components: ``correct``, ``format`` (a ``\\boxed{}`` was used)."""
    answer = integer_answer(completion_text)
    correct = answer is not None and answer == int(normalize_text(gold))
    return float(correct), {"correct": float(correct), "format": float(last_boxed(completion_text) is not None)}


def half_vocab_fraction(completion_ids: list[int]) -> tuple[float, dict[str, float]]:
    """Fraction of `completion_ids` with an even id (0.0 for an empty completion). Component ``in_half``."""
    fraction = sum(1 for i in completion_ids if i % 2 == 0) / len(completion_ids) if completion_ids else 0.0
    return fraction, {"in_half": fraction}


@functools.cache
def _math_verify():
    """math_verify's ``(parse, verify)``, its "Timeout is disabled ..." warning marked as shown.

    Every call here turns math_verify's timeouts off on purpose (see the module docstring), so the
    warning each process (actor, worker, evaluator) would log once is noise: its own flag
    ``TIMEOUT_WARNING_SHOWN`` (in ``math_verify.parser`` and ``math_verify.grader``) is set once here.
    """
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    return math_verify.parser.parse, math_verify.grader.verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    parse, _ = _math_verify()
    return parse("\\boxed{" + gold + "}", parsing_timeout=None)


def check_answer(gold: str, answer: str | None) -> dict[str, bool]:
    """Check `answer` against `gold` with math_verify in this thread (no timeout, any thread).

    Returns ``{"gold_ok", "correct"}``. ``gold_ok`` is False when math_verify finds no mathematical
    object in the gold (an empty parse or only its raw-string fallback, e.g. ``""`` or ``"#"``); such a
    gold is never matched. Gold and answer are both parsed as the content of a ``\\boxed{}``, after
    :func:`distrl.rollout.answers.normalize_text` (``"－２３"`` equals ``"-23"``).
    """
    gold, answer = normalize_text(gold), None if answer is None else normalize_text(answer)
    parse, verify = _math_verify()
    gold_parsed = _parse_gold(gold)
    if all(isinstance(g, str) for g in gold_parsed):
        return {"gold_ok": False, "correct": False}
    if answer is None:
        return {"gold_ok": True, "correct": False}
    pred = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    return {"gold_ok": True, "correct": bool(pred) and verify(gold_parsed, pred, timeout_seconds=None)}


def normalize_answer(answer: str | None) -> str | None:
    """A canonical string of `answer` (the content of a ``\\boxed{}``) for majority votes, in this thread.

    math_verify parses it as :func:`check_answer` does; the result is the string of the first parsed
    mathematical object (``"0.5"``, ``"1/2"`` and ``"\\frac{1}{2}"`` all give ``"1/2"``; floats become exact
    rationals, so ``"18.0"`` gives ``"18"``). An answer math_verify finds nothing mathematical in keeps
    its own text without spaces. None stays None.
    """
    if answer is None:
        return None
    import sympy

    answer = normalize_text(answer)
    parse, _ = _math_verify()
    objects = [p for p in parse("\\boxed{" + answer + "}", parsing_timeout=None) if not isinstance(p, str)]
    if not objects:
        return "".join(answer.split())
    obj = objects[0]
    if isinstance(obj, sympy.Float):
        obj = sympy.nsimplify(obj, rational=True)
    return str(obj)


class MathVerifier:
    """Scores a completion's final answer (:func:`distrl.rollout.answers.final_answer`) against a gold answer with
    math_verify.

    Args:
        timeout_s: seconds one check may take, or None. Set: checks run in child processes (first use
            starts them, in about 2 s), each killed and restarted past the limit; the completion then
            scores 0 with component ``timeout`` 1. None: checks run in the calling thread, unbounded.
        workers: child processes that check in parallel (:meth:`score_many`; 1 to ``--reward_workers``).

    Safe to call from any thread; concurrent calls are serialized. Pickles without its child processes.
    Raises ValueError for ``timeout_s`` <= 0 or ``workers`` < 1.
    """

    def __init__(self, timeout_s: float | None = 5.0, workers: int = 1):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.timeout_s, self.workers = timeout_s, workers
        self._pool = WorkerPool(child_code(__name__, "r._serve()"), "math_verify worker",
                                f"check that `{sys.executable} -c 'import math_verify'` works", workers)

    def score(self, completion_text: str, gold: str) -> tuple[float, dict[str, float]]:
        """Reward 1.0 iff the answer is equivalent to `gold`. Components: ``correct``, ``format``
        (the answer was in a ``\\boxed{}``), ``gold_unparsable``, ``timeout``."""
        return self.score_many([completion_text], [gold])[0]

    def score_many(self, texts: list[str], golds: list[str]) -> list[tuple[float, dict[str, float]]]:
        """:meth:`score` of each (text, gold) pair, the distinct (gold, answer) pairs checked in parallel."""
        answers = [final_answer(t) for t in texts]
        checks = list(dict.fromkeys(zip(golds, answers)))  # a group's completions often share their answer
        if self.timeout_s is None:
            results = [check_answer(gold, answer) for gold, answer in checks]
        else:
            results = self._pool.map([list(c) for c in checks], self.timeout_s)
        found = dict(zip(checks, results))
        out = []
        for text, key in zip(texts, zip(golds, answers)):
            result, boxed = found[key], last_boxed(text) is not None
            ok = result or {"gold_ok": True, "correct": False}
            correct = float(ok["gold_ok"] and ok["correct"])
            out.append((correct, {"correct": correct, "format": float(boxed),
                                  "gold_unparsable": float(not ok["gold_ok"]), "timeout": float(result is None)}))
        return out

    def normalize(self, completion_text: str) -> str | None:
        """The completion's final answer (:func:`distrl.rollout.answers.final_answer`) in canonical form
        (:func:`normalize_answer`), under the same time limit as :meth:`score`; None when there is none or
        it timed out."""
        answer = final_answer(completion_text)
        if answer is None or self.timeout_s is None:
            return normalize_answer(answer)
        reply = self._pool.map([{"normalize": answer}], self.timeout_s)[0]
        return None if reply is None else reply["answer"]

    def close(self) -> None:
        """Stop the child processes, if any (a later score() starts new ones)."""
        self._pool.close()

    def __getstate__(self) -> dict:
        return {"timeout_s": self.timeout_s, "workers": self.workers}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["timeout_s"], state.get("workers", 1))


# ---- a user's reward function (--reward) ---------------------------------------------------------------

def load_reward_function(spec: str) -> Callable:
    """Import the --reward function: ``module:function`` or ``path/to/file.py:function``.

    Raises ValueError naming --reward when the module does not import (any error its import raises)
    or has no callable of that name.
    """
    from distrl.rollout.config import check_reward_spec

    module, func = check_reward_spec(spec)
    return import_user_callable(module, func, f"--reward {spec}", "function")


def import_user_callable(module: str, name: str, flag: str, kind: str) -> Callable:
    """``name`` of ``module`` (a dotted module name, or ``path/to/file.py`` loaded under a name of its own): a
    user's --reward function or --env class. Raises ValueError starting with ``flag`` when the module does not
    import (any error its import raises) or has no callable of that name (``kind``: what the message calls it)."""
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser().resolve()
            mod_spec = importlib.util.spec_from_file_location(f"distrl_user_{path.stem}", path)
            mod = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, SyntaxError, or whatever the module raises on import
        raise ValueError(f"{flag}: importing {module} failed: {type(exc).__name__}: {exc}") from exc
    found = getattr(mod, name, None)
    if not callable(found):
        raise ValueError(f"{flag}: {module} has no {kind} {name!r}")
    return found


def reward_value(value, spec: str) -> tuple[float, dict[str, float]]:
    """Check and normalize what a --reward function returned: a finite real number, or ``(number,
    {name: number})``. Returns ``(reward, components)``; raises ValueError naming --reward otherwise."""
    components: dict = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, components = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"--reward {spec} must return a finite float or (float, dict[str, float]), "
                         f"got {value!r} ({type(value).__name__})")
    bad = {k: v for k, v in components.items()
           if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, numbers.Real)}
    if bad:
        raise ValueError(f"--reward {spec}: components must map str to float, got {bad!r}")
    return float(value), {k: float(v) for k, v in components.items()}


class UserReward:
    """The --reward function, called as ``fn(completion_text, problem)`` in place of the task's reward.

    Args:
        spec: ``module:function`` or ``path/to/file.py:function`` (imported here at once, so a wrong
            spec raises ValueError naming --reward before anything runs).
        timeout_s: seconds one call may take. Set: calls run in child processes (the problem travels as
            JSON: its ``meta`` must be JSON-serializable, other values become strings), each killed
            and restarted past the limit; that completion scores 0 with the only component ``timeout``
            1. None: calls run in the calling thread, unbounded.
        workers: child processes that call it in parallel (:meth:`score_many`; ``--reward_workers``).

    ``__call__(completion_text, completion_ids, problem)`` returns ``(reward, components)`` like
    ``Task.reward``; it raises ValueError naming --reward when the function raises or returns a wrong
    type (:func:`reward_value`). :meth:`check` does one such call at start.
    """

    def __init__(self, spec: str, timeout_s: float | None = 10.0, workers: int = 1):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"--reward_timeout_s must be > 0 or None, got {timeout_s}")
        self.spec, self.timeout_s = spec, timeout_s
        self.fn = load_reward_function(spec)
        self._pool = WorkerPool(child_code(__name__, f"r._serve_user({spec!r})"), f"--reward {spec} worker",
                                f"check that `{spec}` imports quickly", workers)

    def __call__(self, completion_text: str, completion_ids: list[int], problem) -> tuple[float, dict[str, float]]:
        return self.score_many([(completion_text, completion_ids, problem)])[0]

    def score_many(self, items: list[tuple[str, list[int], Any]]) -> list[tuple[float, dict[str, float]]]:
        """``(reward, components)`` of each ``(completion_text, completion_ids, problem)``, in parallel."""
        if self.timeout_s is None:
            return [self._call_here(text, problem) for text, _, problem in items]
        replies = self._pool.map([{"text": text, "problem": dataclasses.asdict(problem)} for text, _, problem in items],
                                 self.timeout_s)
        out = []
        for reply in replies:
            if reply is None:
                out.append((0.0, {"timeout": 1.0}))
            elif "error" in reply:
                raise ValueError(reply["error"])
            else:
                out.append((reply["reward"], reply["components"]))
        return out

    def _call_here(self, completion_text: str, problem) -> tuple[float, dict[str, float]]:
        try:
            value = self.fn(completion_text, problem)
        except Exception as exc:
            raise ValueError(f"--reward {self.spec} raised {type(exc).__name__}: {exc}") from exc
        return reward_value(value, self.spec)

    def check(self, problem) -> None:
        """Call the function once on ``problem`` with an empty completion; raise ValueError naming
        --reward if it raises, returns a wrong type, or times out."""
        _, components = self("", [], problem)
        if components == {"timeout": 1.0} and self.timeout_s is not None:
            raise ValueError(f"--reward {self.spec}: the first call took longer than --reward_timeout_s "
                             f"{self.timeout_s}")

    def close(self) -> None:
        """Stop the child processes, if any."""
        self._pool.close()


def timed_out(scored: list[tuple[float, dict[str, float]]]) -> int:
    """How many ``(reward, components)`` of `scored` timed out: component ``timeout`` 1, which :class:`MathVerifier`
    and :class:`UserReward` set on a completion whose check or call ran past its time limit (it scored 0)."""
    return sum(1 for _, components in scored if components.get("timeout") == 1.0)


# ---- truncated completions (--truncation) ----------------------------------------------------------------

def apply_truncation(reward: float, components: dict[str, float], finish_reason: str,
                     policy: str) -> tuple[float, dict[str, float]]:
    """The reward of one completion under --truncation ``policy`` (keep | zero | mask).

    A completion is truncated when ``finish_reason == "length"`` (it hit --max_new_tokens, or the
    engine's max_model_len, without an end of sequence). Returns ``(reward, components)`` with the
    component ``truncated`` (0/1) added; ``zero`` sets a truncated completion's reward to 0 and keeps
    the scored one as component ``scored``. ``keep`` and ``mask`` leave the reward as scored (``mask``
    acts at the learner: their tokens get no loss). Raises ValueError on another policy.
    """
    if policy not in ("keep", "zero", "mask"):
        raise ValueError(f"--truncation must be keep, zero or mask, got {policy!r}")
    truncated = finish_reason == "length"
    components = {**components, "truncated": float(truncated)}
    if truncated and policy == "zero":
        return 0.0, {**components, "scored": float(reward)}
    return reward, components


def _serve() -> None:
    """Child process of MathVerifier: ``[gold, answer]`` in, :func:`check_answer` out;
    ``{"normalize": answer}`` in, ``{"answer": normalize_answer(answer)}`` out."""
    import math_verify  # noqa: F401  (import before answering "ready": it takes most of the start time)

    def handle(request):
        if isinstance(request, dict):
            return {"answer": normalize_answer(request["normalize"])}
        return check_answer(*request)

    serve_lines(handle)


def _serve_user(spec: str) -> None:
    """Child process of UserReward: ``{text, problem}`` in, ``{reward, components}`` or ``{error}`` out."""
    fn = load_reward_function(spec)

    def handle(request: dict) -> dict:
        try:  # errors go back to the actor, which raises them
            value = fn(request["text"], Problem(**request["problem"]))
        except Exception as exc:
            return {"error": f"--reward {spec} raised {type(exc).__name__}: {exc}"}
        try:
            reward, components = reward_value(value, spec)
        except ValueError as exc:
            return {"error": str(exc)}
        return {"reward": reward, "components": components}

    serve_lines(handle)
