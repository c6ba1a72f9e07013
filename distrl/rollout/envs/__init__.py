"""Environments for multi-turn episodes (``--env``): the interface, the built-ins, and where they run.

An environment plays one episode at a time: ``reset(problem)`` returns the first observation (text appended to
the prompt, or None/"" for none), then each model turn's text goes to ``step(model_text)``, which returns
``(observation | None, reward, done, info)``: a text observation continues the episode (its tokens are appended
after the model's, out of the loss), ``done`` or a None observation ends it, and the last step's ``reward`` is the
episode's reward. ``stop`` (optional): strings that end a model turn (the turn's tokens are cut after the first
one, e.g. ``</calc>``), besides the model's stop token and ``--max_new_tokens``.

- :mod:`.calculator`: the built-in ``calculator`` (``<calc>EXPR</calc>`` -> the value, evaluated over an
  ``ast`` of numbers and + - * / // % ** and parentheses only; never ``eval``).
- :mod:`.python_env`: the built-in ``python`` (a ```` ```python ```` block -> its output, run by :mod:`.sandbox`:
  namespaces + Landlock + an unprivileged uid + rlimits; refused where that does not work).
- :mod:`.worker`: the child process an environment runs in (JSON lines over pipes, nothing pickled).
- :mod:`.pool`: the actor's side: one such process per live episode, a time limit per call; a crash or a
  timeout ends only that episode.
- :mod:`.episodes`: the episode loop over the engine (token in, token out) and the observation's format.
- :mod:`.demonstrations`: correct episodes as token-id segments, the warm start's data with ``--env``
  (:data:`DEMONSTRATED`: which environments and tasks have them).
"""

from __future__ import annotations

from typing import Any

BUILTIN = {"calculator": "distrl.rollout.envs.calculator:Calculator",  # --env name -> module:Class
           "python": "distrl.rollout.envs.python_env:PythonEnv"}
DEMONSTRATED = {"calculator": ("arith",)}  # --env -> the --task values it has warm-start demonstrations for


class Environment:
    """What a ``--env`` class provides (subclassing it is optional: the methods are looked up by name).

    One instance plays one episode at a time; a new episode calls :meth:`reset` again. ``problem`` is a
    :class:`distrl.rollout.rewards.Problem` (``prompt_id``, ``question``, ``gold``, ``meta``).
    """

    stop: tuple[str, ...] = ()  # strings that end a model turn (cut after the first), besides the stop token

    def reset(self, problem) -> str | None:
        """Start an episode of ``problem``; the first observation (appended to the prompt), or None."""
        return None

    def step(self, model_text: str) -> tuple[str | None, float, bool, dict[str, Any]]:
        """The model's turn ``model_text`` -> (observation or None, reward, done, info)."""
        raise NotImplementedError

    # Optional, for --warm_start_steps: a static ``demonstrate(problem) -> list[str]``, the texts of a correct
    # episode (model turn, observation, model turn, ...), run in the driver (distrl.rollout.envs.demonstrations).
