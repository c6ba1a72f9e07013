"""Rebuilding a buffer's memory from its logs: `distrl buffer --resume` and offline replay.

Resume (``use_consumed=True``): every complete group of the segment log is restored with the number
of times the consumption log says it was handed out; groups used ``replay_ratio`` times stay out of
memory (so, by default, consumed groups are not served again), the others are served again. Their
sample ids all count as seen, so a PUT that an actor re-sends after the restart is a duplicate. The
last selection, if every one of its shards was recorded, is kept, so a learner that retries its GET
gets the same shards; the learner version resumes from it. Replay (``use_consumed=False``) starts
every group unused.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa

from distrl.buffer.segments import CONSUMED_FILE, read_consumed, read_groups
from distrl.buffer.store import GroupStore


def _last_selection(records: list[dict]) -> tuple[int | None, list[dict]]:
    """(version, per-rank records) of the newest selection whose every shard was recorded."""
    if not records:
        return None, []
    last = max(r["learner_version"] for r in records)
    shards = {r["rank"]: r for r in records if r["learner_version"] == last}
    world_size = next(iter(shards.values())).get("world_size", 1)
    if set(shards) != set(range(world_size)):
        return None, []  # a crash while the selection was written: no shard of it was sent
    return last, [shards[rank] for rank in range(world_size)]


def roll_back_consumed(directory: str | os.PathLike, until_version: int) -> int:
    """Drop the consumption records of versions > ``until_version`` (a learner that crashed after its
    last checkpoint never finished training on them): ``consumed.jsonl`` is rewritten through a
    temporary file and a rename, the dropped lines appended to ``consumed.rolled_back.jsonl``.
    Returns how many records were dropped (0 leaves the files untouched)."""
    path = Path(directory) / CONSUMED_FILE
    records = read_consumed(directory)
    keep = [r for r in records if r["learner_version"] <= until_version]
    dropped = [r for r in records if r["learner_version"] > until_version]
    if not dropped:
        return 0
    with open(path.with_name("consumed.rolled_back.jsonl"), "a", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in dropped)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
    os.replace(tmp, path)
    return len(dropped)


def restore_store(store: GroupStore, directory: str | os.PathLike, use_consumed: bool = True,
                  until_version: int | None = None) -> dict:
    """Load every complete group of the log under ``directory`` into ``store`` (see the module docstring).

    ``until_version``: the learners resume from this version's checkpoint, so selections made for
    later versions are rolled back first (:func:`roll_back_consumed`) and their groups served again.
    Returns ``{"groups": groups read, "held": groups now in memory, "consumed": groups used at least
    once, "learner_version": version resumed from, "rolled_back": consumption records dropped}``.
    Raises ValueError on a corrupt log (another schema, an invalid group),
    distrl.buffer.store.BufferFull if the held groups exceed the bounds.
    """
    rolled_back = 0
    if use_consumed and until_version is not None:
        rolled_back = roll_back_consumed(directory, until_version)
    records = read_consumed(directory) if use_consumed else []
    version, last = _last_selection(records)
    if version is None:  # drop a half-written last selection: its groups were never handed out
        newest = max((r["learner_version"] for r in records), default=None)
        records = [r for r in records if r["learner_version"] != newest]
    bounds = [r["max_staleness"] for r in records if "max_staleness" in r]
    if bounds and store.bound_moves:  # the bound in force at the last selection (a moving one, --max_staleness auto)
        store.announce_bound(bounds[-1])
    uses = Counter(gid for rec in records for gid in rec["group_ids"])
    needed = {gid for rec in last for gid in rec["group_ids"]}
    pool: list[pa.Table] = []
    groups = 0
    for seq, group in read_groups(directory):
        group_id = group.column("group_id")[0].as_py()
        store.restore(group, seq, uses.get(group_id, 0))
        if group_id in needed:
            pool.append(group)
        groups += 1
    if version is not None and pool:
        table = pa.concat_tables(pool)
        index = {sid: i for i, sid in enumerate(table.column("sample_id").to_pylist())}
        if all(s in index for rec in last for s in rec["sample_ids"]):  # else retention deleted a segment
            store.restore_selection(version, [table.take([index[s] for s in rec["sample_ids"]]) for rec in last])
    return {"groups": groups, "held": store.stats()["groups"], "consumed": len(uses),
            "learner_version": store.learner_version, "rolled_back": rolled_back}
