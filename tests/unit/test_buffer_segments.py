"""The segment log (Arrow IPC stream, fsync per group) and the consumption log, on real files."""

import pyarrow as pa

from buffer.segments import ConsumptionLog, SegmentLog, read_consumed, read_segments, segment_paths
from distrl.wire import COMPLETION_SCHEMA
from tests.helpers import make_group


def test_segments_read_back_in_order(tmp_path):
    groups = [make_group(f"g{i}", policy_version=i) for i in range(3)]
    log = SegmentLog(tmp_path)
    for g in groups:
        log.append(g)
    assert read_segments(tmp_path).equals(pa.concat_tables(groups))  # readable before close (crash)
    log.close()
    assert read_segments(tmp_path).equals(pa.concat_tables(groups))
    assert [p.name for p in segment_paths(tmp_path)] == ["segment-00000.arrow"]


def test_empty_run_dir_reads_empty_table(tmp_path):
    table = read_segments(tmp_path)
    assert table.num_rows == 0 and table.schema.equals(COMPLETION_SCHEMA)


def test_truncated_last_message_is_skipped(tmp_path):
    log = SegmentLog(tmp_path)
    log.append(make_group("a"))
    log.append(make_group("b"))
    size_two = log.path.stat().st_size
    log.append(make_group("c"))
    log.close()
    full = log.path.read_bytes()
    for cut in (size_two + 5, len(full) - 40):  # a crash in the middle of writing "c"
        log.path.write_bytes(full[:cut])
        assert set(read_segments(tmp_path).column("group_id").to_pylist()) == {"a", "b"}
    log.path.write_bytes(full[:3])  # a crash while writing the schema
    assert read_segments(tmp_path).num_rows == 0


def test_restart_opens_a_new_segment_and_keeps_the_old(tmp_path):
    first = SegmentLog(tmp_path)
    first.append(make_group("a"))
    first.close()
    second = SegmentLog(tmp_path)
    second.append(make_group("b"))
    second.close()
    assert second.path.name == "segment-00001.arrow"
    assert read_segments(tmp_path).column("group_id").to_pylist() == ["a"] * 4 + ["b"] * 4


def test_consumption_log(tmp_path):
    log = ConsumptionLog(tmp_path)
    log.append(3, 1, pa.concat_tables([make_group("a", group_size=2), make_group("b", group_size=2)]))
    log.close()
    with open(log.path, "a") as f:
        f.write('{"learner_version": 4, "ra')  # a crash mid-line
    (record,) = read_consumed(tmp_path)
    assert (record["learner_version"], record["rank"], record["group_ids"]) == (3, 1, ["a", "b"])
    assert record["sample_ids"] == ["a/0", "a/1", "b/0", "b/1"]
