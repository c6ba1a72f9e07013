"""distrl.learn.batch builds micro-batches from the Arrow columns; the reference here is the row-by-row collate it
replaced (944c626's distrl/learn/learner.py: ``to_pylist``, then one tensor per row). Every tensor must be equal,
dtype and shape included, for slices, multi-chunk tables, empty completions and learner advantages."""

from __future__ import annotations

import random
from dataclasses import fields

import numpy as np
import pyarrow as pa
import pytest
import torch

from distrl.learn.batch import MicroBatch, collate, pack
from tests.helpers import make_group


def reference_collate(rows: list[dict], pad_id: int, advantages: list[float] | None = None) -> MicroBatch:
    """944c626's collate, row by row, as it was."""
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    width = max(len(s) for s in seqs) - 1
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    targets = torch.full((b, width), -100, dtype=torch.long)
    mask = torch.zeros((b, width))
    behavior = torch.zeros((b, width))
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        n, p, c = len(seq) - 1, len(row["prompt_ids"]), len(row["completion_ids"])
        input_ids[i, :n] = torch.tensor(seq[:-1])
        attention[i, :n] = 1
        targets[i, :n] = torch.tensor(seq[1:])
        mask[i, p - 1:p - 1 + c] = 1.0
        behavior[i, p - 1:p - 1 + c] = torch.tensor(row["behavior_logprobs"])
    adv = [r["advantage"] for r in rows] if advantages is None else advantages
    return MicroBatch(input_ids, attention, targets, mask, behavior, torch.tensor(adv, dtype=torch.float32))


def random_table(rnd: random.Random) -> pa.Table:
    """1-5 groups of 4 (several Arrow chunks): prompts of 1-9 tokens, completions of 0-12, random ids."""
    tables = []
    for g in range(rnd.randint(1, 5)):
        t = make_group(f"g{g}", rewards=[rnd.random() for _ in range(4)], completion_len=rnd.randint(0, 9),
                       prompt_len=rnd.randint(1, 9))
        rows = t.to_pylist()
        for r in rows:
            r["prompt_ids"] = [rnd.randint(3, 20) for _ in r["prompt_ids"]]
            r["completion_ids"] = [rnd.randint(3, 20) for _ in r["completion_ids"]]
            r["behavior_logprobs"] = [-3 * rnd.random() for _ in r["completion_ids"]]
        tables.append(pa.Table.from_pylist(rows, schema=t.schema))
    return pa.concat_tables(tables)


def assert_same(a: MicroBatch, b: MicroBatch) -> None:
    for f in fields(MicroBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None) == (y is None), f.name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f.name


@pytest.mark.parametrize("seed", range(20))
def test_columns_give_the_row_by_row_tensors(seed):
    rnd = random.Random(seed)
    table = random_table(rnd)
    start, length = rnd.randint(0, table.num_rows - 1), rnd.randint(1, 9)
    part = table.slice(start, length)
    rows = part.to_pylist()
    advantages = None if seed % 2 else [rnd.gauss(0, 1) for _ in rows]  # float64, rounded to float32
    ref = reference_collate(rows, 0, advantages)
    new = collate(part, 0, None if advantages is None else np.array(advantages))
    assert_same(new, ref)
    pack_tokens = rnd.choice([1, 5, 12, 40])
    packed = pack(new, 0, pack_tokens)
    assert packed.packed_ids.reshape(-1)[packed.packed_index].tolist() == new.input_ids[new.mask > 0].tolist()


def test_bad_rows_are_refused():
    good = make_group("g", completion_len=2)
    with pytest.raises(ValueError, match="prompt token"):
        collate(good.slice(0, 0), 0)
    no_prompt = make_group("g", prompt_len=0)
    with pytest.raises(ValueError, match="prompt token"):
        collate(no_prompt, 0)
    rows = good.to_pylist()
    rows[1]["behavior_logprobs"] = rows[1]["behavior_logprobs"][:-1]
    with pytest.raises(ValueError, match="behavior logprob"):
        collate(pa.Table.from_pylist(rows, schema=good.schema), 0)
