"""The buffer's pure core: groups, staleness eviction, top-k selection and credits. No sockets.

A *group* is the ``group_size`` completions of one prompt instance (rows of
:data:`distrl.wire.COMPLETION_SCHEMA`). Groups get a sequence number in PUT order. For each policy
version V the learner group makes ONE selection: the ``batch_size`` oldest groups whose
``V - policy_version <= max_staleness``, each cut to its top-k completions, sharded across ranks
(group i goes to rank ``i % world_size``).

Credits follow AReaL's rule: at most ``(learner_version + max_staleness + 1) * batch_size`` groups
may be in play. As in AReaL, where only *accepted* samples count, a group evicted as stale gives its
credit back, so one slow actor cannot starve the learners.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Literal

import pyarrow as pa

from distrl.wire import COMPLETION_SCHEMA


@dataclass
class _Group:
    seq: int
    group_id: str
    policy_version: int
    table: pa.Table


@dataclass
class _Selection:
    version: int
    world_size: int
    shards: list[pa.Table]
    served: set[int] = field(default_factory=set)


def topk_rows(table: pa.Table, k: int, by: Literal["reward", "abs_advantage"] = "reward") -> pa.Table:
    """The k rows of ``table`` with the largest ``reward`` (or ``|advantage|``), in their original order.

    Ties go to the earlier row. Raises ValueError if ``by`` is unknown.
    """
    if by == "reward":
        keys = table.column("reward").to_pylist()
    elif by == "abs_advantage":
        keys = [abs(a) for a in table.column("advantage").to_pylist()]
    else:
        raise ValueError(f"topk_by must be 'reward' or 'abs_advantage', got {by!r}")
    best = sorted(range(len(keys)), key=lambda i: (-keys[i], i))[:k]
    return table.take(sorted(best))


class GroupStore:
    """Groups waiting to be trained on, with staleness eviction, top-k selection and credits.

    Args:
        batch_size: groups per policy version, across all learners.
        max_staleness: largest ``learner_version - policy_version`` handed out (0 = on-policy).
        topk: completions kept per group (1 <= k <= group_size).
        group_size: completions per group (n); every PUT must have exactly this many rows.
        topk_by: ``"reward"`` (default) or ``"abs_advantage"``.
    Raises ValueError on out-of-range arguments.
    """

    def __init__(self, batch_size: int, max_staleness: int, topk: int, group_size: int,
                 topk_by: Literal["reward", "abs_advantage"] = "reward") -> None:
        if batch_size < 1 or group_size < 1 or max_staleness < 0:
            raise ValueError(f"need batch_size >= 1, group_size >= 1, max_staleness >= 0; got "
                             f"{batch_size}, {group_size}, {max_staleness}")
        if not 1 <= topk <= group_size:
            raise ValueError(f"topk must be in [1, group_size={group_size}], got {topk}")
        if topk_by not in ("reward", "abs_advantage"):
            raise ValueError(f"topk_by must be 'reward' or 'abs_advantage', got {topk_by!r}")
        self.batch_size, self.max_staleness, self.topk, self.group_size = batch_size, max_staleness, topk, group_size
        self.topk_by = topk_by
        self.learner_version = 0
        self._groups: OrderedDict[int, _Group] = OrderedDict()  # seq -> group, oldest first
        self._seen: dict[str, int] = {}  # sample_id -> seq of the group that brought it
        self._selections: dict[int, _Selection] = {}  # version -> selection not yet dropped
        self._next_seq = 0
        self._rows = self._bytes = 0
        self.duplicates = self.evicted_stale = 0
        self.credits_granted = self.credits_refunded = 0
        self.selections = 0
        self.last_staleness: list[int] = []

    # ---- PUT ---------------------------------------------------------------------------------

    def put(self, table: pa.Table, persist: Callable[[pa.Table], None] | None = None) -> tuple[int, bool]:
        """Accept one whole group; returns ``(seq_no, duplicate)``.

        ``persist(table)`` (e.g. ``SegmentLog.append``) runs after validation and the duplicate check,
        before the group is committed: if it raises, nothing changes. A group whose sample ids were
        all accepted before is a duplicate: dropped, counted, and answered with its original seq_no.
        A group already staler than the bound is committed (and persisted) but evicted at once.
        Raises ValueError if the table is not one valid group.
        """
        group_id, version, sample_ids = self._check_group(table)
        known = {self._seen.get(s) for s in sample_ids}
        if known != {None}:
            if len(known) == 1:
                self.duplicates += 1
                return known.pop(), True
            raise ValueError(f"group {group_id!r} reuses sample ids of accepted groups (seq "
                             f"{sorted(s for s in known if s is not None)}) but is not one of them")
        if persist is not None:
            persist(table)
        seq = self._next_seq
        self._next_seq += 1
        self._seen.update((s, seq) for s in sample_ids)
        self._groups[seq] = _Group(seq, group_id, version, table)
        self._rows += table.num_rows
        self._bytes += table.nbytes
        self._evict_stale()
        return seq, False

    def _check_group(self, table: pa.Table) -> tuple[str, int, list[str]]:
        """Validate one group; returns (group_id, policy_version, sample_ids). Raises ValueError."""
        if not isinstance(table, pa.Table) or not table.schema.equals(COMPLETION_SCHEMA):
            raise ValueError("a group must be a pyarrow Table with distrl.wire.COMPLETION_SCHEMA")
        if table.num_rows != self.group_size:
            raise ValueError(f"a group must have group_size={self.group_size} rows, got {table.num_rows}")
        group_ids = set(table.column("group_id").to_pylist())
        versions = set(table.column("policy_version").to_pylist())
        if len(group_ids) != 1 or len(versions) != 1:
            raise ValueError(f"all rows of a group must share group_id and policy_version, got group ids "
                             f"{sorted(group_ids)[:4]} and versions {sorted(versions)[:4]}")
        sample_ids = table.column("sample_id").to_pylist()
        if len(set(sample_ids)) != len(sample_ids):
            raise ValueError(f"sample ids within group {next(iter(group_ids))!r} are not unique")
        for name in ("reward", "advantage"):
            if any(math.isnan(x) for x in table.column(name).to_pylist()):
                raise ValueError(f"group {next(iter(group_ids))!r} has a NaN {name}")
        return group_ids.pop(), versions.pop(), sample_ids

    # ---- staleness ---------------------------------------------------------------------------

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version whose groups may still be trained on: actors must run at least this."""
        return max(0, self.learner_version - self.max_staleness)

    def _evict_stale(self) -> None:
        """Drop groups with ``learner_version - policy_version > max_staleness``; refund their credits."""
        stale = [g for g in self._groups.values() if self.learner_version - g.policy_version > self.max_staleness]
        for g in stale:
            self._drop(g)
        self.evicted_stale += len(stale)
        self.credits_refunded += min(len(stale), self.credits_granted - self.credits_refunded)

    def _drop(self, group: _Group) -> None:
        del self._groups[group.seq]
        self._rows -= group.table.num_rows
        self._bytes -= group.table.nbytes

    # ---- GET ---------------------------------------------------------------------------------

    def select(self, learner_version: int, rank: int, world_size: int) -> pa.Table | None:
        """Rank ``rank``'s shard of the selection for ``learner_version``, or None (caller replies WAIT).

        The first call for a version makes the selection; later calls (other ranks, or a retried
        request) get shards of that same selection. Raises ValueError on a bad rank or world size.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if learner_version > self.learner_version:
            self.learner_version = learner_version
            self._evict_stale()
        sel = self._selections.get(learner_version)
        if sel is None:
            sel = self._select(learner_version, world_size)
            if sel is None:
                return None
            self._selections[learner_version] = sel
        if sel.world_size != world_size:
            raise ValueError(f"version {learner_version} was selected for world_size={sel.world_size}, "
                             f"rank {rank} asks with world_size={world_size}")
        sel.served.add(rank)
        if len(sel.served) == world_size:  # keep this one for retried requests, drop older finished ones
            for v in [v for v, s in self._selections.items() if v < learner_version and len(s.served) == s.world_size]:
                del self._selections[v]
        return sel.shards[rank]

    def _select(self, version: int, world_size: int) -> _Selection | None:
        """Take ``batch_size`` fresh groups, oldest first, cut to top-k and sharded; None if too few."""
        fresh = [g for g in self._groups.values() if version - g.policy_version <= self.max_staleness]
        if len(fresh) < self.batch_size:
            return None
        chosen = fresh[: self.batch_size]
        for g in chosen:
            self._drop(g)
        kept = [topk_rows(g.table, self.topk, self.topk_by) for g in chosen]
        shards = [pa.concat_tables(kept[r::world_size]) if kept[r::world_size] else COMPLETION_SCHEMA.empty_table()
                  for r in range(world_size)]
        self.selections += 1
        self.last_staleness = [version - v for t in kept for v in t.column("policy_version").to_pylist()]
        return _Selection(version, world_size, shards)

    def fresh_groups(self, learner_version: int | None = None) -> int:
        """Groups that a selection for ``learner_version`` (default: the current one) could take."""
        v = self.learner_version if learner_version is None else learner_version
        return sum(1 for g in self._groups.values() if v - g.policy_version <= self.max_staleness)

    # ---- credits -----------------------------------------------------------------------------

    def grant_credits(self, want: int) -> int:
        """Grant up to ``want`` groups of generation (AReaL's rule); returns how many (>= 0).

        At most ``(learner_version + max_staleness + 1) * batch_size`` groups may have been granted,
        net of those refunded by stale eviction. Raises ValueError if ``want`` < 0.
        """
        if want < 0:
            raise ValueError(f"want must be >= 0, got {want}")
        in_play = self.credits_granted - self.credits_refunded
        allowed = (self.learner_version + self.max_staleness + 1) * self.batch_size - in_play
        granted = max(0, min(want, allowed))
        self.credits_granted += granted
        return granted

    # ---- stats -------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float | list[int]]:
        """Counters: rows/groups/bytes held now, totals since start, and the last selection's staleness."""
        return {
            "rows": self._rows,
            "groups": len(self._groups),
            "bytes": self._bytes,
            "groups_put": self._next_seq,
            "duplicates": self.duplicates,
            "evicted_stale": self.evicted_stale,
            "credits_granted": self.credits_granted,
            "credits_refunded": self.credits_refunded,
            "learner_version": self.learner_version,
            "min_policy_version": self.min_policy_version,
            "selections": self.selections,
            "last_staleness": list(self.last_staleness),
        }
