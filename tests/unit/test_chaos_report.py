"""bench/chaos_report.py on a crafted run directory: acked ids missing from the log are lost, ids in more kept
selections than --replay_ratio are trained twice (rolled-back selections do not count), decreases of the kept
versions are counted, and logged groups neither trained nor held are stale evictions by rule."""

from __future__ import annotations

import json

from bench.chaos_report import chaos_report, passed
from distrl.buffer.segments import SegmentLog
from tests.helpers import make_group


def _write_run(run_dir, groups: dict[str, int], kept: list[tuple[int, list[str]]],
               rolled_back: list[tuple[int, list[str]]], buffer: dict) -> None:
    log = SegmentLog(run_dir, fsync="never")
    for seq, (gid, version) in enumerate(groups.items()):
        log.append(make_group(gid, policy_version=version, group_size=2), seq)
    log.close()
    for name, records in (("consumed.jsonl", kept), ("consumed.rolled_back.jsonl", rolled_back)):
        (run_dir / name).write_text("".join(json.dumps({"learner_version": v, "rank": 0, "world_size": 1,
                                                        "group_ids": ids}) + "\n" for v, ids in records))
    (run_dir / "summary.json").write_text(json.dumps({"interrupted": True, "buffer": buffer}))
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "learner0.log").write_text(
        "2026-12-05 08:39:36,953 distrl.learner WARNING learner0: learner version 1 quarantined group d of actor 0 "
        "stamped version 1: version 1: digest xxh3_128:3e374d6134a, published xxh3_128:a2be5a826cd\n")


def test_report_of_a_crafted_run(tmp_path):
    groups = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 0, "f": 3, "g": 4}
    # versions 0, 1, 2, then 1 again (backwards), 3; "c" twice in kept selections; "e" only in a rolled-back one
    kept = [(0, ["a", "b"]), (1, ["c", "d"]), (2, ["c"]), (1, ["a"]), (3, ["f"])]
    _write_run(tmp_path, groups, kept, rolled_back=[(4, ["e", "g"]), (5, ["g"])],
               buffer={"groups": 1, "evicted_stale": 1, "learner_version": 4})
    events = [{"event": "kill", "kind": k} for k in ("actor", "actor", "learner", "buffer", "node")]
    events += [{"event": "resume"}] * 3 + [{"event": "acked", "ids": ["a", "b", "e"]},
                                           {"event": "acked", "ids": ["b", "g", "lost1", "lost2"]}]
    r = chaos_report(tmp_path, events, replay_ratio=1, max_staleness=1)
    assert r["kills"] == {"actor": 2, "learner": 1, "buffer": 1, "node": 1} and r["kills_total"] == 5
    assert r["resumes"] == 3 and r["versions_reached"] == 3
    assert (r["acked"], r["acked_lost"], r["acked_lost_ids"]) == (6, 2, ["lost1", "lost2"])
    # "a" is in versions 0 and 1, "c" in 1 and 2: both beyond --replay_ratio 1
    assert (r["trained_twice"], r["trained_twice_ids"]) == (2, ["a", "c"])
    assert (r["versions_backwards"], r["versions_repeated"]) == (1, 0)
    # "d" was handed out at version 1 but quarantined by the learner: not trained, not lost
    assert (r["groups_logged"], r["groups_logged_twice"], r["trained"]) == (7, 0, 4)
    assert (r["quarantined"], r["quarantined_acked"]) == (1, 0)
    assert (r["selections_kept"], r["selections_rolled_back"], r["rolled_back_records"]) == (4, 2, 2)
    # untrained: "e" (version 0 < 4 - 1: stale) and "g" (version 4: held), as the buffer's own counts say
    assert (r["held_derived"], r["held_reported"]) == (1, 1)
    assert (r["evicted_stale_derived"], r["evicted_stale_reported"]) == (1, 1)
    assert not passed(r)
    # --replay_ratio 2 allows both reuses; "a" and "c" are then still held (one use left) unless stale
    r2 = chaos_report(tmp_path, events[:-1], replay_ratio=2, max_staleness=1)
    assert r2["trained_twice"] == 0 and r2["acked_lost"] == 0
    assert r2["held_derived"] == 2  # "f" (version 3, one use left) and "g"; "b", "d", "e" are stale at version 4
