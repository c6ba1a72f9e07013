"""The sampling-bias monitor: which data the asynchrony lets through to the learner, per policy version.

Asynchronous RL trains on the groups that finish in time, not on the prompts it issued: long, slow, hard
problems finish late and are evicted as stale (or never finish before the run ends), so the trained
data is shorter and easier than what the actors generated (tinker-cookbook PR #822; NeMo-RL PR #3599
measured ~30 % of prompts skipped on resume, biased toward long rollouts). The buffer sees every stage,
so it counts them here (:class:`BiasMonitor`, owned by :class:`distrl.buffer.store.GroupStore`):

================  =====================================================================================
stage             what is counted, keyed by version
================  =====================================================================================
``issued``        credits granted (one prompt each), by the learner version when granted
``generated``     groups accepted by a PUT (restored from the log too), by their ``policy_version``
``trained``       groups handed to the learners (each hand-out, ``--replay_ratio`` > 1 counts each use)
``evicted``       groups that left memory without being trained: ``stale`` and ``zero_variance`` (the store's
                  eviction reasons; a PUT refused while full is retried by its actor, not counted)
================  =====================================================================================

Per group, three features: **length** (mean over its n completions of the model's tokens: the sum of
``loss_mask`` for a multi-turn episode, else the completion's length; tokens), **difficulty** (the
group's mean reward over all n completions, before top-k) and **lag** (``learner_version -
policy_version`` when the stage happened: at arrival for ``generated``, at selection for ``trained``, at
eviction for ``evicted``).

Summary (``stats()["bias"]``, TensorBoard ``bias/*`` through the buffer's metrics, the end-of-run report),
over the whole run so far:

- ``len_gap`` = mean length of trained groups - mean length of generated groups (tokens; negative: the
  learner sees shorter answers than the actors wrote);
- ``difficulty_gap`` = mean difficulty (mean reward) of trained - of generated (positive: the learner
  sees easier problems);
- ``lag_mean`` = mean lag of trained groups (versions);
- ``untrained_share`` = 1 - groups trained at least once / prompts issued (in flight at the end count as
  untrained: issued and never trained).

For ``--bias_correction reweight`` (:mod:`distrl.learn.reweight`) the monitor also keeps two histograms
over the cells (length bucket, difficulty bucket): generated and trained (each hand-out), of the groups with a
learning signal only (rewards not all equal). A zero-variance group (all right or all wrong) has no GRPO
advantage and is dropped whatever its timing, so it is not part of the mix the correction restores: counted,
it would give the trained groups of the lowest and highest difficulty buckets the weights of the many all-wrong
and all-right groups beside them. Buckets are
fixed, so the histograms add across a run: length bucket ``b = #{e in LENGTH_EDGES : e <= length}``
(powers of two, 13 buckets), difficulty bucket ``#{e in DIFFICULTY_EDGES : e <= mean reward}``
(4 buckets; a reward outside [0, 1] falls in the first or last). The cell index is
``length_bucket * N_DIFFICULTY + difficulty_bucket``.

Counts start with the buffer process: a resumed buffer counts the groups it restores from the segment log as
generated again (and the credits of the resumed run as issued); they are not checkpointed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LENGTH_EDGES = np.array([2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])  # tokens
DIFFICULTY_EDGES = np.array([0.25, 0.5, 0.75])  # mean reward of the group
N_LENGTH, N_DIFFICULTY = len(LENGTH_EDGES) + 1, len(DIFFICULTY_EDGES) + 1
N_CELLS = N_LENGTH * N_DIFFICULTY
STAGES = ("issued", "generated", "trained", "evicted")
KEEP_CELLS = 8  # versions whose (group_id -> cell) maps are kept for retried GETs and other ranks


def cells(length: np.ndarray, difficulty: np.ndarray) -> np.ndarray:
    """(g,) int cell index of groups of mean ``length`` (tokens) and mean reward ``difficulty``, both (g,)."""
    lb = np.searchsorted(LENGTH_EDGES, length, side="right")
    db = np.searchsorted(DIFFICULTY_EDGES, difficulty, side="right")
    return lb * N_DIFFICULTY + db


def model_tokens(rows: pa.RecordBatch | pa.Table) -> np.ndarray:
    """(b,) float: the model's tokens of each completion row: ``sum(loss_mask)`` where a row has a loss mask
    (a multi-turn episode: observations are 0), else the length of ``completion_ids``."""
    lengths = pc.list_value_length(rows.column("completion_ids")).to_numpy(zero_copy_only=False).astype(np.float64)
    if "loss_mask" not in rows.schema.names:
        return lengths
    mask = rows.column("loss_mask")
    if mask.null_count == len(mask):
        return lengths
    if isinstance(mask, pa.ChunkedArray):
        mask = mask.combine_chunks()
    valid = mask.is_valid().to_numpy(zero_copy_only=False)
    counts = pc.list_value_length(mask).fill_null(0).to_numpy(zero_copy_only=False)
    values = pc.list_flatten(mask).to_numpy(zero_copy_only=False).astype(np.float64)
    ends = np.cumsum(counts)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    sums = csum[ends] - csum[ends - counts]
    return np.where(valid, sums, lengths)


@dataclass
class _Stage:
    """Counts and feature sums of one stage at one version."""

    groups: int = 0
    length: float = 0.0
    difficulty: float = 0.0
    lag: float = 0.0

    def add(self, length: np.ndarray, difficulty: np.ndarray, lag: np.ndarray) -> None:
        self.groups += len(length)
        self.length += float(np.add.reduce(length))
        self.difficulty += float(np.add.reduce(difficulty))
        self.lag += float(np.add.reduce(lag))

    def merge(self, other: "_Stage") -> None:
        self.groups += other.groups
        self.length += other.length
        self.difficulty += other.difficulty
        self.lag += other.lag

    def means(self) -> dict[str, float | int | None]:
        n = self.groups
        return {"groups": n, "length": self.length / n if n else None,
                "difficulty": self.difficulty / n if n else None, "lag": self.lag / n if n else None}


@dataclass
class _Version:
    issued: int = 0
    stages: dict[str, _Stage] = field(default_factory=lambda: {s: _Stage() for s in STAGES[1:]})


class BiasMonitor:
    """Counts of the four stages per version, with the groups' length, difficulty and lag (module docstring).

    The store calls :meth:`issued` when it grants credits, :meth:`generated` when it admits groups (before
    any eviction on arrival), :meth:`trained` at each selection and :meth:`evicted` at each eviction;
    groups are named by their ``seq``. Pure bookkeeping: no sockets, no clock.
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.versions: dict[int, _Version] = {}
        self.generated_cells = np.zeros(N_CELLS, np.int64)
        self.trained_cells = np.zeros(N_CELLS, np.int64)
        self.trained_once = 0  # groups handed out at least once
        self._held: dict[int, tuple[int, float, float, int, bool]] = {}  # seq -> cell, length, difficulty, version,
        # and whether its rewards differ (a learning signal: counted in the cell histograms)
        self._batch_cells: dict[int, dict[str, int]] = {}  # learner version -> {group_id: cell} of its selection

    def _version(self, v: int) -> _Version:
        if v not in self.versions:
            self.versions[v] = _Version()
        return self.versions[v]

    def issued(self, n: int, learner_version: int) -> None:
        """``n`` credits granted (prompts issued) while the learners are at ``learner_version``."""
        if n:
            self._version(learner_version).issued += n

    def generated(self, parents: list[pa.RecordBatch], offset: np.ndarray, seq: np.ndarray, version: np.ndarray,
                  learner_version: int) -> np.ndarray:
        """Groups accepted: group j is rows ``offset[j] + [0, group_size)`` of ``parents[j]``, ``seq`` and
        ``version`` (policy version) (c,). Returns (c,) int64: each group's cell, -1 where its rewards are all
        equal (no learning signal: outside the histograms)."""
        rows = offset[:, None] + np.arange(self.group_size)  # (c, n) row of each completion in its parent
        length, difficulty = np.empty(len(offset)), np.empty(len(offset))
        signal = np.empty(len(offset), bool)
        first = 0
        while first < len(parents):  # runs of groups from one parent (one PUT message: all of them)
            parent, last = parents[first], first + 1
            while last < len(parents) and parents[last] is parent:
                last += 1
            reward = parent.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
            length[first:last] = np.add.reduce(model_tokens(parent)[rows[first:last]], axis=1) / self.group_size
            difficulty[first:last] = np.add.reduce(reward[rows[first:last]], axis=1) / self.group_size
            signal[first:last] = np.ptp(reward[rows[first:last]], axis=1) > 0
            first = last
        cell = cells(length, difficulty)
        self.generated_cells += np.bincount(cell[signal], minlength=N_CELLS)
        self._stage("generated", length, difficulty, version, learner_version)
        self._held.update(zip(seq.tolist(), zip(cell.tolist(), length.tolist(), difficulty.tolist(), version.tolist(),
                                                signal.tolist())))
        return np.where(signal, cell, -1)

    def starved(self) -> np.ndarray:
        """(cells,) bool: the cells the learners under-train, whose share of the groups handed out so far is below
        their share of the groups generated (both histograms: groups with a learning signal only). No cell before
        the first hand-out of this process: at a fresh start no group is stale yet, and a resumed buffer (whose counts
        restart, module docstring) does not give its restored groups an allowance on no evidence."""
        g, t = self.generated_cells, self.trained_cells
        trained = int(t.sum())
        return g * trained > t * int(g.sum()) if trained else np.zeros(N_CELLS, bool)

    def _take(self, seq: np.ndarray, keep: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        """(cell, length, difficulty, version, signal, j) of the groups ``seq`` this monitor holds (j: their
        positions in ``seq``), forgotten unless ``keep[j]``."""
        rows = []
        for j, s in enumerate(seq.tolist()):
            held = self._held.get(s) if keep is not None and keep[j] else self._held.pop(s, None)
            if held is not None:
                rows.append((*held, j))
        if not rows:
            return (np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, np.int64), np.zeros(0, bool),
                    np.zeros(0, np.int64))
        c, ln, d, v, sig, j = zip(*rows)
        return (np.array(c, np.int64), np.array(ln), np.array(d), np.array(v, np.int64), np.array(sig, bool),
                np.array(j, np.int64))

    def _stage(self, stage: str, length, difficulty, version, learner_version: int) -> None:
        lag = learner_version - version
        if len(version) and version.min() == version.max():  # the common case: one policy version
            self._version(int(version[0])).stages[stage].add(length, difficulty, lag)
        else:
            for v in np.unique(version).tolist():
                at = version == v
                self._version(v).stages[stage].add(length[at], difficulty[at], lag[at])

    def trained(self, seq: np.ndarray, learner_version: int, used_up: np.ndarray, first_use: np.ndarray,
                gids: list[str]) -> None:
        """Groups ``seq`` (named ``gids``) selected for ``learner_version``; ``used_up``: they leave memory;
        ``first_use``: not handed out before (all (c,) bool)."""
        cell, length, difficulty, version, signal, found = self._take(seq, keep=~used_up)
        self.trained_cells += np.bincount(cell[signal], minlength=N_CELLS)
        self.trained_once += int(first_use.sum())
        self._stage("trained", length, difficulty, version, learner_version)
        self._batch_cells[learner_version] = dict(zip([gids[j] for j in found.tolist()], cell.tolist()))
        for old in sorted(self._batch_cells)[:-KEEP_CELLS]:
            del self._batch_cells[old]

    def evicted(self, seq: np.ndarray, learner_version: int) -> None:
        """Groups ``seq`` evicted (any reason) while the learners are at ``learner_version``."""
        _, length, difficulty, version, _, _ = self._take(seq)
        self._stage("evicted", length, difficulty, version, learner_version)

    def batch_fields(self, learner_version: int, shard: pa.Table | None = None) -> dict:
        """What a BATCH reply for ``learner_version`` carries for ``--bias_correction`` (wire ``Batch``):
        the running histograms over cells and the cell of each group of the selection, by group id (those of
        ``shard``'s rows only, when given)."""
        chosen = self._batch_cells.get(learner_version, {})
        if shard is not None:
            chosen = {g: chosen[g] for g in pc.unique(shard.column("group_id")).to_pylist() if g in chosen}
        return {"bias_generated": self.generated_cells.tolist(), "bias_trained": self.trained_cells.tolist(),
                "bias_cells": dict(chosen)}

    def summary(self) -> dict:
        """The gaps of the run so far and per-version stage means (module docstring); None where a stage is
        empty."""
        totals = _Version(issued=sum(rec.issued for rec in self.versions.values()))
        for rec in self.versions.values():
            for s in STAGES[1:]:
                totals.stages[s].merge(rec.stages[s])
        t = {s: totals.stages[s].means() for s in STAGES[1:]}
        gen, tr = t["generated"], t["trained"]

        def gap(key: str) -> float | None:
            return None if gen[key] is None or tr[key] is None else tr[key] - gen[key]

        issued = totals.issued
        by_version = [{"version": v, "issued": rec.issued, **{s: rec.stages[s].means() for s in STAGES[1:]}}
                      for v, rec in sorted(self.versions.items())]
        return {"len_gap": gap("length"), "difficulty_gap": gap("difficulty"), "lag_mean": tr["lag"],
                "untrained_share": 1.0 - self.trained_once / issued if issued else None,
                "issued": issued, "trained_once": self.trained_once, **{s: t[s] for s in STAGES[1:]},
                "by_version": by_version}

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars ``bias/<name>`` of :meth:`summary` (those not None)."""
        s = self.summary()
        values = {"len_gap": s["len_gap"], "difficulty_gap": s["difficulty_gap"], "lag_mean": s["lag_mean"],
                  "untrained_share": s["untrained_share"]}
        for stage in STAGES[1:]:
            values.update({f"{stage}_length": s[stage]["length"], f"{stage}_difficulty": s[stage]["difficulty"]})
        return {f"bias/{k}": float(v) for k, v in values.items() if v is not None}
