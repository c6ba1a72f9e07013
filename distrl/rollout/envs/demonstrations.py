"""Demonstrations of an environment's episodes: the supervised warm start's data with ``--env``.

``distrl train --env calculator --warm_start_steps N`` warm-starts the base model on whole correct episodes
instead of direct answers, so that it learns the call format before RL (``docs/environments.md``, "Warm start").
A demonstration is one episode's token ids as the episode loop (:mod:`distrl.rollout.envs.episodes`) would build
them, as segments ``(ids, model)``: the prompt (``model`` False), then each model turn (True) and each
observation (False) in turn, the last model turn followed by the stop token. The learner's warm start
(``distrl.learn.sft``) trains on the True segments only: observation tokens are inputs, never targets, as in
the RL loss (``loss_mask``).

Each part is made as the actor makes it: the prompt is ``tokenizer(prompt_text)`` (special tokens as the engines
add them), a model turn's text is tokenized on its own, and an observation goes through
:class:`distrl.rollout.envs.episodes.ObservationFormat` (the chat template's tool turn where the prompt used the
template, after a turn that ended at a stop string, not at the stop token). The observations are the
environment's own replies (its class, played in this process), and a demonstration is checked to end with
reward 1.

Built-in: ``calculator`` on ``arith`` problems (``a op b =``): ``<calc>a op b</calc>``, the value, then ``=`` and the
value as the answer. Other environments and tasks have none: :func:`demonstrations` raises ValueError naming the flags.
"""

from __future__ import annotations

from typing import Callable

from distrl.rollout.envs import BUILTIN, DEMONSTRATED
from distrl.rollout.envs.calculator import Calculator
from distrl.rollout.envs.episodes import ObservationFormat

Segments = list[tuple[list[int], bool]]  # (token ids, model's: trained on) in order


def calculator_turns(problem) -> list[str]:
    """The texts of a correct ``calculator`` episode of an ``arith`` problem: model turn, observation, model turn.

    ``37*45=`` -> ``["<calc>37*45</calc>", "1665", "=1665"]``: the answer turn starts with ``=``, so that a
    model that sees the transcript as one stream of characters (the tiny model: no chat template, observations
    appended as they are) can tell where the observation ends and its copy begins. Raises ValueError for a
    problem that is not an ``arith`` expression (no ``a``, ``b``, ``op`` in its meta) or whose episode would
    not score 1.
    """
    meta = problem.meta or {}
    if not {"a", "b", "op"} <= set(meta):
        raise ValueError(f"calculator demonstrations need arith problems (a op b =), got {problem.prompt_id!r}")
    call = f"<calc>{meta['a']}{meta['op']}{meta['b']}</calc>"
    env = Calculator()
    env.reset(problem)
    observation, _, done, _ = env.step(call)
    answer = f"={problem.gold}"
    _, reward, done, _ = env.step(answer)
    if observation is None or not done or reward != 1.0:
        raise ValueError(f"the calculator demonstration of {problem.prompt_id!r} does not score 1")
    return [call, observation, answer]


TURNS = {"calculator": calculator_turns}  # built-in --env -> its demonstration turns (the tasks: DEMONSTRATED)


def demonstrations(env: str, task_name: str) -> Callable[[object], list[str]]:
    """The turns function of ``--env`` for ``--task``: a built-in's (:data:`DEMONSTRATED`), or a user's
    environment class's ``demonstrate(problem) -> list[str]`` (model turn, observation, model turn, ...; it
    raises ValueError for a problem it cannot demonstrate). ValueError naming both flags when there is none."""
    if task_name in DEMONSTRATED.get(env, ()):
        return TURNS[env]
    if env not in BUILTIN:  # a user's module:Class or file.py:Class
        from distrl.rollout.envs.worker import load_env_class

        demonstrate = getattr(load_env_class(env), "demonstrate", None)
        if callable(demonstrate):
            return demonstrate
    raise ValueError(f"--warm_start_steps with --env {env} --task {task_name}: no demonstrations of that "
                     f"environment on that task (built in: --env calculator --task arith; a user's environment "
                     f"class may define demonstrate(problem)); drop --warm_start_steps or warm-start the model "
                     f"yourself")


def demonstration_ids(turns: list[str], prompt_text: str, tokenizer, chat: bool) -> Segments:
    """``turns`` (model turn, observation, model turn, ...; odd count) as token-id segments after the prompt.

    Returns ``[(prompt ids, False), (turn ids, True), (observation ids, False), ..., (last turn ids + [eos],
    True)]``. Every model turn but the last ends at a stop string (no stop token); the last ends with the
    tokenizer's EOS. Raises ValueError for an even number of turns or a tokenizer without EOS.
    """
    eos = tokenizer.eos_token_id
    if len(turns) % 2 == 0 or eos is None:
        raise ValueError("a demonstration is model turns around observations (an odd count), and needs an EOS")
    observations = ObservationFormat(tokenizer, chat)
    segments: Segments = [(tokenizer(prompt_text)["input_ids"], False)]
    for i, text in enumerate(turns):
        if i % 2 == 1:
            segments.append((observations.ids(text, None), False))
        else:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            segments.append((ids + [eos] if i == len(turns) - 1 else ids, True))
    return segments
