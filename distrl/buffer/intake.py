"""How groups come into the buffer: the PUT side of :class:`distrl.buffer.store.GroupStore`, which owns one
:class:`Intake` (``store.intake``) and hands it its PUTs.

A PUT carries one or more whole groups (consecutive runs of ``group_size`` rows of
:data:`distrl.core.rows.COMPLETION_SCHEMA`), validated and parsed at once
(:func:`distrl.buffer.groups.parse_groups`: each group's top-k rows and reward variance are computed on arrival). Each
accepted group gets the next sequence number ``seq``, its position in the segment log; ``persist(batch,
first_seq)`` (e.g. ``SegmentLog.append``) gets the new groups after every check and before anything is
committed, so a failed write changes nothing.

A client re-sends a PUT whose ACK it lost. A group whose sample ids were all accepted before is a
*duplicate*: answered with its original seq and counted, not held twice (ids are remembered for at least
the last ``dedup_window`` accepted, :class:`distrl.buffer.groups.RecentIds`); one that mixes seen and unseen ids is
refused. The server hands :meth:`Intake.put_messages` every PUT queued at one poll: admitted together when
they can be, else one at a time, with the same answers either way.

Groups read back from the segment log re-enter through :meth:`Intake.restore` (resume, replay). The groups
accepted per actor id (:meth:`Intake.acked_groups`) tell a restarted actor where to resume.

Where the groups go is the store's (:class:`Holding`, what the intake may ask of it): its memory bounds
(``fits``; ``check_room`` raises :class:`distrl.buffer.store.BufferFull`), holding them (``admit``, which evicts
the filtered and the already stale) and AReaL's rule at arrival (``check_rule``).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

import numpy as np
import pyarrow as pa

from distrl.buffer.groups import Parsed, RecentIds, as_batch, parse_groups, rows_of
from distrl.core.rows import COMPLETION_SCHEMA

DEDUP_WINDOW = 1 << 20  # sample ids: a client's retries end within minutes (30 s x 6 sends by default)

Persist = Callable[[pa.RecordBatch, int], None]  # (new groups, seq of the first) -> None


class Holding(Protocol):
    """What :class:`Intake` reads of the store it feeds, and how it hands groups over (GroupStore is one)."""

    group_size: int
    topk: int
    topk_by: str
    filter_zero_variance: bool
    replay_ratio: int
    evicted: dict[str, int]  # evictions by reason: accepted groups net of them count against AReaL's rule
    credits_granted: int  # a restored group counts as one credit granted

    def fits(self, rows: int, nbytes: int) -> bool: ...

    def check_room(self, rows: int, nbytes: int) -> None: ...

    def admit(self, parents: list[pa.RecordBatch], offset: np.ndarray, keep: np.ndarray, nbytes: np.ndarray,
              seq: np.ndarray, version: np.ndarray, variance: np.ndarray, uses: int,
              filtered: np.ndarray | None) -> None: ...

    def check_rule(self, net: int) -> None: ...


class Intake:
    """The PUT side of a store (see the module docstring): GroupStore owns one and hands it its PUTs.

    It owns the de-duplication memory, the seq counter, the groups accepted per actor id and the count of
    duplicates; what it accepts goes to ``store`` (:class:`Holding`).

    Args:
        store: where accepted groups are held (:class:`Holding`).
        dedup_window: sample ids remembered to drop re-sent PUTs: at least the last this many accepted
            (:class:`distrl.buffer.groups.RecentIds`). Raises ValueError if < 1.
    """

    def __init__(self, store: Holding, dedup_window: int = DEDUP_WINDOW) -> None:
        self.store = store
        self._seen = RecentIds(dedup_window)  # sample_id -> seq of the group that brought it
        self._next_seq = 0  # the seq of the next group accepted
        self._acked: Counter[int] = Counter()  # actor id -> groups of it accepted (or restored from the log)
        self.duplicates = 0

    def put(self, group: pa.Table | pa.RecordBatch, persist: Persist | None = None,
            nbytes: int | None = None) -> tuple[int, bool]:
        """Accept one whole group; returns ``(seq, duplicate)``. See :meth:`put_groups`."""
        return self.put_groups(self._one_group(group), persist, nbytes)[0]

    def put_groups(self, groups: pa.Table | pa.RecordBatch, persist: Persist | None = None,
                   nbytes: int | None = None) -> list[tuple[int, bool]]:
        """Accept one or more whole groups (consecutive runs of ``group_size`` rows); returns ``(seq,
        duplicate)`` per group, in order.

        A group whose sample ids were all accepted before is a duplicate: dropped, counted, answered
        with its original seq. ``persist(batch, first_seq)`` (e.g. ``SegmentLog.append``) gets the new
        groups after validation and the duplicate and room checks, before anything is committed: if it
        raises, nothing changes. A group already stale, or filtered, is committed (and persisted) but
        evicted. ``nbytes``: the memory the batch holds, if known (the received message's size).
        Raises ValueError if the rows are not valid whole groups (nothing is accepted then),
        BufferFull if the new groups do not all fit in memory.
        """
        batch = as_batch(groups)
        g = parse_groups(batch, self.store.group_size, self.store.topk, self.store.topk_by)
        n, m = self.store.group_size, len(g.group_ids)
        results = None if self._seen.isdisjoint(g.sample_ids) else self._known(g)  # usually None
        new = m if results is None else m - sum(r is not None for r in results)
        size = (batch.get_total_buffer_size() if nbytes is None else nbytes) // m
        offset = np.arange(0, m * n, n)  # each group's first row
        if new < m:  # keep the new groups only
            index = np.array([i for i, r in enumerate(results) if r is None], np.intp)
            g = g._replace(versions=g.versions[index], keep=g.keep[index], variance=g.variance[index],
                           actors=g.actors[index],
                           sample_ids=[s for i in index.tolist() for s in g.sample_ids[i * n:(i + 1) * n]])
            offset = index * n
        filtered = g.variance == 0.0 if self.store.filter_zero_variance else None
        held = new if filtered is None else new - int(filtered.sum())
        self.store.check_room(held * n, held * size)
        self.duplicates += m - new
        persisted = rows_of(batch, index.tolist(), n) if 0 < new < m else batch  # nothing is persisted if new == 0
        seqs = self._accept(g, [batch] * new, offset, np.full(new, size), filtered, [(persist, persisted, new)])
        if results is None:
            return list(zip(seqs.tolist(), [False] * m))
        fresh = iter(seqs.tolist())
        return [(next(fresh), False) if r is None else r for r in results]

    def put_messages(self, puts: list[tuple[pa.RecordBatch, Persist | None, int | None]]
                     ) -> list[list[tuple[int, bool]] | Exception]:
        """:meth:`put_groups` for several PUTs ``(batch, persist, nbytes)``, in order, each answered on its
        own: its ``(seq, duplicate)`` list, or the exception it raised (ValueError, BufferFull; nothing of
        that PUT is accepted). The answers and the held groups are what one ``put_groups`` per PUT gives
        (only the de-duplication memory may turn a generation over at another point); when every PUT
        holds only new, valid whole groups and all fit, they are checked and admitted together (one
        parse, one de-duplication check, one admission: the server hands it the PUTs queued at one poll,
        and per-PUT Python overhead was most of its ingest cost), else one at a time. ``persist`` must
        not raise (the server's appends to a list): a later PUT's failure could not undo an earlier's.
        """
        together = self._put_together(puts) if len(puts) > 1 else None
        if together is not None:
            return together
        out: list[list[tuple[int, bool]] | Exception] = []
        for batch, persist, nbytes in puts:
            try:
                out.append(self.put_groups(batch, persist, nbytes))
            except Exception as exc:  # noqa: BLE001 - the caller answers each PUT with its own error
                out.append(exc)
        return out

    def _put_together(self, puts: list[tuple[pa.RecordBatch, Persist | None, int | None]]
                      ) -> list[list[tuple[int, bool]]] | None:
        """:meth:`put_messages`'s joint path; None (nothing changed) where one PUT at a time is needed: a PUT
        that is not whole valid groups, a sample id seen before or repeated across PUTs, no room."""
        n = self.store.group_size
        batches = [b for b, _, _ in puts]
        if not all(isinstance(b, pa.RecordBatch) and b.num_rows and not b.num_rows % n for b in batches):
            return None
        try:  # a table over the PUTs' batches: zero-copy; a PUT's groups never straddle two of them
            g = parse_groups(pa.Table.from_batches(batches), n, self.store.topk, self.store.topk_by)
        except (ValueError, pa.ArrowException):
            return None
        if not self._seen.isdisjoint(g.sample_ids):
            return None
        counts = [b.num_rows // n for b in batches]
        sizes = np.repeat([(b.get_total_buffer_size() if nb is None else nb) // c
                           for (b, _, nb), c in zip(puts, counts)], counts)
        filtered = g.variance == 0.0 if self.store.filter_zero_variance else None
        held = sizes if filtered is None else sizes[~filtered]
        if not self.store.fits(len(held) * n, int(np.add.reduce(held))):
            return None
        offset = np.concatenate([np.arange(0, c * n, n) for c in counts])
        parents = [b for b, c in zip(batches, counts) for _ in range(c)]
        seqs = self._accept(g, parents, offset, sizes, filtered,
                            [(persist, b, c) for (b, persist, _), c in zip(puts, counts)]).tolist()
        out, start = [], 0
        for c in counts:
            out.append([(seq, False) for seq in seqs[start:start + c]])
            start += c
        return out

    def _accept(self, g: Parsed, parents: list[pa.RecordBatch], offset: np.ndarray, sizes: np.ndarray,
                filtered: np.ndarray | None, persists: list[tuple[Persist | None, pa.RecordBatch, int]]
                ) -> np.ndarray:
        """Commit the checked new groups of ``g`` ((c,) each, group j being rows ``offset[j] + [0, n)`` of
        ``parents[j]``, holding ``sizes[j]`` bytes): ``persist(batch, first_seq)`` per message (``batch``
        of ``count`` groups) in order, before anything changes; then seqs, seen sample ids and slots.
        Returns the (c,) seqs."""
        first = seq = self._next_seq
        net = first - sum(self.store.evicted.values())  # groups accepted net of evicted ones, before these
        for persist, batch, count in persists:
            if persist is not None and count:
                persist(batch, seq)
            seq += count
        self._next_seq = seq
        seqs = np.arange(first, seq)
        if len(seqs):  # an empty update would still turn a full generation of RecentIds over
            self._seen.update(zip(g.sample_ids, np.repeat(seqs, self.store.group_size).tolist()))
            self._acked.update(g.actors.tolist())
        self.store.admit(parents, offset, g.keep, sizes, seqs, g.versions, g.variance, 0, filtered)
        self.store.check_rule(net)
        return seqs

    def _known(self, g: Parsed) -> list[tuple[int, bool] | None]:
        """Per group of ``g``: ``(seq, True)`` if all its sample ids were accepted before with that group,
        None if none was. Raises ValueError for a group that mixes seen and unseen sample ids, or those
        of several groups."""
        n, results = self.store.group_size, []
        for i, group_id in enumerate(g.group_ids):
            known = {self._seen.get(s) for s in g.sample_ids[i * n:(i + 1) * n]}
            if known == {None}:
                results.append(None)
            elif len(known) == 1:
                results.append((known.pop(), True))
            else:
                raise ValueError(f"group {group_id!r} reuses sample ids of accepted groups (seq "
                                 f"{sorted(s for s in known if s is not None)}) but is not one of them")
        return results

    def restore(self, group: pa.Table | pa.RecordBatch, seq: int, uses: int = 0) -> None:
        """Re-admit one group read back from the segment log (resume, replay); no persist, no dedup count.

        It counts as produced (one credit granted); its sample ids become seen (a log may hold a group
        twice, re-sent after the de-duplication window forgot it: the later one counts); it is held
        unless it was already used ``replay_ratio`` times or is filtered. Raises ValueError if it is
        not a valid group, BufferFull if memory is full.
        """
        batch = self._one_group(group)
        g = parse_groups(batch, self.store.group_size, self.store.topk, self.store.topk_by)
        self._seen.update(dict.fromkeys(g.sample_ids, seq))
        self._next_seq = max(self._next_seq, seq + 1)
        self.store.credits_granted += 1
        self._acked.update(g.actors.tolist())
        if uses >= self.store.replay_ratio:
            return
        size = batch.get_total_buffer_size()
        filtered = np.array([self.store.filter_zero_variance and g.variance[0] == 0.0])
        if not filtered[0]:
            self.store.check_room(batch.num_rows, size)
        self.store.admit([batch], np.zeros(1, np.int64), g.keep, np.array([size]), np.array([seq]), g.versions,
                    g.variance, uses, filtered)

    def _one_group(self, group: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
        """``group`` as one record batch; ValueError unless it has ``group_size`` rows (or another schema,
        which :func:`distrl.buffer.groups.parse_groups` then names)."""
        batch = as_batch(group)
        if batch.schema.equals(COMPLETION_SCHEMA) and batch.num_rows != self.store.group_size:
            raise ValueError(f"a group must have group_size={self.store.group_size} rows, got {batch.num_rows}")
        return batch

    def acked_groups(self, actor_id: int) -> int:
        """Groups of ``actor_id`` accepted so far, those restored from the log included (duplicates not
        counted): where that actor, restarted, resumes its prompt stream."""
        return self._acked[actor_id]

    def actor_ids(self) -> list[int]:
        """The actor ids whose groups were accepted (or restored from the log)."""
        return list(self._acked)

    @property
    def groups_put(self) -> int:
        """Groups accepted so far (the seq of the next one)."""
        return self._next_seq
