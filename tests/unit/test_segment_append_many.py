"""SegmentLog.append_many (the commit thread's one writev per commit) writes what append would, in order."""

import pytest

from distrl.buffer.segments import SegmentLog, read_groups, segment_paths
from distrl.core.rows import decode_group, encode_table
from tests.helpers import make_group


def test_append_many_rotates_and_keeps_every_seq(tmp_path):
    groups = [make_group(f"g{i}", completion_len=50) for i in range(12)]
    size = len(groups[0].to_batches()[0].serialize())
    log = SegmentLog(tmp_path, fsync="batch", max_bytes=4 * size, group_size=4)
    received = [decode_group(encode_table(g))[1] for g in groups[:6]]  # bytes as a PUT brings them
    log.append_many([(g, i, m) for i, (g, m) in enumerate(zip(groups[:6], received))])
    log.append_many([(g, 6 + i, None) for i, g in enumerate(groups[6:])])  # serialized by the log
    log.commit()
    log.close()
    assert len(segment_paths(tmp_path)) >= 3  # rotated within one call
    assert [(seq, t.column("group_id")[0].as_py()) for seq, t in read_groups(tmp_path)] == [
        (i, f"g{i}") for i in range(12)]


def test_append_many_writes_the_appends_before_a_bad_one(tmp_path):
    log = SegmentLog(tmp_path, group_size=4)
    with pytest.raises(ValueError, match="expects seq 2, got 5"):
        log.append_many([(make_group("a"), 0, None), (make_group("b"), 1, None), (make_group("c"), 5, None)])
    log.append(make_group("c"), 2)
    log.close()
    assert [t.column("group_id")[0].as_py() for _, t in read_groups(tmp_path)] == ["a", "b", "c"]


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_append_many_under_each_fsync_policy(tmp_path, fsync):
    log = SegmentLog(tmp_path, fsync=fsync, group_size=4)
    log.append_many([(make_group(f"g{i}"), i, None) for i in range(3)])
    log.close()
    assert [seq for seq, _ in read_groups(tmp_path)] == [0, 1, 2]
