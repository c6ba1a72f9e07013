"""Pure selection rules of the buffer: top-k inside a group, the order across groups. No state.

- Top-k keeps the ``k`` completions of a group with the largest ``reward`` (or ``|advantage|``); ties go
  to the earlier completion; kept rows stay in their original order. It runs once, when a group arrives.
- The order across groups decides which fresh groups a version's batch takes first:

  ========== ============================================== ===========================
  order      first key (smaller first)                      tie-break (smaller first)
  ========== ============================================== ===========================
  fifo       arrival position                               —
  freshest   ``-policy_version``                            ``-arrival position``
  variance   ``-reward variance`` (population, over all n)  arrival position
  ========== ============================================== ===========================

  "Arrival position" is the group's place in the buffer's queue: its PUT order, except that a group
  handed out again under ``replay_ratio > 1`` goes to the back.

Everything is vectorized with numpy over the held groups, so a selection from a buffer of a million
completions costs well under a millisecond of Python.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa

ORDERS = ("fifo", "freshest", "variance")
TOPK_BY = ("reward", "abs_advantage")


def topk_indices(keys, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``keys`` (ties to the earlier index), in ascending index order.

    ``keys``: (n,) floats (a list or an array). Returns (min(k, n),) int64.
    """
    keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
    best = sorted(range(len(keys)), key=lambda i: (-keys[i], i))[:k]
    return np.array(sorted(best), dtype=np.int64)


def topk_rows(table: pa.Table, k: int, by: Literal["reward", "abs_advantage"] = "reward") -> pa.Table:
    """The k rows of ``table`` with the largest ``reward`` (or ``|advantage|``), in their original order.

    Ties go to the earlier row. Returns ``table`` itself when it keeps every row. Raises ValueError if
    ``by`` is unknown.
    """
    if by == "reward":
        keys = table.column("reward").to_pylist()
    elif by == "abs_advantage":
        keys = [abs(a) for a in table.column("advantage").to_pylist()]
    else:
        raise ValueError(f"topk_by must be 'reward' or 'abs_advantage', got {by!r}")
    if k >= table.num_rows:
        return table
    return table.take(topk_indices(keys, k))


def order_keys(order: str, arrival: np.ndarray, version: np.ndarray, variance: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(first key, tie-break) arrays of candidate groups for ``order`` (see the module table).

    ``arrival``, ``version``: (m,) int64; ``variance``: (m,) float64. Raises ValueError on an unknown order.
    """
    if order == "fifo":
        return arrival, arrival
    if order == "freshest":
        return -version, -arrival
    if order == "variance":
        return -variance, arrival
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


def first_k(primary: np.ndarray, secondary: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest ``(primary, secondary)`` pairs, in that order (exact, O(m)).

    ``primary``: (m,) numbers; ``secondary``: (m,) numbers, unique (the tie-break). Returns
    (min(k, m),) int64 positions into the arrays.
    """
    m = len(primary)
    if k < m:
        kth = np.partition(primary, k - 1)[k - 1]
        below = np.flatnonzero(primary < kth)
        ties = np.flatnonzero(primary == kth)
        need = k - below.size  # >= 1: at most k - 1 values are below the k-th smallest
        if need < ties.size:
            ties = ties[np.argpartition(secondary[ties], need - 1)[:need]]
        idx = np.concatenate([below, ties])
    else:
        idx = np.arange(m)
    return idx[np.lexsort((secondary[idx], primary[idx]))]


def reward_variance(rewards) -> float:
    """Population variance of a group's rewards (a list or an array; exactly 0.0 when all are equal)."""
    values = rewards.tolist() if isinstance(rewards, np.ndarray) else list(rewards)  # plain floats: fast at n ~ 16
    if min(values) == max(values):
        return 0.0
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)
