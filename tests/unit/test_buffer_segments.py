"""The segment log (Arrow IPC stream, fsync policies, rotation, retention), the consumption log and
the lineage reader, on real files."""

import shutil
import subprocess

import pyarrow as pa
import pytest

from distrl.buffer import segments
from distrl.buffer.segments import (
    ConsumptionLog,
    SegmentLog,
    groups_by_actor,
    lineage,
    read_consumed,
    read_groups,
    read_segments,
    segment_paths,
)
from distrl.core.rows import COMPLETION_SCHEMA
from tests.helpers import make_group


def write(log: SegmentLog, groups, first_seq: int = 0) -> None:
    for i, g in enumerate(groups):
        log.append(g, first_seq + i)


def test_segments_read_back_in_order(tmp_path):
    groups = [make_group(f"g{i}", policy_version=i) for i in range(3)]
    log = SegmentLog(tmp_path)
    write(log, groups)
    log.commit()
    assert read_segments(tmp_path).equals(pa.concat_tables(groups))  # readable before close (crash)
    log.close()
    assert read_segments(tmp_path).equals(pa.concat_tables(groups))
    assert read_segments(tmp_path / "segments").equals(pa.concat_tables(groups))  # the segments dir itself
    assert [p.name for p in segment_paths(tmp_path)] == ["segment-00000.arrow"]
    assert [(seq, g.column("group_id")[0].as_py()) for seq, g in read_groups(tmp_path)] == [(0, "g0"), (1, "g1"),
                                                                                             (2, "g2")]


def test_empty_run_dir_reads_empty_table(tmp_path):
    table = read_segments(tmp_path)
    assert table.num_rows == 0 and table.schema.equals(COMPLETION_SCHEMA)


def test_truncated_last_message_is_skipped(tmp_path):
    log = SegmentLog(tmp_path)
    write(log, [make_group("a"), make_group("b")])
    size_two = log.path.stat().st_size
    log.append(make_group("c"), 2)
    log.close()
    full = log.path.read_bytes()
    for cut in (size_two + 5, len(full) - 40):  # a crash in the middle of writing "c"
        log.path.write_bytes(full[:cut])
        assert set(read_segments(tmp_path).column("group_id").to_pylist()) == {"a", "b"}
    log.path.write_bytes(full[:3])  # a crash while writing the schema
    assert read_segments(tmp_path).num_rows == 0


def test_restart_opens_a_new_segment_and_keeps_the_old(tmp_path):
    first = SegmentLog(tmp_path)
    first.append(make_group("a"), 0)
    first.close()
    second = SegmentLog(tmp_path, first_seq=1)
    second.append(make_group("b"), 1)
    second.close()
    assert second.path.name == "segment-00001.arrow"
    assert read_segments(tmp_path).column("group_id").to_pylist() == ["a"] * 4 + ["b"] * 4
    with pytest.raises(ValueError, match="expects seq 2"):
        SegmentLog(tmp_path, first_seq=2).append(make_group("c"), 5)


@pytest.mark.parametrize("policy, fsyncs_per_append, fsyncs_per_commit", [("always", 1, 0), ("batch", 0, 1),
                                                                           ("never", 0, 0)])
def test_fsync_policy(tmp_path, monkeypatch, policy, fsyncs_per_append, fsyncs_per_commit):
    calls = []
    real_sync = segments._sync
    monkeypatch.setattr(segments, "_sync", lambda fd: (calls.append(fd), real_sync(fd)))
    log = SegmentLog(tmp_path, fsync=policy)
    calls.clear()
    write(log, [make_group("a"), make_group("b")])
    assert len(calls) == 2 * fsyncs_per_append
    log.commit()
    assert len(calls) == 2 * fsyncs_per_append + fsyncs_per_commit
    log.close()


def groups_by_segment(directory) -> list[list[int]]:
    """The seqs of the groups in each segment file, via each file's first_seq metadata."""
    out = []
    for path in segment_paths(directory):
        tmp = path.parent / "one" / "segments"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / path.name).write_bytes(path.read_bytes())
        out.append([seq for seq, _ in read_groups(tmp.parent)])
        (tmp / path.name).unlink()
    return out


def test_rotation_by_size_keeps_seq_numbers(tmp_path):
    log = SegmentLog(tmp_path, max_bytes=5000)  # a group is ~1.6 kB, the schema ~1.9 kB: 2 groups a file
    write(log, [make_group(f"g{i}") for i in range(6)])
    log.close()
    assert groups_by_segment(tmp_path) == [[0, 1], [2, 3], [4, 5], []]
    assert [(seq, g.column("group_id")[0].as_py()) for seq, g in read_groups(tmp_path)] == [
        (i, f"g{i}") for i in range(6)]


def test_retention_deletes_only_drained_closed_segments(tmp_path):
    log = SegmentLog(tmp_path, max_bytes=5000, retention_bytes=1)
    write(log, [make_group(f"g{i}") for i in range(5)])  # files [0, 1], [2, 3], [4] (open)
    closed = segment_paths(tmp_path)[:2]
    assert log.apply_retention(oldest_held_seq=0) == []  # g0 is still in memory: nothing goes
    assert log.apply_retention(oldest_held_seq=3) == closed[:1]  # g2 is held: the second file stays
    assert log.apply_retention(oldest_held_seq=5) == closed[1:]
    assert [seq for seq, _ in read_groups(tmp_path)] == [4] and log.deleted == 2
    log.close()
    by_age = SegmentLog(tmp_path / "age", max_bytes=5000, retention_s=60.0)
    write(by_age, [make_group(f"g{i}") for i in range(3)])
    first = segment_paths(tmp_path / "age")[0]
    assert by_age.apply_retention(oldest_held_seq=3) == []  # younger than a minute
    assert by_age.apply_retention(oldest_held_seq=3, now=1e12) == [first]
    by_age.close()
    unbounded = SegmentLog(tmp_path / "all", max_bytes=5000)
    write(unbounded, [make_group(f"g{i}") for i in range(3)])
    assert unbounded.apply_retention(oldest_held_seq=3, now=1e12) == []  # default: keep everything
    unbounded.close()


