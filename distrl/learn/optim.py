"""Optimizer and learning-rate schedule of the learner, both stepped once per policy version.

The learning rate is a function of the version being trained, ``s = 0 .. max_steps - 1`` (so a run
that skips an optimizer step, see ``distrl.learn.learner``, keeps the same schedule, and a resumed run
continues it from the scheduler's state):

- warm-up, ``s < warmup``: ``lr * (s + 1) / warmup`` (linear, reaching ``lr`` at ``s = warmup - 1``);
- then, with ``p = (s - warmup) / max(1, max_steps - warmup)`` in [0, 1):
  ``constant``: ``lr``; ``linear``: ``lr * (1 - p)``; ``cosine``: ``lr * (1 + cos(pi p)) / 2``.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base learning rate at version ``step`` (0-based). Raises ValueError on a bad schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    return 1.0


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, warmup: int, total: int, schedule: str,
                    weight_decay: float = 0.0):
    """AdamW over ``params`` and a LambdaLR applying :func:`lr_factor`; returns ``(optimizer, scheduler)``.

    Call ``scheduler.step()`` once per policy version, after the optimizer step (or the skipped one).
    Parameters all on CUDA get PyTorch's fused AdamW (one kernel for the whole update; same math).
    """
    params = list(params)
    fused = True if params and all(p.is_cuda for p in params) else None
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, total, schedule))
    return optimizer, scheduler
