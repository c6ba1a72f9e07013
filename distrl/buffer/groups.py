"""The in-memory form of the buffer's groups: record batches with their top-k rows, in numpy-indexed slots.

Groups stay in the record batch they arrived in (zero-copy over the received message; a PUT may
carry several groups, each then a slice of it). Everything else about a held group lives in numpy
columns of :class:`Slots` (seq, arrival, staleness version, reward variance, uses, its first row in
that batch, its bytes, its top-k rows): eligibility, eviction and ordering are vectorized over all
held groups, and a PUT's groups are admitted with one assignment per column (no Python object per
group). :func:`cut` makes a batch's rows with one concatenation (of runs of neighbouring groups from
the same message) and, under top-k (k < n), one take, whatever the number of groups.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa

from distrl.core.rows import COMPLETION_SCHEMA

_COL = {name: i for i, name in enumerate(COMPLETION_SCHEMA.names)}


class Parsed(NamedTuple):
    """What :func:`parse_groups` reads from m groups of n rows."""

    group_ids: list[str]  # (m,)
    versions: np.ndarray  # (m,) int64 policy versions
    sample_ids: list[str]  # (m * n,)
    keep: np.ndarray  # (m, k) int64 top-k row indices within each group, ascending
    variance: np.ndarray  # (m,) float64 population variance of the rewards; exactly 0.0 when all equal
    actors: np.ndarray  # (m,) int32 actor id of each group (its first row's)


def rows_of(batch: pa.RecordBatch, groups: list[int], n: int) -> pa.RecordBatch:
    """The rows of the given groups (indices of runs of n rows) of ``batch``."""
    return batch.take(pa.array((np.asarray(groups, np.int64)[:, None] * n + np.arange(n)).ravel()))


def parse_groups(batch: pa.RecordBatch | pa.Table, n: int, topk: int, topk_by: str) -> Parsed:
    """Validate whole groups (runs of ``n`` rows) and compute their top-k rows and reward variances,
    vectorized over the batch (one PUT's record batch, or a table over several PUTs' batches, each of
    whole groups): a PUT's cost must not grow with Python work per row (two ``to_pylist`` of string
    columns are the only per-row Python: group ids for the checks, sample ids for de-duplication).

    Raises ValueError naming what is wrong.
    """
    if not batch.schema.equals(COMPLETION_SCHEMA):
        raise ValueError("a group must have distrl.core.rows.COMPLETION_SCHEMA")
    rows, col = batch.num_rows, batch.column  # one column at a time: `batch.columns` costs ~20 us
    if rows == 0 or rows % n:
        raise ValueError(f"a PUT holds whole groups of group_size={n} rows, got {rows} rows")
    m, ids = rows // n, col(_COL["group_id"]).to_pylist()
    versions = col(_COL["policy_version"]).to_numpy().reshape(m, n)
    heads = ids[::n]
    # ufunc reductions, not ndarray.any/min/all (each of those goes through a Python-level wrapper)
    mixed = np.logical_or.reduce(versions != versions[:, :1], axis=None)
    if mixed or any(ids[i * n:(i + 1) * n].count(heads[i]) != n for i in range(m)):
        raise ValueError(f"all rows of a group must share group_id and policy_version (groups are runs of "
                         f"group_size={n} rows), got group ids {sorted(set(ids))[:4]}")
    if len(set(heads)) != m:
        raise ValueError(f"group ids {heads[:4]} repeat within one PUT")
    versions = versions[:, 0]
    if np.minimum.reduce(versions) < 0:
        raise ValueError(f"groups {heads[:4]} have a negative policy_version")
    sample_ids = col(_COL["sample_id"]).to_pylist()
    if len(set(sample_ids)) != rows:
        raise ValueError(f"sample ids within groups {heads[:4]} are not unique")
    rewards, advantages = col(_COL["reward"]).to_numpy(), col(_COL["advantage"]).to_numpy()
    for name, values in (("reward", rewards), ("advantage", advantages)):
        if not np.logical_and.reduce(np.isfinite(values)):
            raise ValueError(f"groups {heads[:4]} hold a NaN or infinite {name}")
    rewards = rewards.reshape(m, n).astype(np.float64)
    if topk == n:
        keep = np.broadcast_to(np.arange(n), (m, n))
    else:
        keys = rewards if topk_by == "reward" else np.abs(advantages.reshape(m, n))
        keep = np.sort(np.argsort(-keys, axis=1, kind="stable")[:, :topk], axis=1)  # ties go to the earlier row
    # population variance with np.var's arithmetic (same bits) in under half its time (no Python-level
    # wrapper); the mean of n equal float32 values is exact in float64, so equal rewards give exactly 0.0
    centred = rewards - np.add.reduce(rewards, 1, keepdims=True) / n  # (m, n)
    variance = np.add.reduce(centred * centred, 1) / n
    return Parsed(heads, versions, sample_ids, keep, variance, col(_COL["actor_id"]).to_numpy()[::n])


class RecentIds:
    """Sample id -> seq of the group that brought it, for at least the last ``window`` ids added: two
    generations of dicts; an update finding the newer one holding ``window`` ids drops the older and
    starts a new one, so at most ``2 * (window - 1)`` ids plus the last two updates are held. So the
    de-duplication memory of a week-long run stays bounded, and a re-sent PUT is recognized while
    fewer than ``window`` newer sample ids were accepted since its first send. The ids of one update
    (a group's, always) stay in one generation."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"the de-duplication window must be >= 1 sample id, got {window}")
        self.window = window
        self._new: dict[str, int] = {}
        self._old: dict[str, int] = {}

    def isdisjoint(self, ids: list[str]) -> bool:
        return self._new.keys().isdisjoint(ids) and self._old.keys().isdisjoint(ids)

    def get(self, sample_id: str) -> int | None:
        seq = self._new.get(sample_id)
        return self._old.get(sample_id) if seq is None else seq

    def update(self, pairs) -> None:
        """Add ``(sample_id, seq)`` pairs (an iterable or a dict)."""
        if len(self._new) >= self.window:
            self._old, self._new = self._new, {}
        self._new.update(pairs)

    def __len__(self) -> int:
        return len(self._new) + len(self._old)


class Slots:
    """Numpy columns of the held groups, one slot per group; freed slots are reused, capacity doubles.

    A slot holds the group's ``parent`` record batch (a Python list), its first row ``offset`` in it,
    ``nbytes`` (its share of the message), ``keep`` (its top-k rows relative to the group, (k,)), and
    seq, arrival, version, variance, uses, ``alive`` and ``cell`` (its sampling-bias cell,
    :func:`distrl.buffer.bias.cells`, -1 for a group without a learning signal; set by the store).
    """

    COLUMNS = (("seq", np.int64), ("arrival", np.int64), ("version", np.int64), ("variance", np.float64),
               ("uses", np.int64), ("alive", np.bool_), ("offset", np.int64), ("nbytes", np.int64),
               ("cell", np.int64))

    def __init__(self, topk: int, capacity: int = 1024) -> None:
        for name, dtype in self.COLUMNS:
            setattr(self, name, np.zeros(capacity, dtype))
        self.keep = np.zeros((capacity, topk), np.int64)
        self.parents: list[pa.RecordBatch | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def _grow(self) -> None:
        n = len(self.alive)
        for name, dtype in self.COLUMNS:
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n, dtype)]))
        self.keep = np.concatenate([self.keep, np.zeros_like(self.keep)])
        self.parents.extend([None] * n)
        self._free = list(range(2 * n - 1, n - 1, -1)) + self._free

    def add(self, parents: list[pa.RecordBatch], offset: np.ndarray, keep: np.ndarray, nbytes: np.ndarray,
            seq: np.ndarray, arrival: int, version: np.ndarray, variance: np.ndarray, uses: int) -> np.ndarray:
        """Hold c groups, group j in ``parents[j]`` (``offset``, ``nbytes``, ``seq``, ``version``,
        ``variance``: (c,); ``keep``: (c, k)); arrivals are ``arrival, arrival + 1, ...``. Returns their
        (c,) slots."""
        count = len(offset)
        while len(self._free) < count:
            self._grow()
        taken = self._free[:-count - 1:-1]  # the last freed first
        del self._free[-count:]
        lo = min(taken)
        if max(taken) - lo == count - 1:  # a run of slots (always while none was freed): slices are cheaper
            slots, index = np.arange(lo, lo + count), slice(lo, lo + count)
            self.parents[index] = parents
        else:
            slots = index = np.array(taken, np.intp)
            for i, parent in zip(taken, parents):
                self.parents[i] = parent
        self.seq[index], self.arrival[index], self.version[index] = seq, np.arange(arrival, arrival + count), version
        self.variance[index], self.uses[index], self.alive[index] = variance, uses, True
        self.offset[index], self.nbytes[index], self.keep[index] = offset, nbytes, keep
        return slots

    def remove(self, slots: np.ndarray) -> int:
        """Free the slots (no longer held); returns their total ``nbytes``."""
        slots = np.asarray(slots, np.intp)
        self.alive[slots] = False
        freed = slots.tolist()
        for i in freed:
            self.parents[i] = None
        self._free.extend(freed)
        return int(self.nbytes[slots].sum())

    def live(self) -> np.ndarray:
        return np.flatnonzero(self.alive)


