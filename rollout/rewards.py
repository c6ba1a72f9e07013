"""Rewards: final-answer extraction and checking, used by the tasks in `rollout.tasks`.

Three scorers, each returning ``(reward, components)`` with ``reward`` in [0, 1]:

- :func:`integer_match` — exact match of one integer (the built-in ``arith`` task).
- :func:`half_vocab_fraction` — fraction of completion token ids that are even (``half_vocab``).
- :class:`MathVerifier` — mathematical equivalence of the completion's final answer and a gold answer
  with HuggingFace's `math_verify` (``gsm8k``, ``math500``).

math_verify and threads. math_verify's own timeouts use ``signal.alarm`` (SIGALRM), which works only in
a process's main thread: with them on, ``parse``/``verify`` called from any other thread raise
ValueError. Rollout actors may score in a non-main thread, so every call here passes
``parse(..., parsing_timeout=None)`` and ``verify(..., timeout_seconds=None)``, which turns the
signal machinery off. That alone leaves no bound on time: sympy does not return on some short
answers (``\\boxed{9^{9^{9^{9}}}}`` ran for over a minute), and SIGALRM could not stop a long C-level
big-integer power anyway. So by default (``timeout_s`` set) :class:`MathVerifier` checks in a child
process of its own (started on first use, JSON lines over pipes, nothing pickled), which it kills
and restarts when an answer takes longer than ``timeout_s``. With ``timeout_s=None`` it checks in the
calling thread, unbounded.
"""

from __future__ import annotations

import functools
import json
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# 1,234,567.5 | 1234.5 | .5, each with an optional sign.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_INTEGER = re.compile(r"-?\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces matched; else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def last_number(text: str) -> str | None:
    """The last decimal number in `text`, thousands separators removed (``"1,234.5"`` -> ``"1234.5"``)."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_answer(text: str) -> tuple[str | None, bool]:
    """The completion's final answer: the last ``\\boxed{}`` content if any, else the last number.

    Returns ``(answer or None, whether it came from a \\boxed{})``.
    """
    boxed = last_boxed(text)
    return (boxed, True) if boxed is not None else (last_number(text), False)


def integer_match(completion_text: str, gold: str) -> tuple[float, dict[str, float]]:
    """1.0 when the answer integer equals `gold` (an integer literal), else 0.0.

    The answer integer is the first integer inside the last ``\\boxed{}`` when there is one (chat
    models restate the question first), else the first integer of the completion (the tiny model
    answers ``"37+45="`` with ``"82"``). Components: ``correct``, ``format`` (a ``\\boxed{}`` was used).
    """
    boxed = last_boxed(completion_text)
    found = _INTEGER.search(completion_text if boxed is None else boxed)
    correct = found is not None and int(found.group()) == int(gold)
    return float(correct), {"correct": float(correct), "format": float(boxed is not None)}


def half_vocab_fraction(completion_ids: list[int]) -> tuple[float, dict[str, float]]:
    """Fraction of `completion_ids` with an even id (0.0 for an empty completion). Component ``in_half``."""
    fraction = sum(1 for i in completion_ids if i % 2 == 0) / len(completion_ids) if completion_ids else 0.0
    return fraction, {"in_half": fraction}


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    from math_verify import parse

    return parse("\\boxed{" + gold + "}", parsing_timeout=None)


def check_answer(gold: str, answer: str | None) -> dict[str, bool]:
    """Check `answer` against `gold` with math_verify in this thread (no timeout, any thread).

    Returns ``{"gold_ok", "correct"}``. ``gold_ok`` is False when math_verify finds no mathematical
    object in the gold (an empty parse or only its raw-string fallback, e.g. ``""`` or ``"#"``); such a
    gold is never matched. Gold and answer are both parsed as the content of a ``\\boxed{}``.
    """
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold)
    if all(isinstance(g, str) for g in gold_parsed):
        return {"gold_ok": False, "correct": False}
    if answer is None:
        return {"gold_ok": True, "correct": False}
    pred = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    return {"gold_ok": True, "correct": bool(pred) and verify(gold_parsed, pred, timeout_seconds=None)}


class MathVerifier:
    """Scores a completion's final answer (:func:`extract_answer`) against a gold answer with math_verify.

    Args:
        timeout_s: seconds one check may take, or None. Set: checks run in a child process (first use
            starts it, in about 2 s), which is killed and restarted past the limit; the completion then
            scores 0 with component ``timeout`` 1. None: checks run in the calling thread, unbounded.

    Safe to call from any thread; concurrent calls are serialized. Pickles without its child process.
    """

    START_TIMEOUT_S = 120.0

    def __init__(self, timeout_s: float | None = 5.0):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def score(self, completion_text: str, gold: str) -> tuple[float, dict[str, float]]:
        """Reward 1.0 iff the answer is equivalent to `gold`. Components: ``correct``, ``format``
        (the answer was in a ``\\boxed{}``), ``gold_unparsable``, ``timeout``."""
        answer, boxed = extract_answer(completion_text)
        result = check_answer(gold, answer) if self.timeout_s is None else self._check_in_child(gold, answer)
        timed_out = result is None
        result = result or {"gold_ok": True, "correct": False}
        correct = float(result["gold_ok"] and result["correct"])
        return correct, {"correct": correct, "format": float(boxed), "gold_unparsable": float(not result["gold_ok"]),
                         "timeout": float(timed_out)}

    def _check_in_child(self, gold: str, answer: str | None) -> dict[str, bool] | None:
        """check_answer in the child process; None if it took longer than timeout_s (child killed)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._proc.stdin.write(json.dumps([gold, answer]) + "\n")
            self._proc.stdin.flush()
            if not self._wait_readable(self.timeout_s):
                self._kill()
                return None
            line = self._proc.stdout.readline()
            if not line:
                code = self._proc.wait()
                self._kill()
                raise RuntimeError(f"math_verify worker exited with code {code} (its stderr is above)")
            return json.loads(line)

    def _start(self) -> None:
        root = str(Path(__file__).resolve().parents[1])
        code = f"import sys; sys.path.insert(0, {root!r}); from rollout.rewards import _serve; _serve()"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, bufsize=1)
        if not self._wait_readable(self.START_TIMEOUT_S) or self._proc.stdout.readline().strip() != "ready":
            self._kill()
            raise RuntimeError(f"math_verify worker did not start within {self.START_TIMEOUT_S:.0f} s "
                               f"(check that `{sys.executable} -c 'import math_verify'` works)")

    def _wait_readable(self, timeout_s: float) -> bool:
        readable, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return bool(readable)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()  # by our own Popen handle
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                stream.close()
            self._proc = None

    def close(self) -> None:
        """Stop the child process, if any (a later score() starts a new one)."""
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self._kill()

    def __getstate__(self) -> dict:
        return {"timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["timeout_s"])


def _serve() -> None:
    """Child-process loop of MathVerifier: JSON ``[gold, answer]`` lines in, ``check_answer`` JSON lines out.

    Exits when stdin closes or the parent process is gone (checked every second).
    """
    import math_verify  # noqa: F401  (import before answering "ready": it takes most of the start time)

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
        gold, answer = json.loads(line)
        out.write(json.dumps(check_answer(gold, answer)) + "\n")
