"""--learner_compile: `distrl.learn.model.compile_layers` compiles at start every variant of the decoder layers'
inputs a micro-batch can bring, so that batches of new shapes never recompile mid-run (on the H200 a learner step that
compiled took 8-10 s, in the middle of a version).

On CPU with torch.compile's ``eager`` backend: the guards and recompiles checked are dynamo's, which the CUDA
backend shares (it may add guards of its own, which only a GPU run shows). The micro-batches go through the
learner's own collate / pack / forward / backward (``Learner.accumulate``), and the weight check's canary forward."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from distrl.cmd.assemble import learner_sections
from distrl.cmd.config import TrainConfig
from distrl.core.rows import table_from_rows
from distrl.learn.learner import Learner
from distrl.learn.model import compile_layers
from distrl.weights.attest import canary_logprob
from tests.helpers import make_group
from tests.unit.test_packing import ADDRESS, rows_of_mixed_lengths, tiny  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("no_garbage_while_tracing")


def tables() -> list[pa.Table]:
    """Micro-batches of new shapes: padded rows of two sets of lengths, rows of equal length (no padding), a
    single row."""
    equal = pa.concat_tables([make_group(f"e{g}", group_size=1, rewards=[1.0], completion_len=5, prompt_len=4)
                              for g in range(3)])
    one = make_group("one", group_size=1, rewards=[1.0], completion_len=7, prompt_len=3)
    return [table_from_rows(rows_of_mixed_lengths(seed=s)) for s in (0, 1)] + [equal, one]


def graphs_after(lrn: Learner) -> list[int]:
    """Graphs dynamo has compiled so far, after the learner's forward/backward over each of :func:`tables` (with
    the KL reference's forward when there is a KL term), then after the weight check's canary forward."""
    graphs = []
    for table in tables():
        norm, advantages, _ = lrn.prepare(table)
        lrn.accumulate(table, advantages + 1.0, norm)  # advantages never all 0: a gradient each time
        lrn.optimizer.zero_grad(set_to_none=True)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    canary_logprob(lrn.body, lrn.head, lrn.model.config.vocab_size)  # no gradients, one row
    return graphs + [dynamo_utils.counters["stats"]["unique_graphs"]]


# slow: packed rows with full fine-tuning, and LoRA + KL unpacked; in make test, the two corners (unpacked full
# fine-tuning, and packed LoRA + KL: the packed warm-up variants and the KL reference's no-gradient forward at once).
@pytest.mark.parametrize("pack_tokens, flags", [(0, {}), pytest.param(24, {}, marks=pytest.mark.slow),
                                                pytest.param(0, {"finetune": "lora", "kl_coef": 0.1},
                                                             marks=pytest.mark.slow),
                                                (24, {"finetune": "lora", "kl_coef": 0.1})])
def test_no_recompile_after_the_warm_up(tiny, pack_tokens, flags):  # noqa: F811
    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", max_new_tokens=16, learner="grpo",
                      learner_chunk_size=16, learner_pack_tokens=pack_tokens, **flags)
    lrn = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compile_layers(lrn.model, packed=pack_tokens > 0, kl=lrn.learn.kl_coef > 0, backend="eager")
    warm = dynamo_utils.counters["stats"]["unique_graphs"]
    assert warm > 0
    assert all(p.grad is None for p in lrn.params)  # the warm-up leaves no gradient behind
    assert graphs_after(lrn) == [warm] * (len(tables()) + 1)


def test_without_the_warm_up_new_shapes_recompile(tiny):  # noqa: F811
    """The same micro-batches after a plain per-layer compile: the single row and the canary's forward without
    gradients compile new graphs (what the warm-up moves to the start); padded and unpadded rows share theirs
    (no mask either way)."""
    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", max_new_tokens=16, learner="grpo",
                      learner_chunk_size=16)
    lrn = Learner(*learner_sections(cfg), 0, 1, ADDRESS, tiny)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    for layer in lrn.body.layers:
        layer.compile(dynamic=True, backend="eager")
    padded, _, unpadded, single, canary = graphs_after(lrn)
    assert padded == unpadded < single < canary


def test_padded_rows_need_no_mask(tiny):  # noqa: F811
    """The learner runs padded micro-batches without an attention mask: rows are right-padded, so under causal
    attention no real token sees a pad. Its hidden states at real tokens equal those of the masked forward."""
    from distrl.learn.batch import collate
    from distrl.learn.model import body_and_head, load_policy

    model = load_policy(tiny, "float32", finetune="full", backend="hf", seed=0)
    body, _ = body_and_head(model)
    mb = collate(tables()[0], pad_id=0)
    assert (mb.attention_mask == 0).any()  # some rows are padded
    with torch.no_grad():
        masked = body(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).last_hidden_state
        plain = body(input_ids=mb.input_ids, use_cache=False).last_hidden_state
    real = mb.attention_mask > 0
    torch.testing.assert_close(plain[real], masked[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain[~real], masked[~real])  # only the pads' own outputs differ (never read)


def test_compiled_layers_and_a_generating_learner_are_refused():
    with pytest.raises(ValueError, match="--learner_compile with --learner_generates"):
        TrainConfig(learner_compile=True, learner_generates=True)
