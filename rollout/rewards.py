"""Rewards: final-answer checking, used by the tasks in `rollout.tasks` (answers read by `rollout.answers`).

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
:class:`MathVerifier` checks in a child process of its own (started on first use, JSON lines over
pipes, nothing pickled), which it kills and restarts when an answer takes longer than ``timeout_s``.
With ``timeout_s=None`` it checks in the calling thread, unbounded.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import numbers
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from rollout.answers import final_answer, integer_answer, last_boxed


@dataclasses.dataclass
class Problem:
    """One problem instance: ``prompt_id`` is stable across epochs and actors; ``gold`` is the final answer.

    Tasks (`rollout.tasks`) yield it; rewards, a user's ``--reward`` function included, read it.
    """

    prompt_id: str
    question: str
    gold: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def integer_match(completion_text: str, gold: str) -> tuple[float, dict[str, float]]:
    """1.0 when the completion's final integer (:func:`rollout.answers.integer_answer`: the last number of
    the last ``\\boxed{}``, else of the stated ``answer is X``, else of the completion; integral) equals
    `gold` (an integer literal), else 0.0. Components: ``correct``, ``format`` (a ``\\boxed{}`` was used)."""
    answer = integer_answer(completion_text)
    correct = answer is not None and answer == int(gold)
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
    gold is never matched. Gold and answer are both parsed as the content of a ``\\boxed{}``.
    """
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

    parse, _ = _math_verify()
    objects = [p for p in parse("\\boxed{" + answer + "}", parsing_timeout=None) if not isinstance(p, str)]
    if not objects:
        return "".join(answer.split())
    obj = objects[0]
    if isinstance(obj, sympy.Float):
        obj = sympy.nsimplify(obj, rational=True)
    return str(obj)


class _JsonWorker:
    """A child process that answers JSON lines (nothing pickled), started on first use.

    Args:
        code: ``python -c`` text of the child: it prints ``ready``, then one JSON line per line it reads
            (see :func:`_serve_lines`).
        what: the worker's name in error messages, e.g. ``math_verify worker``.
        start_hint: what to check when the child does not start.
    """

    START_TIMEOUT_S = 120.0

    def __init__(self, code: str, what: str, start_hint: str):
        self.code, self.what, self.start_hint = code, what, start_hint
        self._proc: subprocess.Popen | None = None

    def call(self, request, timeout_s: float):
        """Send ``request``, return the JSON reply; None if none came within ``timeout_s`` (child killed,
        the next call starts a new one). Raises RuntimeError if the child exits or does not start."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self._proc.stdin.write(json.dumps(request, default=str) + "\n")
        self._proc.stdin.flush()
        if not self._wait_readable(timeout_s):
            self.close()
            return None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            self.close()
            raise RuntimeError(f"{self.what} exited with code {code} (its stderr is above)")
        return json.loads(line)

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", self.code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        if not self._wait_readable(self.START_TIMEOUT_S) or self._proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"{self.what} did not start within {self.START_TIMEOUT_S:.0f} s ({self.start_hint})")

    def _wait_readable(self, timeout_s: float) -> bool:
        readable, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return bool(readable)

    def close(self) -> None:
        """Kill the child, if any (by our own Popen handle)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                stream.close()
            self._proc = None

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.close()


def _child_code(call: str) -> str:
    root = str(Path(__file__).resolve().parents[1])
    return f"import sys; sys.path.insert(0, {root!r}); import rollout.rewards as r; {call}"


