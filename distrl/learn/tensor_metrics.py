"""Loss metrics that stay on the device until the step ends: no host sync per micro-batch.

Reading a metric with ``.item()`` (or indexing with a boolean mask, which must learn its output size)
waits for the GPU to finish everything queued so far, so the next micro-batch's host work (collate,
pack, copy) runs while the GPU idles. The loss functions instead build their metrics as 0-dim tensors
with masked reductions (:func:`masked_stats`); the learner turns all micro-batches' metrics into
python floats with one transfer at the end of the step (:func:`to_floats`).
"""

from __future__ import annotations

import torch

TensorMetrics = dict[str, "torch.Tensor | float"]


def masked_stats(x: torch.Tensor, keep: torch.Tensor, count: torch.Tensor,
                 empty: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, max and min of ``x`` over the positions where ``keep`` is True, as 0-dim float32 tensors on
    ``x``'s device (no host sync); each is ``empty`` when nothing is kept.

    x: (...) float; keep: bool of x's shape; count: 0-dim, ``keep.sum()`` (passed in: callers share it).
    """
    x = x.float()
    some = count > 0
    fallback = torch.full((), empty, dtype=torch.float32, device=x.device)
    mean = torch.where(keep, x, 0.0).sum() / count.clamp(min=1)
    high = torch.where(keep, x, float("-inf")).amax()
    low = torch.where(keep, x, float("inf")).amin()
    return tuple(torch.where(some, v, fallback) for v in (mean, high, low))


def to_floats(parts: list[TensorMetrics]) -> list[dict[str, float]]:
    """The metric dicts with every tensor value replaced by its python float, in one device-to-host
    copy for all of them (floats and ints pass through). Raises ValueError on a tensor of more than
    one element."""
    slots = [(i, k) for i, p in enumerate(parts) for k, v in p.items() if isinstance(v, torch.Tensor)]
    out = [dict(p) for p in parts]
    if not slots:
        return out
    values = [parts[i][k] for i, k in slots]
    for (_, k), v in zip(slots, values):
        if v.numel() != 1:
            raise ValueError(f"metric {k!r} must be a scalar, got shape {tuple(v.shape)}")
    floats = torch.stack([v.detach().reshape(()).float().to(values[0].device) for v in values]).tolist()
    for (i, k), f in zip(slots, floats):
        out[i][k] = f
    return out
