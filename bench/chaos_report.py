"""bench/chaos.py's report: what a chaos run lost or trained twice, read from the run's own logs.

Inputs, all written by the run except the bench's event list:

- the segment log (``segments/``, :func:`distrl.buffer.segments.read_groups`): every group the buffer logged, with
  its ``policy_version``. In the driver's run directory this is the replica of buffer0's log (docs/multinode.md,
  "Losing a node"), complete at the end of the run;
- ``consumed.jsonl``: the *kept* selections (a resume moves those after the learners' checkpoint to
  ``consumed.rolled_back.jsonl``, docs/design.md: their groups are served again and do not count as trained);
- ``summary.json`` of the last segment (its ``buffer`` stats: groups still held, ``evicted_stale``,
  ``learner_version``);
- the bench's events (``kill``, ``resume``, ``acked``: the group ids the logs held at the end of each segment,
  before the next resume; see :mod:`bench.chaos`).

What counts (issue 41's definitions):

- ``acked_lost``: acknowledged ids that are not in the final log, or in it but neither trained (in a kept
  selection), still held, nor evicted with a reason. The buffer logs no eviction per group: a group is evicted as
  stale by rule when ``policy_version < learner_version - max_staleness`` at the end (``learner_version``: the
  buffer's, from summary.json), and the derived counts of held and stale groups are set beside the buffer's own
  (``held_reported``, ``evicted_stale_reported``: a resumed buffer evicts the stale groups it reads back again,
  so the last segment's count covers the whole log).
- ``quarantined``: ids a learner left out of a batch as made with other weights than their stamp says (its
  ``quarantined group`` warnings): in a kept selection, so handed out, but not trained (``trained`` leaves them
  out); a logged reason, not counted as lost.
- ``trained_twice``: ids in more kept selections (distinct learner versions) than ``replay_ratio``.
- ``versions_backwards``: decreases of ``learner_version`` from one kept rank-0 record to the next
  (``versions_repeated``: the same version twice in a row, a second selection for one version).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from distrl.buffer.segments import read_consumed, read_groups

KINDS = ("actor", "learner", "buffer", "node")
SHOWN_IDS = 20  # ids listed per finding in the report


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (empty when it does not exist; a half-written last line is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def logged_groups(run_dir: Path) -> tuple[dict[str, int], int]:
    """``({group id: policy_version}, groups logged more than once)`` of the segment log under ``run_dir``."""
    versions: dict[str, int] = {}
    twice = 0
    for _, group in read_groups(run_dir):
        gid = group.column("group_id")[0].as_py()
        twice += gid in versions
        versions[gid] = group.column("policy_version")[0].as_py()
    return versions, twice


QUARANTINED = re.compile(r"quarantined group (\S+) of actor")


def quarantined_ids(run_dir: Path) -> set[str]:
    """Group ids a learner left out of its batch as served with other weights than stamped (its warnings in
    ``logs/learner<r>.log``, distrl.weights.attest): handed out, not trained."""
    return {m.group(1) for path in sorted((run_dir / "logs").glob("learner*.log"))
            for m in QUARANTINED.finditer(path.read_text(errors="replace"))}


def version_steps(records: list[dict]) -> tuple[int, int]:
    """``(decreases, repeats)`` of ``learner_version`` over the rank-0 records, in file order."""
    seq = [r["learner_version"] for r in records if r.get("rank", 0) == 0]
    return (sum(b < a for a, b in zip(seq, seq[1:])), sum(b == a for a, b in zip(seq, seq[1:])))


def trained_counts(records: list[dict]) -> Counter:
    """How many distinct learner versions' kept selections hold each group id."""
    per_version: dict[int, set[str]] = {}
    for r in records:
        per_version.setdefault(r["learner_version"], set()).update(r["group_ids"])
    return Counter(g for ids in per_version.values() for g in ids)


def classify(logged: dict[str, int], uses: Counter, replay_ratio: int, max_staleness: int,
             learner_version: int) -> dict[str, set[str]]:
    """Each logged id as ``trained`` (used at least once), ``held`` (uses left, within the staleness bound at
    ``learner_version``) or ``evicted_stale`` (uses left, beyond it); trained ids with uses left are held too."""
    out: dict[str, set[str]] = {"trained": set(), "held": set(), "evicted_stale": set()}
    for gid, version in logged.items():
        if uses[gid]:
            out["trained"].add(gid)
        if uses[gid] < replay_ratio:
            stale = version < learner_version - max_staleness
            out["evicted_stale" if stale else "held"].add(gid)
    return out


def chaos_report(run_dir: str | Path, events: list[dict], replay_ratio: int = 1, max_staleness: int = 1) -> dict:
    """The chaos run's numbers (see the module docstring) from ``run_dir`` (the driver's run directory after the
    last segment) and the bench's ``events``."""
    run_dir = Path(run_dir)
    kept = read_consumed(run_dir)
    rolled_back = read_jsonl(run_dir / "consumed.rolled_back.jsonl")
    logged, logged_twice = logged_groups(run_dir)
    uses = trained_counts(kept)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    buffer = summary.get("buffer") or {}
    newest = max((r["learner_version"] for r in kept), default=0)
    learner_version = buffer.get("learner_version", newest)
    kinds = classify(logged, uses, replay_ratio, max_staleness, learner_version)
    quarantined = quarantined_ids(run_dir)
    acked = {g for e in events if e.get("event") == "acked" for g in e["ids"]}
    lost = sorted(acked - set(logged))
    twice = sorted(g for g, n in uses.items() if n > replay_ratio)
    backwards, repeated = version_steps(kept)
    kills = Counter(e["kind"] for e in events if e.get("event") == "kill")

    def count(what: str) -> int:
        return sum(e.get("event") == what for e in events)

    return {
        "kills": {k: kills.get(k, 0) for k in KINDS}, "kills_total": sum(kills.values()),
        "resumes": count("resume"),
        "versions_reached": newest,
        "acked": len(acked), "acked_lost": len(lost), "acked_lost_ids": lost[:SHOWN_IDS],
        "trained_twice": len(twice), "trained_twice_ids": twice[:SHOWN_IDS],
        "versions_backwards": backwards, "versions_repeated": repeated,
        "groups_logged": len(logged), "groups_logged_twice": logged_twice,
        "trained": len(kinds["trained"] - quarantined), "quarantined": len(quarantined),
        "quarantined_acked": len(quarantined & acked), "selections_kept": len({r["learner_version"] for r in kept}),
        "selections_rolled_back": len({r["learner_version"] for r in rolled_back}),
        "rolled_back_records": len(rolled_back),
        "held_derived": len(kinds["held"]), "held_reported": buffer.get("groups"),
        "evicted_stale_derived": len(kinds["evicted_stale"]), "evicted_stale_reported": buffer.get("evicted_stale"),
        "learner_version_end": learner_version,
        "stalls": count("stall"), "stuck_segments": count("stuck"), "kills_skipped": count("kill_skipped"),
    }


def passed(report: dict, min_kills: int = 15, min_each: int = 3) -> bool:
    """Issue 41's acceptance of one chaos run."""
    return (report["kills_total"] >= min_kills and min(report["kills"].values()) >= min_each
            and report["acked_lost"] == 0 and report["trained_twice"] == 0 and report["versions_backwards"] == 0)
