"""`distrl train --warm_start_steps N`: a supervised warm start before any role runs (``distrl.learn.sft.warm_start``).

The command builds the task as the actors build it and hands it to the learner package's SFT loop, so
``distrl/learn/`` never imports ``distrl/rollout/``.
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
    warm start's problems too, so held-out accuracy measures generalization. Logs the loss of the first
    and last step.
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
                        tokenizer=cfg.tokenizer, dtype=cfg.dtype, until_accuracy=cfg.warm_start_until_accuracy)
    log.info("warm start: %d steps in %.1f s, loss %.3f -> %.3f, exact match %.3f, saved to %s", result.steps,
             result.wall_s, result.first_loss, result.last_loss, result.exact_match, result.model_dir)
    return str(result.model_dir)
