"""The buffer's pure core: held groups, staleness eviction, selection, credits and bounds. No sockets.

A *group* is the ``group_size`` completions of one prompt instance (rows of
:data:`distrl.core.rows.COMPLETION_SCHEMA`). Groups come in through the PUT side, the store's
:class:`distrl.buffer.intake.Intake` (validation, de-duplication, persist before commit; ``store.intake``), which
hands them to :meth:`GroupStore.admit`; each accepted group gets a sequence number ``seq`` in PUT order (its
position in the segment log). It is held as the record batch it arrived in (zero-copy over the received
message); its top-k rows (:func:`distrl.buffer.groups.parse_groups`, the same rule as
:func:`distrl.buffer.selection.topk_rows`) are chosen on arrival and cut out, for all groups of a batch at once,
when the batch is selected.

For each policy version V the learner group makes ONE selection: ``batch_size`` groups among those
*eligible* at V (``0 <= V - policy_version <= max_staleness``, plus ``bias_slack`` below), taken in ``order``
(:mod:`distrl.buffer.selection`), sharded across ranks (group i goes to rank ``i % world_size``). A group
is handed out up to ``replay_ratio`` times (to different versions), then it leaves memory. A server
that writes its log after admitting groups sets ``logged_below`` (the seq of the first group not yet
in the log): later groups are not handed out, nor counted as fresh, until it moves past them.

With ``bias_slack`` K > 0 a group with a learning signal whose (length, difficulty) cell the learners
under-train (:meth:`distrl.buffer.bias.BiasMonitor.starved`) may be K versions staler: the late groups the
asynchrony would drop (long, slow, hard problems) are trained instead, their importance ratios clipped by the
loss; the allowance ends as soon as the cell's trained share reaches its generated share.

Groups leave memory otherwise only by eviction, counted per reason: ``stale`` (the learner moved past
``policy_version + max_staleness``, plus the slack) and ``zero_variance`` (``filter_zero_variance``: all rewards
equal). An evicted group gives its credit back. A run whose every group is filtered could never train:
after ``max_filtered_groups`` filtered groups in a row (any group that passes the filter resets the
count) :meth:`GroupStore.check_progress` raises :class:`distrl.core.errors.NoProgress`.

Credits follow AReaL's rule: at most ``(learner_version + max_staleness + 1) * batch_size`` groups may
be granted, net of refunds. The same bound is checked where groups arrive, over whatever set of actors
sent them: groups accepted from the start (``groups_put``, restored ones included) net of evicted ones
may not exceed it; each group accepted beyond it is counted in ``credit_violations`` (0 when every actor
PUTs only what it was granted), and ``credit_excess_max`` is the largest ``accepted - allowed`` seen at an
arrival (negative: the rule always had room). When memory is full (``max_rows`` completions or ``max_bytes`` Arrow bytes
held) no credit is granted and PUTs raise :class:`BufferFull`: nothing is ever dropped silently.

With ``restamp`` (offline replay) a group's staleness counts from the first version that trains on it:
it is eligible until then, and the rows handed out carry that version as ``policy_version``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import pyarrow as pa

from distrl.buffer.bias import BiasMonitor
from distrl.buffer.groups import Slots, cut
from distrl.buffer.intake import DEDUP_WINDOW, Intake, Persist
from distrl.buffer.selection import first_k, order_keys
from distrl.core.errors import NoProgress
from distrl.core.wire import ErrorCode

EVICTION_REASONS = ("stale", "zero_variance")
MAX_FILTERED_GROUPS = 2000  # consecutive zero-variance groups before NoProgress (--max_filtered_groups)


class BufferFull(RuntimeError):
    """A PUT that would exceed ``max_rows`` or ``max_bytes``: refused, nothing stored (retry later)."""

    code: ClassVar[ErrorCode] = ErrorCode.FULL  # the ERROR code the server answers it with


@dataclass
class _Selection:
    version: int
    world_size: int
    shards: list[pa.Table]
    served: set[int] = field(default_factory=set)


class GroupStore:
    """Groups waiting to be trained on, with eviction, selection, credits and memory bounds; its PUT side is
    ``intake`` (:class:`distrl.buffer.intake.Intake`), whose ``put``, ``put_groups``, ``put_messages``,
    ``restore``, ``acked_groups`` and ``actor_ids`` it offers as its own.

    Args:
        batch_size: groups per policy version, across all learners.
        max_staleness: largest ``learner_version - policy_version`` handed out (0 = on-policy).
        topk: completions kept per group (1 <= k <= group_size).
        group_size: completions per group (n); every PUT must have exactly this many rows.
        topk_by: ``"reward"`` or ``"abs_advantage"``.
        order: ``"fifo"``, ``"freshest"`` or ``"variance"`` (see :mod:`distrl.buffer.selection`).
        filter_zero_variance: evict groups whose rewards are all equal on arrival.
        replay_ratio: times a group may be handed out (>= 1).
        max_rows, max_bytes: memory bounds (completions of whole groups, Arrow bytes); None = unbounded.
        restamp: staleness counts from a group's first use (offline replay), not its recorded version.
        dedup_window: sample ids remembered to drop re-sent PUTs: at least the last this many accepted
            (:class:`distrl.buffer.groups.RecentIds`).
        max_filtered_groups: with ``filter_zero_variance``, groups filtered in a row after which
            :meth:`check_progress` raises NoProgress (0: never).
        bias_slack: extra versions of staleness for groups of under-trained cells (module docstring; 0: none).
    Raises ValueError on out-of-range arguments.
    """

    def __init__(self, batch_size: int, max_staleness: int, topk: int, group_size: int,
                 topk_by: Literal["reward", "abs_advantage"] = "reward", order: str = "fifo",
                 filter_zero_variance: bool = False, replay_ratio: int = 1, max_rows: int | None = None,
                 max_bytes: int | None = None, restamp: bool = False, dedup_window: int = DEDUP_WINDOW,
                 max_filtered_groups: int = MAX_FILTERED_GROUPS, bias_slack: int = 0) -> None:
        if min(batch_size, group_size, replay_ratio) < 1 or min(max_staleness, max_filtered_groups, bias_slack) < 0:
            raise ValueError(f"need batch_size >= 1, group_size >= 1, max_staleness >= 0, replay_ratio >= 1, "
                             f"max_filtered_groups >= 0, bias_slack >= 0; got {batch_size}, {group_size}, "
                             f"{max_staleness}, {replay_ratio}, {max_filtered_groups}, {bias_slack}")
        if not 1 <= topk <= group_size:
            raise ValueError(f"topk must be in [1, group_size={group_size}], got {topk}")
        if topk_by not in ("reward", "abs_advantage"):
            raise ValueError(f"topk_by must be 'reward' or 'abs_advantage', got {topk_by!r}")
        order_keys(order, *[np.zeros(0)] * 3)  # raises ValueError on an unknown order
        if max_rows is not None and max_rows < batch_size * group_size:
            raise ValueError(f"max_rows={max_rows} cannot hold one batch of {batch_size} groups x {group_size} rows")
        self.intake = Intake(self, dedup_window)
        self.batch_size, self.max_staleness, self.topk, self.group_size = batch_size, max_staleness, topk, group_size
        self.topk_by, self.order, self.filter_zero_variance = topk_by, order, filter_zero_variance
        self.replay_ratio, self.max_rows, self.max_bytes, self.restamp = replay_ratio, max_rows, max_bytes, restamp
        self.bias_slack = bias_slack
        self.slack_trained = 0  # groups handed out staler than max_staleness, under the slack
        self.learner_version = 0
        self._slots = Slots(topk)
        self._selections: dict[int, _Selection] = {}  # version -> selection not yet dropped
        self._last_selected = -1  # selections are made for increasing versions only
        self._next_arrival = 0
        self.rows = self.bytes = 0
        self.refused_full = self.selections = 0
        self.evicted = dict.fromkeys(EVICTION_REASONS, 0)
        self.credits_granted = self.credits_refunded = 0
        self.credit_violations = 0  # groups accepted beyond AReaL's rule (see the module docstring)
        self.credit_excess_max = -self.allowed_groups  # max over arrivals of accepted net of evicted - allowed
        self.filtered_since_batch = 0  # zero-variance evictions since the last selection (WAIT reason)
        self.max_filtered_groups = max_filtered_groups
        self.filtered_in_a_row = 0  # zero-variance evictions since the last group that passed the filter
        self.last_staleness: list[int] = []
        self.logged_below: int | None = None  # groups with seq >= this are not in the log yet: not handed out
        self.bound_moves = False  # the learners announce max_staleness (announce_bound): resume restores it
        self.bias = BiasMonitor(group_size)  # what is issued, generated, trained, evicted (distrl.buffer.bias)

    # ---- PUT: the intake's, and where it holds the groups of a PUT -----------------------------

    def put(self, group: pa.Table | pa.RecordBatch, persist: Persist | None = None,
            nbytes: int | None = None) -> tuple[int, bool]:
        """Accept one whole group: :meth:`Intake.put`."""
        return self.intake.put(group, persist, nbytes)

    def put_groups(self, groups: pa.Table | pa.RecordBatch, persist: Persist | None = None,
                   nbytes: int | None = None) -> list[tuple[int, bool]]:
        """Accept one or more whole groups: :meth:`Intake.put_groups`."""
        return self.intake.put_groups(groups, persist, nbytes)

    def put_messages(self, puts: list[tuple[pa.RecordBatch, Persist | None, int | None]]
                     ) -> list[list[tuple[int, bool]] | Exception]:
        """Several PUTs, each answered on its own: :meth:`Intake.put_messages`."""
        return self.intake.put_messages(puts)

    def restore(self, group: pa.Table | pa.RecordBatch, seq: int, uses: int = 0) -> None:
        """Re-admit one group read back from the segment log: :meth:`Intake.restore`."""
        self.intake.restore(group, seq, uses)

    def acked_groups(self, actor_id: int) -> int:
        """Groups of ``actor_id`` accepted so far: :meth:`Intake.acked_groups`."""
        return self.intake.acked_groups(actor_id)

    def actor_ids(self) -> list[int]:
        """The actor ids whose groups were accepted (or restored from the log)."""
        return self.intake.actor_ids()

    @property
    def groups_put(self) -> int:
        """Groups accepted so far (the seq of the next one)."""
        return self.intake.groups_put

    @property
    def duplicates(self) -> int:
        """Re-sent groups dropped so far."""
        return self.intake.duplicates

    def fits(self, rows: int, nbytes: int) -> bool:
        return ((self.max_rows is None or self.rows + rows <= self.max_rows)
                and (self.max_bytes is None or self.bytes + nbytes <= self.max_bytes))

    def check_room(self, rows: int, nbytes: int) -> None:
        if not self.fits(rows, nbytes):
            self.refused_full += 1
            raise BufferFull(f"buffer full: {self.rows} of max_rows={self.max_rows} completions and {self.bytes} "
                             f"of max_bytes={self.max_bytes} bytes held; retry once the learners consume "
                             f"(or raise --max_rows / --max_bytes)")

    def admit(self, parents: list[pa.RecordBatch], offset: np.ndarray, keep: np.ndarray, nbytes: np.ndarray,
               seq: np.ndarray, version: np.ndarray, variance: np.ndarray, uses: int,
               filtered: np.ndarray | None) -> None:
        """Hold c accepted groups, group j being rows ``offset[j] + [0, group_size)`` of ``parents[j]``
        (``keep``: (c, k), the rest (c,)); those ``filtered`` (zero variance) or already stale are evicted."""
        cell = self.bias.generated(parents, offset, seq, version, self.learner_version)
        if filtered is not None and len(filtered):
            passed = np.flatnonzero(~filtered)  # the count restarts after the last group that passed
            self.filtered_in_a_row = (len(filtered) - 1 - int(passed[-1]) if passed.size
                                      else self.filtered_in_a_row + len(filtered))
        if filtered is not None and filtered.any():
            self.filtered_since_batch += int(filtered.sum())
            self._count_eviction("zero_variance", int(filtered.sum()))
            self.bias.evicted(seq[filtered], self.learner_version)
            hold = ~filtered
            parents = [p for p, h in zip(parents, hold.tolist()) if h]
            offset, keep, seq, version, variance = offset[hold], keep[hold], seq[hold], version[hold], variance[hold]
            nbytes, cell = nbytes[hold], cell[hold]
        if not len(offset):
            return
        stamp = np.full(len(offset), -1, np.int64) if self.restamp else version
        slots = self._slots.add(parents, offset, keep, nbytes, seq, self._next_arrival, stamp, variance, uses)
        self._slots.cell[slots] = cell
        self._next_arrival += len(slots)
        self.rows += len(slots) * self.group_size
        self.bytes += int(np.add.reduce(nbytes))
        if not self.restamp and np.minimum.reduce(version) < self.learner_version - self.max_staleness:
            self._evict(slots[self.learner_version - version > self._allowance(slots)], "stale")

    # ---- leaving memory ----------------------------------------------------------------------

    def _remove(self, slots: np.ndarray) -> None:
        self.bytes -= self._slots.remove(slots)
        self.rows -= len(slots) * self.group_size

    def _evict(self, slots: np.ndarray, reason: str) -> None:
        self.bias.evicted(self._slots.seq[slots], self.learner_version)
        self._remove(slots)
        self._count_eviction(reason, len(slots))

    def _count_eviction(self, reason: str, n: int) -> None:
        self.evicted[reason] += n
        self.credits_refunded += min(n, self.credits_granted - self.credits_refunded)

    def _evict_stale(self) -> None:
        """Evict groups with ``learner_version - version`` above their allowance (never unstamped ones)."""
        live = self._slots.live()
        v = self._slots.version[live]
        stale = live[(v >= 0) & (self.learner_version - v > self._allowance(live))]
        if stale.size:
            self._evict(stale, "stale")

    def _allowance(self, slots: np.ndarray) -> np.ndarray | int:
        """The staleness each of ``slots`` may have: ``max_staleness``, plus ``bias_slack`` for a group with a
        learning signal in a cell the learners under-train (module docstring)."""
        if not self.bias_slack:
            return self.max_staleness
        cell = self._slots.cell[slots]
        starved = (cell >= 0) & self.bias.starved()[np.maximum(cell, 0)]
        return self.max_staleness + self.bias_slack * starved

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version whose groups may still be trained on: actors must run at least this."""
        return max(0, self.learner_version - self.max_staleness)

    @property
    def full(self) -> bool:
        """True when another group would not fit (credits stop)."""
        return ((self.max_rows is not None and self.rows + self.group_size > self.max_rows)
                or (self.max_bytes is not None and self.bytes >= self.max_bytes))

    def oldest_held_seq(self) -> int:
        """Smallest seq still in memory (``groups_put`` when none): older segments can be deleted."""
        live = self._slots.live()
        return int(self._slots.seq[live].min()) if live.size else self.intake.groups_put

    # ---- GET ---------------------------------------------------------------------------------

    def select(self, learner_version: int, rank: int, world_size: int) -> pa.Table | None:
        """Rank ``rank``'s shard of the selection for ``learner_version``, or None (caller replies WAIT).

        The first call for a version makes the selection; later calls (other ranks, or a retried
        request) get shards of that same selection. Raises ValueError on a bad rank or world size, or
        for a version not newer than one already selected whose selection was dropped.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if learner_version > self.learner_version:
            self.learner_version = learner_version
            self._evict_stale()
        sel = self._selections.get(learner_version)
        if sel is None:
            if learner_version <= self._last_selected:
                raise ValueError(f"version {learner_version} is not newer than version {self._last_selected}, "
                                 f"whose batch was already handed out: the learners have moved on")
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

    def selection(self, learner_version: int) -> list[pa.Table] | None:
        """All shards of the selection made for ``learner_version`` (None if none is kept)."""
        sel = self._selections.get(learner_version)
        return None if sel is None else list(sel.shards)

    def restore_selection(self, version: int, shards: list[pa.Table]) -> None:
        """Keep a selection rebuilt from the consumption log, so retried GETs for it get the same shards."""
        self.learner_version = max(self.learner_version, version)
        self._selections[version] = _Selection(version, len(shards), shards)
        self._last_selected = max(self._last_selected, version)
        self._evict_stale()

    def _eligible(self, version: int) -> np.ndarray:
        live = self._slots.live()
        if self.logged_below is not None and self.logged_below < self.intake.groups_put:  # some are not logged yet
            live = live[self._slots.seq[live] < self.logged_below]
        v = self._slots.version[live]
        return live[(v < 0) | ((v <= version) & (version - v <= self._allowance(live)))]

    def _select(self, version: int, world_size: int) -> _Selection | None:
        """Take ``batch_size`` eligible groups in ``order``, cut them to top-k and shard; None if too few."""
        s = self._slots
        candidates = self._eligible(version)
        if candidates.size < self.batch_size:
            return None
        stamps = np.where(s.version[candidates] < 0, version, s.version[candidates])
        primary, secondary = order_keys(self.order, s.arrival[candidates], stamps, s.variance[candidates])
        chosen = candidates[first_k(primary, secondary, self.batch_size)]
        s.version[chosen] = np.where(s.version[chosen] < 0, version, s.version[chosen])  # restamp: first use
        stamps, offset, keep = s.version[chosen], s.offset[chosen], s.keep[chosen]
        self.slack_trained += int(np.count_nonzero(version - stamps > self.max_staleness))
        parents = [s.parents[i] for i in chosen.tolist()]
        s.uses[chosen] += 1
        used_up = s.uses[chosen] >= self.replay_ratio
        self.bias.trained(s.seq[chosen], version, used_up, s.uses[chosen] == 1,
                          [p.column("group_id")[o].as_py() for p, o in zip(parents, offset.tolist())])
        again = chosen[~used_up]  # handed out again later: to the back of the queue, in this order
        s.arrival[again] = np.arange(self._next_arrival, self._next_arrival + len(again))
        self._next_arrival += len(again)
        self._remove(chosen[used_up])
        self.selections += 1
        self._last_selected = version
        self.last_staleness = np.repeat(version - stamps, keep.shape[1]).tolist()
        self.filtered_since_batch = 0
        n = self.group_size
        shards = [cut(parents[r::world_size], offset[r::world_size], keep[r::world_size], n,
                      stamps[r::world_size] if self.restamp else None) for r in range(world_size)]
        return _Selection(version, world_size, shards)

    def fresh_groups(self, learner_version: int | None = None) -> int:
        """Groups that a selection for ``learner_version`` (default: the current one) could take."""
        return int(self._eligible(self.learner_version if learner_version is None else learner_version).size)

    def check_progress(self) -> None:
        """Raise :class:`distrl.core.errors.NoProgress` (one line naming the flags) once ``max_filtered_groups``
        groups in a row were dropped by ``filter_zero_variance``: no batch may ever form. A sparse reward
        (a few groups that vary among many that do not) resets the count with each group that varies."""
        if self.max_filtered_groups and self.filtered_in_a_row >= self.max_filtered_groups:
            raise NoProgress(f"{self.max_filtered_groups} groups in a row had equal rewards and were dropped by "
                             f"--filter_zero_variance: the reward gives GRPO no signal (raise "
                             f"--max_filtered_groups, or check --reward)")

    def wait_reason(self, learner_version: int) -> str:
        """Why no batch can be made for ``learner_version`` yet, in words (for WAIT replies and logs)."""
        fresh = self.fresh_groups(learner_version)
        text = f"{fresh} of {self.batch_size} fresh groups for version {learner_version}"
        if self.filtered_since_batch:
            return (f"{text}; {self.filtered_since_batch} groups since the last batch were dropped by "
                    f"--filter_zero_variance (all their rewards were equal): if every group scores the same "
                    f"no batch can form; turn the filter off or use a reward that tells completions apart")
        live = self._slots.live()
        ahead = int((self._slots.version[live] > learner_version).sum())
        if ahead:
            return f"{text}; {ahead} held groups come from policy versions newer than {learner_version}"
        return f"{text}: waiting for actors"

    # ---- credits -----------------------------------------------------------------------------

    def grant_credits(self, want: int) -> int:
        """Grant up to ``want`` groups of generation (AReaL's rule); returns how many (>= 0).

        At most ``(learner_version + max_staleness + 1) * batch_size`` groups may have been granted,
        net of those refunded by eviction; none while memory is full. Raises ValueError if ``want`` < 0.
        """
        if want < 0:
            raise ValueError(f"want must be >= 0, got {want}")
        granted = min(want, self.open_credits())
        self.credits_granted += granted
        self.bias.issued(granted, self.learner_version)
        return granted

    def open_credits(self) -> int:
        """Credits :meth:`grant_credits` would grant now to any ``want`` (>= 0): the rule's room, 0 while full."""
        return 0 if self.full else max(0, self.allowed_groups - (self.credits_granted - self.credits_refunded))

    def refund_credits(self, n: int) -> int:
        """Give back ``n`` granted credits that will never be PUT (a client that restarted or left, a lost
        reply, an actor gone silent); returns how many were given back (never more than are in play)."""
        n = max(0, min(n, self.credits_granted - self.credits_refunded))
        self.credits_refunded += n
        return n

    def check_rule(self, net: int) -> None:
        """AReaL's rule at arrival: count the groups just held (those accepted and not evicted on arrival; the
        groups accepted net of evicted ones were ``net`` before them) that lie beyond it. Counted per group in
        arrival order, so one PUT of many groups counts as one PUT each."""
        now = self.intake.groups_put - sum(self.evicted.values())
        excess = now - self.allowed_groups
        if excess > self.credit_excess_max:
            self.credit_excess_max = excess
        if excess > 0:
            self.credit_violations += min(now - net, excess)

    @property
    def allowed_groups(self) -> int:
        """AReaL's bound on groups generated from the start, net of evicted ones (and on credits granted,
        net of refunds): ``(learner_version + max_staleness + 1) * batch_size``."""
        return (self.learner_version + self.max_staleness + 1) * self.batch_size

    def announce_bound(self, max_staleness: int) -> None:
        """Set the staleness bound in force from now on (learners that move it announce it with their GET,
        ``--max_staleness auto``). Raises ValueError if it is negative.

        Lowering it never strands an actor: groups held that the new bound makes stale are evicted at once and
        their credits refunded, groups PUT later under credits granted at the higher bound are held if the new
        bound admits them and evicted (refunded) if not, and no new credit is granted until the groups in play
        fit the new rule, which the learners' next versions make room for.
        """
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.bound_moves = True
        lowered, self.max_staleness = max_staleness < self.max_staleness, max_staleness
        if lowered:
            self._evict_stale()

    # ---- stats -------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float | bool | list[int]]:
        """Counters: rows/groups/bytes held now, totals since start, and the last selection's staleness."""
        stats = {
            "rows": self.rows, "groups": int(self._slots.alive.sum()), "bytes": self.bytes,
            "groups_put": self.groups_put, "duplicates": self.duplicates, "refused_full": self.refused_full,
            "full": self.full, "credits_granted": self.credits_granted, "credits_refunded": self.credits_refunded,
            "learner_version": self.learner_version, "min_policy_version": self.min_policy_version,
            "selections": self.selections, "last_staleness": list(self.last_staleness),
            "filtered_in_a_row": self.filtered_in_a_row, "credits_allowed": self.allowed_groups,
            "credit_violations": self.credit_violations, "credit_excess_max": self.credit_excess_max,
            "max_staleness": self.max_staleness, "slack_trained": self.slack_trained,
            "bias": self.bias.summary(),
        }
        stats.update({f"evicted_{reason}": n for reason, n in self.evicted.items()})
        return stats
