"""The child process an environment runs in: one episode at a time, JSON lines over pipes, nothing pickled.

Requests (one JSON object a line) and replies:

- ``{"op": "reset", "problem": {...}}`` -> ``{"observation": str | None, "stop": [str, ...]}`` (a new instance of
  the class plays the episode);
- ``{"op": "step", "text": str}`` -> ``{"observation": str | None, "reward": float, "done": bool, "info": {...}}``;
- an exception in the environment's code -> ``{"error": "<type>: <message>"}`` (the process goes on serving).

The parent (:mod:`distrl.rollout.envs.pool`) kills the process past its time limit; a crash ends its episode.
"""

from __future__ import annotations

import math
import traceback

from distrl.rollout.envs import BUILTIN


def load_env_class(spec: str):
    """The class of ``--env``: a built-in name, ``module:Class`` or ``path/to/file.py:Class``. Raises ValueError
    naming --env when it does not import or has no such class."""
    from distrl.rollout.rewards import import_user_callable

    module, _, name = BUILTIN.get(spec, spec).rpartition(":")
    return import_user_callable(module, name, f"--env {spec}", "class")


class Episode:
    """Answers one process's requests (:func:`serve`) with instances of ``cls``."""

    def __init__(self, cls):
        self.cls, self.env = cls, None

    def __call__(self, request: dict) -> dict:
        try:
            if request["op"] == "reset":
                from distrl.rollout.rewards import Problem

                self.env = self.cls()
                observation = self.env.reset(Problem(**request["problem"]))
                return {"observation": _text(observation), "stop": [str(s) for s in getattr(self.env, "stop", ())]}
            observation, reward, done, info = self.env.step(request["text"])
            return {"observation": _text(observation), "reward": _number(reward), "done": bool(done),
                    "info": {str(k): _number(v) for k, v in (info or {}).items() if isinstance(v, (int, float))}}
        except Exception as exc:  # the environment's own error: this episode ends, the process serves on
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return {"error": last}


def _text(observation) -> str | None:
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"an observation must be a str or None, got {type(observation).__name__}")
    return observation


def _number(value) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"a reward or info value must be finite, got {value}")
    return value


def serve(spec: str) -> None:
    """The child's loop (``python -c``): load ``spec``'s class, then answer requests until stdin closes."""
    from distrl.rollout.reward_workers import serve_lines

    serve_lines(Episode(load_env_class(spec)))