def cut(parents: list[pa.RecordBatch], offset: np.ndarray, keep: np.ndarray, n: int,
        stamps: np.ndarray | None) -> pa.Table:
    """The kept rows of g groups, in order, as one contiguous table: one concatenation, then (top-k, k < n)
    one take.

    Group j is rows ``[offset[j], offset[j] + n)`` of ``parents[j]``, of which it keeps ``keep[j]``
    ((g, k) row indices relative to the group). ``stamps``: (g,) policy versions to write over
    ``policy_version`` (restamp), or None.
    """
    if not parents:
        return COMPLETION_SCHEMA.empty_table()
    first = offset.tolist()
    slices, start = [], 0  # neighbouring groups of one message form one slice
    for j in range(1, len(parents) + 1):
        if j == len(parents) or parents[j] is not parents[j - 1] or first[j] != first[j - 1] + n:
            slices.append(parents[start].slice(first[start], (j - start) * n))
            start = j
    rows = slices[0] if len(slices) == 1 else pa.concat_batches(slices)
    if keep.shape[1] < n:  # top-k: keep k of each group's n rows (with k == n, keep is every row in order)
        rows = rows.take(pa.array((keep + np.arange(0, len(parents) * n, n)[:, None]).ravel()))
    table = pa.Table.from_batches([rows])
    if stamps is not None:
        i = table.schema.get_field_index("policy_version")
        versions = np.repeat(np.asarray(stamps, np.int64), keep.shape[1])
        table = table.set_column(i, table.schema.field(i), pa.array(versions, pa.int64()))
    return table


def as_batch(group: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    """A group as one record batch (a Table with several chunks is combined). Raises ValueError."""
    if isinstance(group, pa.RecordBatch):
        return group
    if not isinstance(group, pa.Table):
        raise ValueError(f"a group must be a pyarrow Table or RecordBatch, got {type(group).__name__}")
    batches = group.combine_chunks().to_batches()
    return batches[0] if len(batches) == 1 else pa.RecordBatch.from_pylist([], schema=group.schema)
