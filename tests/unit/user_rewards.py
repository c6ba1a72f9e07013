"""Reward functions for --reward tests (loaded by path, as a user's file would be)."""

import time


def digits(completion_text, problem):
    """Share of the completion's characters that are digits, and whether the gold answer appears."""
    share = sum(ch.isdigit() for ch in completion_text) / max(len(completion_text), 1)
    return share, {"digits": share, "has_gold": float(problem.gold in completion_text)}


def constant(completion_text, problem):
    return 0.5


def wrong_type(completion_text, problem):
    return "high"


def raises(completion_text, problem):
    raise KeyError("no such field")


def slow(completion_text, problem):
    time.sleep(60 if completion_text == "slow" else 0)
    return 1.0


def sleepy(completion_text, problem):
    """Sleeps the seconds the completion names ("0.5") and returns them, with its process id and when it slept
    (shows calls running side by side)."""
    start = time.time()
    time.sleep(float(completion_text))
    return float(completion_text), {"pid": float(__import__("os").getpid()), "start": start, "end": time.time()}


def dies(completion_text, problem):
    """Ends its process on "die"; otherwise sleeps 0.3 s (other calls still run when one dies) and returns the
    completion's length."""
    if completion_text == "die":
        __import__("os")._exit(3)
    time.sleep(0.3)
    return float(len(completion_text))


def stalls(completion_text, problem):
    """Sleeps a minute on any completion but an empty one (the actor's start-up check calls it with ""): every
    non-empty completion runs past --reward_timeout_s and scores 0."""
    time.sleep(60 if completion_text else 0)
    return 1.0
