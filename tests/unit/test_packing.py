"""Sequence packing in the learner (``--learner_pack_tokens``): the packed layout by hand, and the same
loss and gradients as padded micro-batches on the tiny model (LoRA with a KL term, full fine-tuning,
gradient checkpointing), on CPU in float32."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
import torch

from distrl.cmd.assemble import learner_sections
from distrl.cmd.config import TrainConfig
from distrl.core.rows import table_from_rows
from distrl.learn.batch import collate, pack
from distrl.learn.learner import Learner
from tests.helpers import make_group

ADDRESS = "tcp://127.0.0.1:9"  # never contacted: these tests call prepare / accumulate directly


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("packing") / "tiny", seed=0))


def rows_of_mixed_lengths(seed: int = 0) -> list[dict]:
    """4 groups of 4: prompts of 2..9 tokens, completions of 2..12 tokens, random token ids and rewards."""
    rnd = random.Random(seed)
    tables = []
    for g in range(4):
        t = make_group(f"g{g}", rewards=[rnd.random() for _ in range(4)], completion_len=rnd.randint(2, 9),
                       prompt_len=rnd.randint(2, 9))
        tables.append(t)
    rows = pa.concat_tables(tables).to_pylist()
    for r in rows:  # random ids in the tiny vocabulary so that attention across sequences would show
        r["prompt_ids"] = [rnd.randint(3, 20) for _ in r["prompt_ids"]]
        r["completion_ids"] = [rnd.randint(3, 20) for _ in r["completion_ids"]]
        r["behavior_logprobs"] = [-rnd.random() * 3 for _ in r["completion_ids"]]
    return rows


def test_pack_layout_by_hand():
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "behavior_logprobs": [-1.0] * 3, "advantage": 1.0},
            {"prompt_ids": [6], "completion_ids": [7], "behavior_logprobs": [-2.0], "advantage": -1.0},
            {"prompt_ids": [8, 9, 10], "completion_ids": [11, 12], "behavior_logprobs": [-3.0] * 2,
             "advantage": 0.5}]
    mb = collate(pa.Table.from_pylist(rows), pad_id=0)  # sequence lengths (inputs) 4, 1, 4
    packed = pack(mb, pad_id=0, pack_tokens=5)
    # First-fit decreasing: [seq0 (4), seq1 (1)] then [seq2 (4)] padded to width 5.
    assert packed.packed_ids.tolist() == [[1, 2, 3, 4, 6], [8, 9, 10, 11, 0]]
    assert packed.packed_positions.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 0]]
    # Completion positions in the padded layout, row-major: seq0 at 1..3 (predicting 3, 4, 5), seq1 at 0
    # (predicting 7), seq2 at 2..3 (predicting 11, 12); their flat indices in the packed rows:
    assert packed.packed_index.tolist() == [1, 2, 3, 4, 7, 8]
    flat = packed.packed_ids.reshape(-1)
    next_tokens = mb.targets[mb.mask > 0]
    assert next_tokens.tolist() == [3, 4, 5, 7, 11, 12]
    # each selected packed position holds the token just before its target
    assert flat[packed.packed_index].tolist() == [2, 3, 4, 6, 10, 11]
    with pytest.raises(ValueError, match="--learner_pack_tokens"):
        pack(mb, pad_id=0, pack_tokens=0)


def loss_and_grads(lrn: Learner, rows: list[dict]) -> tuple[float, list[torch.Tensor]]:
    table = table_from_rows(rows)
    norm, adv, _ = lrn.prepare(table)
    parts = lrn.accumulate(table, adv, norm)
    grads = [p.grad.clone() for p in lrn.params]
    lrn.optimizer.zero_grad(set_to_none=True)
    return sum(p["loss"] for p in parts), grads


@pytest.mark.parametrize("flags", [
    {"finetune": "lora", "kl_coef": 0.1, "loss_aggregation": "sequence-mean-token-mean"},
    {"finetune": "full", "loss_aggregation": "token-mean"},
    {"finetune": "lora", "gradient_checkpointing": True, "loss_aggregation": "sequence-mean-token-sum-norm"},
])
def test_packed_equals_padded(tiny, flags):
    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", learning_rate=1e-2, max_new_tokens=16,
                      learner="grpo", off_policy="decoupled", learner_chunk_size=16, **flags)
    lrn = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)
    rows = rows_of_mixed_lengths()
    lrn.train_step(table_from_rows(rows_of_mixed_lengths(seed=1)))  # LoRA B != 0: the adapter matters
    padded_loss, padded = loss_and_grads(lrn, rows)
    for pack_tokens in (24, 64):  # several sequences per row; 24 < longest + others forces several rows
        lrn.learn.learner_pack_tokens = pack_tokens
        packed_loss, packed = loss_and_grads(lrn, rows)
        assert packed_loss == pytest.approx(padded_loss, rel=1e-5, abs=1e-6)
        for p, q in zip(packed, padded):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
    lrn.learn.learner_pack_tokens = 0
    assert sum(float(g.abs().sum()) for g in padded) > 0
    assert padded_loss != 0.0


def test_pack_tokens_flag_is_validated():
    with pytest.raises(ValueError, match="--learner_pack_tokens must be >= 0"):
        TrainConfig(learner_pack_tokens=-1)
    with pytest.raises(ValueError, match="--learner_head_chunk_tokens must be >= 1"):
        TrainConfig(learner_head_chunk_tokens=0)