class MathVerifier:
    """Scores a completion's final answer (:func:`rollout.answers.final_answer`) against a gold answer with
    math_verify.

    Args:
        timeout_s: seconds one check may take, or None. Set: checks run in a child process (first use
            starts it, in about 2 s), which is killed and restarted past the limit; the completion then
            scores 0 with component ``timeout`` 1. None: checks run in the calling thread, unbounded.

    Safe to call from any thread; concurrent calls are serialized. Pickles without its child process.
    """

    def __init__(self, timeout_s: float | None = 5.0):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self._worker = _JsonWorker(_child_code("r._serve()"), "math_verify worker",
                                   f"check that `{sys.executable} -c 'import math_verify'` works")
        self._lock = threading.Lock()

    def score(self, completion_text: str, gold: str) -> tuple[float, dict[str, float]]:
        """Reward 1.0 iff the answer is equivalent to `gold`. Components: ``correct``, ``format``
        (the answer was in a ``\\boxed{}``), ``gold_unparsable``, ``timeout``."""
        answer, boxed = final_answer(completion_text), last_boxed(completion_text) is not None
        if self.timeout_s is None:
            result = check_answer(gold, answer)
        else:
            with self._lock:
                result = self._worker.call([gold, answer], self.timeout_s)
        timed_out = result is None
        result = result or {"gold_ok": True, "correct": False}
        correct = float(result["gold_ok"] and result["correct"])
        return correct, {"correct": correct, "format": float(boxed), "gold_unparsable": float(not result["gold_ok"]),
                         "timeout": float(timed_out)}

    def normalize(self, completion_text: str) -> str | None:
        """The completion's final answer (:func:`rollout.answers.final_answer`) in canonical form
        (:func:`normalize_answer`), under the same time limit as :meth:`score`; None when there is none or
        it timed out."""
        answer = final_answer(completion_text)
        if answer is None or self.timeout_s is None:
            return normalize_answer(answer)
        with self._lock:
            reply = self._worker.call({"normalize": answer}, self.timeout_s)
        return None if reply is None else reply["answer"]

    def close(self) -> None:
        """Stop the child process, if any (a later score() starts a new one)."""
        with self._lock:
            self._worker.close()

    def __getstate__(self) -> dict:
        return {"timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["timeout_s"])


# ---- a user's reward function (--reward) ---------------------------------------------------------------

def load_reward_function(spec: str) -> Callable:
    """Import the --reward function: ``module:function`` or ``path/to/file.py:function``.

    Raises ValueError naming --reward when the module does not import (any error its import raises)
    or has no callable of that name.
    """
    from rollout.config import check_reward_spec

    module, func = check_reward_spec(spec)
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser().resolve()
            mod_spec = importlib.util.spec_from_file_location(f"distrl_reward_{path.stem}", path)
            mod = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, SyntaxError, or whatever the module raises on import
        raise ValueError(f"--reward {spec}: importing {module} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise ValueError(f"--reward {spec}: {module} has no function {func!r}")
    return fn


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
        timeout_s: seconds one call may take. Set: calls run in a child process (the problem travels as
            JSON: its ``meta`` must be JSON-serializable, other values become strings), which is killed
            and restarted past the limit; that completion scores 0 with the only component ``timeout``
            1. None: calls run in the calling thread, unbounded.

    ``__call__(completion_text, completion_ids, problem)`` returns ``(reward, components)`` like
    ``Task.reward``; it raises ValueError naming --reward when the function raises or returns a wrong
    type (:func:`reward_value`). :meth:`check` does one such call at start.
    """

    def __init__(self, spec: str, timeout_s: float | None = 10.0):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"--reward_timeout_s must be > 0 or None, got {timeout_s}")
        self.spec, self.timeout_s = spec, timeout_s
        self.fn = load_reward_function(spec)
        self._worker = _JsonWorker(_child_code(f"r._serve_user({spec!r})"), f"--reward {spec} worker",
                                   f"check that `{spec}` imports quickly")
        self._lock = threading.Lock()

    def __call__(self, completion_text: str, completion_ids: list[int], problem) -> tuple[float, dict[str, float]]:
        if self.timeout_s is None:
            return self._call_here(completion_text, problem)
        with self._lock:
            reply = self._worker.call({"text": completion_text, "problem": dataclasses.asdict(problem)},
                                      self.timeout_s)
        if reply is None:
            return 0.0, {"timeout": 1.0}
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["reward"], reply["components"]

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
        """Stop the child process, if any."""
        with self._lock:
            self._worker.close()


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


def _serve_lines(handle: Callable) -> None:
    """Child-process loop: JSON lines in, ``handle(request)`` as JSON lines out, after a ``ready`` line.

    Exits when stdin closes or the parent process is gone (checked every second).
    """
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    out.write("ready\n")
    for line in sys.stdin:
        out.write(json.dumps(handle(json.loads(line))) + "\n")


def _serve() -> None:
    """Child process of MathVerifier: ``[gold, answer]`` in, :func:`check_answer` out;
    ``{"normalize": answer}`` in, ``{"answer": normalize_answer(answer)}`` out."""
    import math_verify  # noqa: F401  (import before answering "ready": it takes most of the start time)

    def handle(request):
        if isinstance(request, dict):
            return {"answer": normalize_answer(request["normalize"])}
        return check_answer(*request)

    _serve_lines(handle)


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

    _serve_lines(handle)
