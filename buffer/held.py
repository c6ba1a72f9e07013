"""The in-memory form of the buffer's groups: record batches with their top-k rows, in numpy-indexed slots.

Groups stay in the record batch they arrived in (zero-copy over the received message; a PUT may
carry several groups, each then a slice of it). Their per-group numbers (seq, arrival, staleness
version, reward variance, uses) live in numpy columns so that eligibility, eviction and ordering
are vectorized over all held groups; :func:`cut` makes a batch's rows with one concatenation (of
runs of neighbouring groups from the same message) and one take, whatever the number of groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from distrl.wire import COMPLETION_SCHEMA

_COL = {name: i for i, name in enumerate(COMPLETION_SCHEMA.names)}


class Parsed(NamedTuple):
    """What :func:`parse_groups` reads from m groups of n rows."""

    group_ids: list[str]  # (m,)
    versions: list[int]  # (m,) policy versions
    sample_ids: list[str]  # (m * n,)
    keep: np.ndarray  # (m, k) top-k row indices within each group, ascending
    variance: list[float]  # (m,) population variance of the rewards; exactly 0.0 when all equal


def rows_of(batch: pa.RecordBatch, groups: list[int], n: int) -> pa.RecordBatch:
    """The rows of the given groups (indices of runs of n rows) of ``batch``."""
    return batch.take(pa.array(np.concatenate([np.arange(i * n, (i + 1) * n) for i in groups])))


def parse_groups(batch: pa.RecordBatch, n: int, topk: int, topk_by: str) -> Parsed:
    """Validate whole groups (runs of ``n`` rows) and compute their top-k rows and reward variances,
    vectorized over the batch: a PUT's cost must not grow with Python work per row.

    Raises ValueError naming what is wrong.
    """
    if not batch.schema.equals(COMPLETION_SCHEMA):
        raise ValueError("a group must have distrl.wire.COMPLETION_SCHEMA")
    rows, col = batch.num_rows, batch.column  # one column at a time: `batch.columns` costs ~20 us
    if rows == 0 or rows % n:
        raise ValueError(f"a PUT holds whole groups of group_size={n} rows, got {rows} rows")
    m, ids = rows // n, col(_COL["group_id"]).to_pylist()
    versions = col(_COL["policy_version"]).to_numpy().reshape(m, n)
    heads = ids[::n]
    if any(ids[i * n:(i + 1) * n].count(heads[i]) != n for i in range(m)) or (versions != versions[:, :1]).any():
        raise ValueError(f"all rows of a group must share group_id and policy_version (groups are runs of "
                         f"group_size={n} rows), got group ids {sorted(set(ids))[:4]}")
    if len(set(heads)) != m:
        raise ValueError(f"group ids {heads[:4]} repeat within one PUT")
    if (versions[:, 0] < 0).any():
        raise ValueError(f"groups {heads[:4]} have a negative policy_version")
    sample_ids = col(_COL["sample_id"]).to_pylist()
    if len(set(sample_ids)) != rows:
        raise ValueError(f"sample ids within groups {heads[:4]} are not unique")
    rewards, advantages = col(_COL["reward"]).to_numpy(), col(_COL["advantage"]).to_numpy()
    for name, values in (("reward", rewards), ("advantage", advantages)):
        if not np.isfinite(values).all():
            raise ValueError(f"groups {heads[:4]} hold a NaN or infinite {name}")
    rewards = rewards.reshape(m, n).astype(np.float64)
    keys = rewards if topk_by == "reward" else np.abs(advantages.reshape(m, n))
    keep = np.sort(np.argsort(-keys, axis=1, kind="stable")[:, :topk], axis=1)  # ties go to the earlier row
    # population variance with np.var's arithmetic (same bits) in under half its time (no Python-level
    # wrapper); the mean of n equal float32 values is exact in float64, so equal rewards give exactly 0.0
    centred = rewards - np.add.reduce(rewards, 1, keepdims=True) / n  # (m, n)
    variance = np.add.reduce(centred * centred, 1) / n
    return Parsed(heads, versions[:, 0].tolist(), sample_ids, keep, variance.tolist())


@dataclass
class Held:
    """A group in memory: rows ``[offset, offset + rows)`` of ``parent`` (the record batch it arrived
    in), the rows top-k keeps (relative to the group), and its share of the Arrow bytes."""

    parent: pa.RecordBatch
    offset: int
    rows: int
    keep: np.ndarray
    nbytes: int

    @property
    def batch(self) -> pa.RecordBatch:
        return self.parent.slice(self.offset, self.rows)


class Slots:
    """Numpy columns of the held groups, one slot per group; freed slots are reused, capacity doubles."""

    COLUMNS = (("seq", np.int64), ("arrival", np.int64), ("version", np.int64), ("variance", np.float64),
               ("uses", np.int64), ("alive", np.bool_))

    def __init__(self, capacity: int = 1024) -> None:
        for name, dtype in self.COLUMNS:
            setattr(self, name, np.zeros(capacity, dtype))
        self.groups: list[Held | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))

    def add(self, seq: int, arrival: int, version: int, variance: float, uses: int, group: Held) -> int:
        if not self._free:
            n = len(self.alive)
            for name, dtype in self.COLUMNS:
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n, dtype)]))
            self.groups.extend([None] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        i = self._free.pop()
        self.seq[i], self.arrival[i], self.version[i] = seq, arrival, version
        self.variance[i], self.uses[i], self.alive[i], self.groups[i] = variance, uses, True, group
        return i

    def remove(self, i: int) -> Held:
        group, self.groups[i], self.alive[i] = self.groups[i], None, False
        self._free.append(i)
        return group

    def live(self) -> np.ndarray:
        return np.flatnonzero(self.alive)


def cut(groups: list[Held], stamps: list[int] | None) -> pa.Table:
    """The kept rows of ``groups``, in order, as one contiguous table: one concatenation, one take.

    ``stamps``: a policy version per group to write over ``policy_version`` (restamp), or None.
    """
    if not groups:
        return COMPLETION_SCHEMA.empty_table()
    runs: list[list] = []  # [parent, first row, rows]: neighbouring groups of one message form one slice
    index, total = [], 0
    for g in groups:
        last = runs[-1] if runs else None
        if last is not None and last[0] is g.parent and last[1] + last[2] == g.offset:
            last[2] += g.rows
        else:
            runs.append([g.parent, g.offset, g.rows])
        index.append(g.keep + total)
        total += g.rows
    rows = pa.concat_batches([parent.slice(first, n) for parent, first, n in runs]).take(pa.array(np.concatenate(index)))
    table = pa.Table.from_batches([rows])
    if stamps is not None:
        i = table.schema.get_field_index("policy_version")
        versions = np.repeat(np.asarray(stamps, np.int64), [len(g.keep) for g in groups])
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
