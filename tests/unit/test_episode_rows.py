"""An episode's row (issue 44): the turn columns of COMPLETION_SCHEMA are optional, segment logs written before
them still read (their rows single-turn), and the learner's batch keeps observation tokens out of the loss."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from distrl.buffer.segments import SegmentLog, read_groups, read_segments, segment_paths
from distrl.core.rows import COMPLETION_SCHEMA, STAMPED_SCHEMA, TURN_COLUMNS, decode_group, encode_table, upgrade
from distrl.learn.batch import collate, loss_mask, loss_tokens
from tests.helpers import make_group


def episode_group() -> pa.Table:
    """Two rows: an episode of 2 turns (3 model tokens, 2 observation tokens, 2 model tokens) and a single-turn
    row (loss_mask null)."""
    rows = make_group("ep", group_size=2, completion_len=7, prompt_len=3).to_pylist()
    rows[0].update(completion_ids=[11, 12, 13, 90, 91, 14, 15], behavior_logprobs=[-1, -2, -3, 0, 0, -4, -5],
                   turn_ends=[3, 7], loss_mask=[1, 1, 1, 0, 0, 1, 1])
    return pa.Table.from_pylist(rows, schema=COMPLETION_SCHEMA)


def test_an_old_segment_file_without_turn_columns_still_reads(tmp_path):
    group = make_group("old")
    log = SegmentLog(tmp_path)
    log.append(group, 0)
    log.close()
    [path] = segment_paths(tmp_path)
    with pa.ipc.open_stream(path.read_bytes()) as reader:  # rewrite it as a log written before turns was
        metadata, table = reader.schema.metadata, reader.read_all()
    old = pa.Table.from_arrays([table.column(n) for n in STAMPED_SCHEMA.names], schema=STAMPED_SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, STAMPED_SCHEMA.with_metadata(metadata)) as w:
        w.write_table(old)
    read = read_segments(tmp_path)
    assert read.schema.equals(COMPLETION_SCHEMA) and read.num_rows == group.num_rows
    for name in TURN_COLUMNS:
        assert read.column(name).null_count == read.num_rows
    assert read.drop_columns(list(TURN_COLUMNS)).equals(group.drop_columns(list(TURN_COLUMNS)))
    [(seq, g)] = list(read_groups(tmp_path))
    assert seq == 0 and g.num_rows == group.num_rows
    batch = upgrade(old.to_batches()[0])
    assert batch.schema.equals(COMPLETION_SCHEMA)
    mb = collate(pa.Table.from_batches([batch]), pad_id=0)  # an old row: every completion token in the loss
    assert mb.mask.sum().item() == sum(len(c) for c in group.column("completion_ids").to_pylist())


def test_an_episode_row_round_trips_the_wire():
    group = episode_group()
    batch, _ = decode_group(encode_table(group))
    assert pa.Table.from_batches([batch]).equals(group)
    assert batch.column("turn_ends").to_pylist() == [[3, 7], None]


def test_observation_tokens_are_out_of_the_loss():
    group = episode_group()
    assert loss_mask(group).tolist() == [1, 1, 1, 0, 0, 1, 1] + [1] * 8
    assert loss_tokens(group).tolist() == [5, 8]
    mb = collate(group, pad_id=0)
    p = 3  # completion token j of a row is predicted at position p - 1 + j
    assert mb.mask[0, p - 1:p - 1 + 7].tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert mb.mask[1, p - 1:p - 1 + 8].tolist() == [1] * 8 and mb.mask.sum().item() == 13
    # the observation tokens are still inputs and targets (the model reads them), never loss positions
    assert mb.targets[0, p - 1 + 3].item() == 90 and mb.input_ids[0, p + 3].item() == 90
    index = set(mb.completion_index.tolist())
    width = mb.mask.shape[1]
    assert {p - 1 + 3, p - 1 + 4}.isdisjoint(index) and len(index) == 13
    assert torch.equal(mb.behavior_logprobs[0, p - 1:p - 1 + 7], torch.tensor([-1, -2, -3, 0, 0, -4, -5.0]))
    assert width == 3 + 8 - 1


def test_a_mask_of_the_wrong_length_is_refused():
    rows = episode_group().to_pylist()
    rows[0]["loss_mask"] = [1, 0]
    try:
        loss_mask(pa.Table.from_pylist(rows, schema=COMPLETION_SCHEMA))
    except ValueError as exc:
        assert "loss_mask" in str(exc)
    else:
        raise AssertionError("a short loss_mask was accepted")
    assert np.array_equal(loss_tokens(make_group("g", completion_len=0)), [0, 1, 2, 3])
