"""distrl.learn.batch.micro_batches: the learner's micro-batches by token budget (--learner_chunk_tokens) or by a
fixed row count (--learner_chunk_size, which wins when given)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from distrl.learn.batch import collate, micro_batches, widest_first
from distrl.learn.config import LearnOptions
from tests.helpers import make_group


def table(groups: int = 8, group_size: int = 4, prompt_len: int = 2) -> pa.Table:
    # completion i of a group has 3 + i tokens: widths (prompt + completion - 1) 4, 5, 6, 7 with prompt_len 2
    return pa.concat_tables([make_group(f"g{i}", group_size=group_size, prompt_len=prompt_len)
                             for i in range(groups)])


def check_cover(ranges: list[tuple[int, int]], rows: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


@pytest.mark.parametrize("budget", [1, 6, 7, 20, 29, 100, 10_000])
def test_token_budget_ranges_fit_and_cover(budget):
    t = table()
    ranges = micro_batches(t, None, budget)
    check_cover(ranges, t.num_rows)
    for a, b in ranges:
        padded = collate(t.slice(a, b - a), 0).input_ids.numel()  # rows x the padded width collate gives
        assert padded <= budget or b - a == 1
        if b < t.num_rows:  # greedy: the next row would not have fitted
            assert collate(t.slice(a, b - a + 1), 0).input_ids.numel() > budget


def test_fixed_row_count_wins_over_the_budget():
    t = table()
    assert micro_batches(t, 5, 1) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30), (30, 32)]
    assert micro_batches(t, 100, 1) == [(0, 32)]


def test_default_budget_takes_a_smollm2_batch_whole():
    # SmolLM2 arith: 32 prompts x 8 completions, ~45 prompt + <= 24 completion tokens
    t = table(groups=32, group_size=8, prompt_len=45)
    cfg = LearnOptions()
    assert cfg.learner_chunk_size is None
    assert micro_batches(t, cfg.learner_chunk_size, cfg.learner_chunk_tokens) == [(0, 256)]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        micro_batches(table(), None, 0)
    with pytest.raises(ValueError):
        micro_batches(table(), 0, 100)
    with pytest.raises(ValueError):
        LearnOptions(learner_chunk_tokens=0).check()
    assert micro_batches(table().slice(0, 0), None, 100) == []


def test_widest_first_pads_less():
    # rows of widths 4..7 interleaved: in table order every micro-batch pads to 7; widest first, rows of one width
    t = table(groups=8)
    order = widest_first(t)
    widths = [len(p) + len(c) - 1 for p, c in zip(t.column("prompt_ids").to_pylist(),
                                                   t.column("completion_ids").to_pylist())]
    assert [widths[i] for i in order] == sorted(widths, reverse=True)
    assert list(order[:8]) == [i for i in range(32) if widths[i] == 7]  # ties keep table order

    def padded(tab):
        return sum(collate(tab.slice(a, b - a), 0).input_ids.numel() for a, b in micro_batches(tab, None, 28))

    assert padded(t) - sum(widths) == 48  # table order: every micro-batch pads to width 7
    assert padded(t.take(order)) - sum(widths) == 2  # widest first: only 3 x 5 + 2 x 4 (2 pads) mix two widths
    assert np.array_equal(widest_first(t.slice(0, 0)), [])
