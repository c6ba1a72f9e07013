"""``--bias_correction reweight``: weight trained groups toward the mix of groups the actors generated.

The buffer trains on the groups that finish in time, so the trained distribution of (length, difficulty)
drifts from the generated one (:mod:`distrl.buffer.bias`). This is covariate shift, and the correction is
importance weighting for covariate shift (Shimodaira 2000, "Improving predictive inference under covariate
shift by weighting the log-likelihood function", J. Stat. Plan. Inference 90(2)): each trained example is
weighted by the density ratio ``p_target(x) / p_train(x)``, here estimated by histograms over the cells
(length bucket, difficulty bucket) of :mod:`distrl.buffer.bias`:

    w_raw(cell) = clip( (generated[cell] / sum(generated)) / (trained[cell] / sum(trained)),  0.2, 5 )
    w(group)    = w_raw(cell of the group) / mean over the version's batch rows of w_raw

``generated`` and ``trained`` are the buffer's running counts (every group accepted, every group handed
out, over the run so far; sent with each BATCH). The buffer's counts are the right ones: the learner alone
never sees the groups evicted or never trained, so its own histogram would be the trained one. Clipping to
[``CLIP_LOW``, ``CLIP_HIGH``] bounds the variance a rare cell adds (a cell trained once but generated often
would dominate the batch); normalising to mean 1 keeps the loss scale, so the learning rate means the same.

Where the weight enters: each completion row's advantage is multiplied by its group's weight before the loss
(:meth:`distrl.learn.learner.Learner.prepare`). For every policy loss of :mod:`distrl.learn.losses` the
per-token policy term is ``-min(r A, clip(r) A)`` or ``-r A``: with ``w > 0``, ``w`` times the advantage is
``w`` times the term, so this is the weighted loss. The KL and entropy terms are not weighted.
A group the buffer did not name (an older buffer, a group cut by the weight attestation) gets weight 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CLIP_LOW, CLIP_HIGH = 0.2, 5.0
BIAS_CORRECTIONS = ("none", "reweight")


def cell_weights(generated: Sequence[int], trained: Sequence[int], low: float = CLIP_LOW,
                 high: float = CLIP_HIGH) -> np.ndarray:
    """(cells,) float64: ``clip(generated share / trained share, low, high)``; 1.0 for a cell never trained
    (no row can be in it) and for all cells when either histogram is empty. Raises ValueError when the two
    histograms differ in length."""
    g, t = np.asarray(generated, np.float64), np.asarray(trained, np.float64)
    if g.shape != t.shape:
        raise ValueError(f"generated and trained histograms differ in length: {g.shape} vs {t.shape}")
    out = np.ones(len(g))
    if g.sum() <= 0 or t.sum() <= 0:
        return out
    seen = t > 0
    out[seen] = np.clip((g[seen] / g.sum()) / (t[seen] / t.sum()), low, high)
    return out


def row_weights(group_ids: Sequence[str], generated: Sequence[int], trained: Sequence[int],
                group_cells: dict[str, int]) -> np.ndarray:
    """(b,) float64 raw (un-normalised) weights of b completion rows named by their ``group_id``: their cell's
    :func:`cell_weights`; 1.0 for a group not in ``group_cells``."""
    w = cell_weights(generated, trained)
    cell = np.array([group_cells.get(g, -1) for g in group_ids], np.int64)
    return np.where(cell >= 0, w[np.clip(cell, 0, len(w) - 1)], 1.0)


def normalise(weights: np.ndarray, total: float, count: int) -> np.ndarray:
    """``weights * count / total``: mean 1 over a batch whose weights sum to ``total`` over ``count`` rows
    (all learners' shards: the sums are all-reduced). Unchanged when ``total`` <= 0."""
    return weights * (count / total) if total > 0 else weights
