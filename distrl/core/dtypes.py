"""Torch dtype names as every role reads them (``--dtype``): one meaning for the engines and the learner."""

from __future__ import annotations

import torch


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on GPU; otherwise the torch dtype of that name (``bfloat16``).

    Raises AttributeError for a name torch does not have (the config validates ``--dtype`` before this).
    """
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)