def test_consumption_log(tmp_path):
    log = ConsumptionLog(tmp_path)
    log.append(3, 1, pa.concat_tables([make_group("a", group_size=2), make_group("b", group_size=2)]), world_size=2)
    log.close()
    with open(log.path, "a") as f:
        f.write('{"learner_version": 4, "ra')  # a crash mid-line
    (record,) = read_consumed(tmp_path)
    assert (record["learner_version"], record["rank"], record["world_size"],
            record["group_ids"]) == (3, 1, 2, ["a", "b"])
    assert record["sample_ids"] == ["a/0", "a/1", "b/0", "b/1"] and record["policy_versions"] == [0, 0, 0, 0]


def test_lineage_joins_segments_and_consumption(tmp_path):
    log = SegmentLog(tmp_path)
    write(log, [make_group("a", policy_version=0, group_size=2, actor_id=3),
                make_group("b", policy_version=1, group_size=2)])
    log.close()
    consumed = ConsumptionLog(tmp_path)
    consumed.append(2, 0, make_group("b", policy_version=1, group_size=2))
    consumed.close()
    table = lineage(tmp_path)
    assert "completion_ids" not in table.column_names
    assert table.column("seq").to_pylist() == [0, 0, 1, 1]
    assert table.column("actor_id").to_pylist() == [3, 3, 0, 0]
    assert table.column("completion_tokens").to_pylist() == [3, 4, 3, 4]
    assert table.column("trained_versions").to_pylist() == [[], [], [2], [2]]
    assert table.column("staleness").to_pylist() == [[], [], [1], [1]]
    df = table.to_pandas()  # the documented pandas path (docs/buffer.md)
    assert df.groupby("policy_version")["reward"].mean().to_dict() == {0: 0.5, 1: 0.5}


def test_several_groups_in_one_append_read_back_as_groups(tmp_path):
    log = SegmentLog(tmp_path, group_size=2)
    log.append(pa.concat_tables([make_group(f"g{i}", group_size=2) for i in range(3)]), 0)
    log.append(make_group("g3", group_size=2), 3)
    log.close()
    assert [(seq, g.column("group_id").to_pylist()) for seq, g in read_groups(tmp_path)] == [
        (0, ["g0", "g0"]), (1, ["g1", "g1"]), (2, ["g2", "g2"]), (3, ["g3", "g3"])]
    legacy = SegmentLog(tmp_path / "legacy")  # no group_size: groups are runs of one group_id
    legacy.append(pa.concat_tables([make_group("a", group_size=2), make_group("b", group_size=3)]), 0)
    legacy.close()
    assert [g.num_rows for _, g in read_groups(tmp_path / "legacy")] == [2, 3]


def test_groups_by_actor_counts_every_segment_and_skips_a_truncated_group(tmp_path):
    """Per actor id, the complete groups of all segments (a restarted buffer's new segment too; a learner's
    --learner_generates groups under its negative id; old logs without group_size alike)."""
    assert groups_by_actor(tmp_path) == {}
    first = SegmentLog(tmp_path, group_size=2)
    first.append(pa.concat_tables([make_group(f"a{i}", group_size=2, actor_id=i % 2) for i in range(3)]), 0)
    first.close()
    second = SegmentLog(tmp_path, group_size=2, first_seq=3)
    second.append(make_group("b", group_size=2, actor_id=1), 3)
    second.append(make_group("c", group_size=2, actor_id=-1), 4)
    size = second.path.stat().st_size
    second.append(make_group("d", group_size=2, actor_id=1), 5)
    second.close()
    assert groups_by_actor(tmp_path) == {0: 2, 1: 3, -1: 1}
    second.path.write_bytes(second.path.read_bytes()[:size + 5])  # a crash while "d" was written
    assert groups_by_actor(tmp_path) == {0: 2, 1: 2, -1: 1}
    legacy = SegmentLog(tmp_path / "legacy")
    legacy.append(pa.concat_tables([make_group("x", group_size=2, actor_id=3), make_group("y", group_size=3)]), 0)
    legacy.close()
    assert groups_by_actor(tmp_path / "legacy") == {3: 1, 0: 1}


def resident_bytes(path) -> int:
    """Bytes of the file in the page cache (util-linux's fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.strip())


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux's fincore is not installed")
@pytest.mark.parametrize("policy", ["batch", "always"])
def test_the_log_leaves_the_page_cache_once_synced(tmp_path, policy):
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fs_type == "tmpfs":
        pytest.skip("on tmpfs the page cache is the file")
    log = SegmentLog(tmp_path, fsync=policy)
    write(log, [make_group(f"g{i}", completion_len=20_000) for i in range(8)])  # about 0.64 MB each
    if policy == "always":
        assert resident_bytes(log.path) == 0  # each append synced and dropped
    else:  # the last MiB at least was written after the last release: not on the disk yet, still cached
        assert resident_bytes(log.path) >= 2**20 * 0.5
    log.commit()
    assert resident_bytes(log.path) == 0
    assert read_segments(tmp_path).num_rows == 8 * 4
    log.close()
