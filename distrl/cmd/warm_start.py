"""`distrl train --warm_start_steps N`: a supervised warm start before any role runs (``distrl.learn.sft.warm_start``).

The command builds the task as the actors build it and hands it to the learner package's SFT loop, so
``distrl/learn/`` never imports ``distrl/rollout/``; with ``--env`` it also hands over the environment's
demonstrations (``distrl.rollout.envs.demonstrations``: whole episodes, loss on the model's turns only).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from distrl.learn.sft import warm_start
from distrl.rollout.tasks import load_task

log = logging.getLogger("distrl.sft")


def warm_start_run(cfg, run_dir: str | Path, model_dir: str) -> str:
    """`distrl train --warm_start_steps N`: warm-start `model_dir` into `<run_dir>/warm_start/`; returns it.

    The task is built as the actors build it (``--task``, ``--dataset``, ``--arith_*``); with
    ``--eval_every`` its held-out problems (``Task.heldout(--eval_size, --seed)``) are left out of the
    warm start's problems too, so held-out accuracy measures generalization. With ``--env`` it trains on the
    environment's demonstrated episodes (:func:`episode_transcript`). Logs the loss of the first and last step.
    Raises ValueError naming the flags for an environment and task without demonstrations.
    """
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    task = load_task(cfg.task, cfg.dataset, seed=cfg.seed, arith_ops=cfg.arith_ops,
                     arith_max_operand=cfg.arith_max_operand)
    task.set_prompt(cfg.prompt_template, cfg.chat_template)
    if cfg.eval_every:
        task.heldout(cfg.eval_size, cfg.seed)
    result = warm_start(model_dir, Path(run_dir) / "warm_start", task, steps=cfg.warm_start_steps,
                        learning_rate=cfg.warm_start_lr, batch_size=cfg.warm_start_batch_size, seed=cfg.seed,
                        tokenizer=cfg.tokenizer, dtype=cfg.dtype, until_accuracy=cfg.warm_start_until_accuracy,
                        transcript=episode_transcript(cfg.env, task) if cfg.env else None)
    log.info("warm start: %d steps in %.1f s, loss %.3f -> %.3f, exact match %.3f, saved to %s", result.steps,
             result.wall_s, result.first_loss, result.last_loss, result.exact_match, result.model_dir)
    return str(result.model_dir)


def episode_transcript(env: str, task):
    """``(problem, tokenizer) -> segments`` of ``--env``'s demonstrated episode of a problem of ``task`` (its
    prompt; the model's turns trained, the observations not), for :func:`distrl.learn.sft.warm_start`; the
    observations formatted as the actors format them (through the chat template where the prompts use one).
    Raises ValueError naming --env and --task when there are no demonstrations for them."""
    from distrl.rollout.envs.demonstrations import demonstration_ids, demonstrations

    turns = demonstrations(env, task.name)

    def transcript(problem, tokenizer):
        chat = task.chat != "off" and bool(getattr(tokenizer, "chat_template", None))
        return demonstration_ids(turns(problem), task.prompt(problem, tokenizer), tokenizer, chat)

    return transcript
