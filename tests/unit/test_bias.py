"""The sampling-bias monitor (distrl.buffer.bias) on hand-built groups through the store, the BATCH fields it adds,
and the reweight math of --bias_correction (distrl.learn.reweight) down to the learner's gradient."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from distrl.buffer.bias import N_CELLS, cells, model_tokens
from distrl.buffer.config import SelectionOptions
from distrl.buffer.store import GroupStore
from distrl.core import wire
from distrl.core.rows import COMPLETION_SCHEMA
from distrl.learn.reweight import cell_weights, normalise, row_weights
from tests.helpers import make_group

SHORT = dict(completion_len=2, rewards=[1, 1, 1, 0])  # lengths 2..5: mean 3.5 tokens; mean reward 0.75
LONG = dict(completion_len=20, rewards=[0, 0, 0, 1])  # lengths 20..23: mean 21.5 tokens; mean reward 0.25


def starved_store() -> GroupStore:
    """4 prompts issued at version 0; two short easy groups trained at 0, two long hard ones arrive behind
    them and are evicted as stale when the learner moves to version 2 (max_staleness 1)."""
    s = GroupStore(batch_size=2, max_staleness=1, topk=2, group_size=4)
    assert s.grant_credits(4) == 4
    for gid, kind in (("a", SHORT), ("b", SHORT), ("c", LONG), ("d", LONG)):
        s.put(make_group(gid, 0, **kind))
    assert s.select(0, 0, 1) is not None  # fifo: a and b
    assert s.select(2, 0, 1) is None  # version 2: c and d are stale (2 - 0 > 1), evicted
    return s


def test_counters_and_gaps_by_hand():
    s = starved_store()
    b = s.stats()["bias"]
    # generated: (3.5 * 2 + 21.5 * 2) / 4 = 12.5 tokens, (0.75 * 2 + 0.25 * 2) / 4 = 0.5; trained: 3.5, 0.75
    assert b["generated"] == {"groups": 4, "length": 12.5, "difficulty": 0.5, "lag": 0.0}
    assert b["trained"] == {"groups": 2, "length": 3.5, "difficulty": 0.75, "lag": 0.0}
    assert b["evicted"] == {"groups": 2, "length": 21.5, "difficulty": 0.25, "lag": 2.0}  # evicted at version 2
    assert b["len_gap"] == pytest.approx(3.5 - 12.5) and b["difficulty_gap"] == pytest.approx(0.75 - 0.5)
    assert b["lag_mean"] == 0.0
    assert b["untrained_share"] == pytest.approx(1 - 2 / 4) and b["issued"] == 4 and b["trained_once"] == 2
    assert b["by_version"] == [{"version": 0, "issued": 4, "generated": b["generated"], "trained": b["trained"],
                                "evicted": b["evicted"]}]
    scalars = s.bias.scalars()
    assert scalars["bias/len_gap"] == -9.0 and scalars["bias/difficulty_gap"] == 0.25
    assert scalars["bias/untrained_share"] == 0.5 and scalars["bias/evicted_length"] == 21.5


def test_cells_histograms_and_batch_fields():
    s = starved_store()
    # 3.5 tokens: edges <= 3.5 are {2}: length bucket 1; mean reward 0.75: bucket 3 -> cell 1 * 4 + 3 = 7
    # 21.5 tokens: {2, 4, 8, 16}: bucket 4; 0.25: bucket 1 -> cell 17
    assert cells(np.array([3.5, 21.5, 0.0, 1e6]), np.array([0.75, 0.25, -1.0, 2.0])).tolist() == [7, 17, 0, 12 * 4 + 3]
    fields = s.bias.batch_fields(0)
    expected = np.zeros(N_CELLS, int)
    expected[[7, 17]] = 2
    assert fields["bias_generated"] == expected.tolist()
    expected[17] = 0
    assert fields["bias_trained"] == expected.tolist() and fields["bias_cells"] == {"a": 7, "b": 7}
    assert s.bias.batch_fields(5)["bias_cells"] == {}
    assert s.bias.batch_fields(0, make_group("a"))["bias_cells"] == {"a": 7}  # a shard's groups only
    assert s.bias._held == {}  # every group left memory: nothing remembered


def test_zero_variance_filter_and_replay_ratio_are_counted():
    s = GroupStore(batch_size=1, max_staleness=2, topk=2, group_size=4, filter_zero_variance=True, replay_ratio=2)
    s.grant_credits(2)
    s.put(make_group("flat", 0, rewards=[1, 1, 1, 1]))  # zero variance: evicted on arrival
    s.put(make_group("g", 0, **SHORT))
    s.select(0, 0, 1)
    s.select(1, 0, 1)  # the same group a second time (replay_ratio 2)
    b = s.stats()["bias"]
    assert b["generated"]["groups"] == 2 and b["evicted"]["groups"] == 1 and b["evicted"]["difficulty"] == 1.0
    assert b["trained"]["groups"] == 2 and b["trained_once"] == 1 and b["trained"]["lag"] == 0.5  # lags 0 and 1
    assert b["untrained_share"] == 0.5


def test_model_tokens_count_only_the_models_tokens():
    table = pa.concat_tables([make_group("g", group_size=2, completion_len=4)])  # lengths 4, 5; no loss_mask
    assert model_tokens(table).tolist() == [4.0, 5.0]
    masked = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                              pa.array([[1, 1, 0, 0], None], type=COMPLETION_SCHEMA.field("loss_mask").type))
    assert model_tokens(masked).tolist() == [2.0, 5.0]  # an episode: 2 model tokens, 2 observation tokens
    assert model_tokens(masked.slice(1)).tolist() == [5.0]


def test_batch_fields_travel_in_the_batch_reply_and_are_optional():
    frames = wire.encode(wire.MsgType.BATCH, "buffer", 3, learner_version=1, rank=0, world_size=1, rows=0,
                         bias_generated=[1, 2], bias_trained=[2, 1], bias_cells={"g": 1})
    header = wire.decode(frames)[0]
    assert (header.bias_generated, header.bias_trained, header.bias_cells) == ([1, 2], [2, 1], {"g": 1})
    old = wire.decode(wire.encode(wire.MsgType.BATCH, "buffer", 3, learner_version=1, rank=0, world_size=1, rows=0))[0]
    assert old.bias_cells is wire.UNSET


# ---- reweight ------------------------------------------------------------------------------------------

def test_cell_weights_by_hand():
    # shares: generated [0.5, 0, 0.5], trained [0.75, 0, 0.25] -> [0.5/0.75, 1 (never trained), 0.5/0.25]
    assert cell_weights([2, 0, 2], [3, 0, 1]) == pytest.approx([2 / 3, 1.0, 2.0])
    # generated [0.01, 0.99], trained [0.99, 0.01]: ratios 0.0101 and 99, clipped to [0.2, 5]
    assert cell_weights([1, 99], [99, 1]) == pytest.approx([0.2, 5.0])
    assert cell_weights([0, 0], [1, 1]).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="differ in length"):
        cell_weights([1], [1, 2])


def test_row_weights_and_normalise():
    raw = row_weights(["a", "a", "b", "zz"], [2, 0, 2], [3, 0, 1], {"a": 0, "b": 2})
    assert raw == pytest.approx([2 / 3, 2 / 3, 2.0, 1.0])  # zz: a group the buffer did not name
    w = normalise(raw, float(raw.sum()), len(raw))
    assert w.mean() == pytest.approx(1.0) and w[2] / w[0] == pytest.approx(3.0)
    assert normalise(np.zeros(2), 0.0, 2).tolist() == [0.0, 0.0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("bias") / "tiny", seed=0))


def test_weights_reach_the_loss(tiny):
    """The learner's weighted gradient equals the gradient of the same batch with each advantage scaled by its
    group's weight: the weights enter the policy term (distrl.learn.reweight's docstring)."""
    from distrl.cmd.assemble import learner_sections
    from distrl.cmd.config import TrainConfig
    from distrl.learn.learner import Learner

    cfg = TrainConfig(model=tiny, backend="hf", dtype="float32", max_new_tokens=8, bias_correction="reweight")
    lrn = Learner(*learner_sections(cfg), 0, 1, "tcp://127.0.0.1:9", tiny)
    table = pa.concat_tables([make_group("a", **SHORT), make_group("b", **SHORT), make_group("c", **LONG)])
    lrn.client.last_bias = ([2, 0, 2], [3, 0, 1], {"a": 0, "b": 0, "c": 2})  # what a BATCH reply sets
    weights = lrn.bias_weights(table)
    assert weights.mean() == pytest.approx(1.0) and weights[8] / weights[0] == pytest.approx(3.0)

    def grads(t, w):
        norm, adv, _ = lrn.prepare(t, w)
        lrn.accumulate(t, adv, norm)
        out = [p.grad.clone() for p in lrn.params if p.grad is not None]
        lrn.optimizer.zero_grad(set_to_none=True)
        return out

    scaled = table.set_column(table.schema.get_field_index("advantage"), "advantage",
                              pa.array(table.column("advantage").to_numpy() * weights, pa.float32()))
    for got, want in zip(grads(table, weights), grads(scaled, None)):
        assert np.allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-7)
    assert any(not np.allclose(g.numpy(), u.numpy()) for g, u in zip(grads(table, weights), grads(table, None)))


def test_end_of_run_report_has_the_bias_section(tmp_path, capsys):
    from distrl.cmd.report import write_report

    numbers = write_report(tmp_path, {"versions": 2, "wall_s": 1.0, "buffer": starved_store().stats()})
    assert numbers["bias_len_gap"] == -9.0 and numbers["bias_difficulty_gap"] == 0.25
    assert numbers["bias_lag_mean"] == 0.0 and numbers["bias_untrained_share"] == 0.5
    assert "sampling bias" in capsys.readouterr().out
    text = (tmp_path / "bias.md").read_text()
    assert "length gap **-9.00** tokens" in text and "| 0 | 4 | 4 | 12.5 | 0.500 | 0.00 | 2 | 3.5 | 0.750 |" in text
    assert write_report(tmp_path, {"versions": 1, "wall_s": 1.0})["bias_md"] is None  # an older run's summary


def test_the_reweight_histograms_leave_out_zero_variance_groups():
    s = GroupStore(batch_size=2, max_staleness=2, topk=2, group_size=4, filter_zero_variance=False)
    s.grant_credits(2)
    s.put(make_group("flat", 0, completion_len=20, rewards=[0, 0, 0, 0]))  # all wrong: no GRPO advantage
    s.put(make_group("g", 0, **SHORT))
    assert s.select(0, 0, 1) is not None  # both handed out (no filter)
    fields = s.bias.batch_fields(0)
    expected = np.zeros(N_CELLS, int)
    expected[7] = 1  # only g's cell: the flat group is in neither histogram
    assert fields["bias_generated"] == expected.tolist() and fields["bias_trained"] == expected.tolist()
    assert s.stats()["bias"]["generated"]["groups"] == 2  # the monitor's own counts keep every group
    assert set(fields["bias_cells"]) == {"flat", "g"}


# ---- --bias_slack: more staleness for the groups of starved cells -----------------------------------------

SHORT_CELL, LONG_CELL = 7, 17  # the cells of SHORT and LONG groups (test_cells_histograms_and_batch_fields)


def test_starved_cells_are_those_trained_below_their_generated_share():
    s = GroupStore(batch_size=1, max_staleness=2, topk=2, group_size=4)
    for gid, kind in (("a", SHORT), ("c", LONG), ("flat", dict(rewards=[1, 1, 1, 1]))):
        s.put(make_group(gid, 0, **kind))  # flat: no learning signal, in no histogram, never starved

    def starved() -> list[int]:
        return np.flatnonzero(s.bias.starved()).tolist()

    assert starved() == []  # nothing handed out yet: no evidence (and no group is stale at version 0)
    assert s.select(0, 0, 1).column("group_id")[0].as_py() == "a"
    assert starved() == [LONG_CELL]  # short: trained 1/1 >= generated 1/2; long: 0/1 < 1/2
    assert s.select(1, 0, 1).column("group_id")[0].as_py() == "c"
    assert starved() == []  # trained 1/2 and 1/2, generated 1/2 and 1/2: equal shares are not starved
    s.put(make_group("b", 1, **SHORT))
    assert starved() == [SHORT_CELL]  # short: generated 2/3 > trained 1/2; long: 1/3 < 1/2


def trained_short(bias_slack: int) -> GroupStore:
    """max_staleness 1: two SHORT groups trained at each of versions 0, 1 and 2 (on-policy), so the store is at
    learner version 2, holds nothing, and the SHORT cell is trained in proportion (6 of 6)."""
    s = GroupStore(batch_size=2, max_staleness=1, topk=2, group_size=4, bias_slack=bias_slack)
    for v in range(3):
        s.put(make_group(f"a{v}", v, **SHORT))
        s.put(make_group(f"b{v}", v, **SHORT))
        assert s.select(v, 0, 1) is not None
    return s


@pytest.mark.parametrize("slack, evicted_at", [(0, 2), (2, 4)])
def test_a_late_group_of_a_starved_cell_is_evicted_past_max_staleness_plus_slack(slack, evicted_at):
    s = trained_short(slack)
    s.put(make_group("late", 0, **LONG))  # arrives at learner version 2 (lag 2); its cell never trained: starved
    assert s.bias.starved()[LONG_CELL]
    for v in range(2, 6):
        if v > 2:
            assert s.select(v, 0, 1) is None  # one group at most: no batch of 2
        assert s.stats()["evicted_stale"] == int(v >= evicted_at), v
        assert s.fresh_groups(v) == int(v < evicted_at), v  # eligible while held
    assert s.stats()["bias"]["evicted"] == {"groups": 1, "length": 21.5, "difficulty": 0.25, "lag": evicted_at}
    s.put(make_group("later", 0, **LONG))  # lag 5 > 1 + slack at arrival: evicted there, slack or not
    assert s.stats()["evicted_stale"] == 2 and s.stats()["groups"] == 0


def test_a_late_group_of_a_starved_cell_is_trained_at_lag_max_staleness_plus_slack():
    s = trained_short(2)
    s.put(make_group("late", 0, **LONG))
    assert s.select(3, 0, 1) is None  # lag 3: held, but alone
    s.put(make_group("fresh", 3, **SHORT))
    batch = s.select(3, 0, 1)
    assert batch.column("group_id").to_pylist() == ["late"] * 2 + ["fresh"] * 2  # fifo: late first
    assert batch.column("policy_version").to_pylist() == [0, 0, 3, 3] and s.stats()["last_staleness"] == [3, 3, 0, 0]
    assert s.stats()["evicted_stale"] == 0 and s.stats()["bias"]["trained"]["lag"] == pytest.approx(3 / 8)
    assert s.stats()["slack_trained"] == 1  # the late group; the fresh one is within max_staleness
    assert not s.bias.starved()[LONG_CELL]  # trained 1/8 >= generated 1/8: the allowance has ended


def test_no_slack_without_a_learning_signal_or_for_a_cell_trained_in_proportion():
    s = trained_short(2)
    s.put(make_group("late", 0, **LONG))  # held (lag 2), so LONG's cell is starved from here on
    s.put(make_group("flat", 0, completion_len=20, rewards=[0.25] * 4))  # LONG's cell by length and mean reward,
    assert s.bias.starved()[LONG_CELL] and s.stats()["evicted_stale"] == 1  # but no signal: plain max_staleness
    s.put(make_group("short", 0, **SHORT))  # lag 2; SHORT's cell: trained 6/6 >= generated 7/8, not starved
    assert not s.bias.starved()[SHORT_CELL] and s.stats()["evicted_stale"] == 2
    assert s.stats()["groups"] == 1 and s.fresh_groups(3) == 1  # only the late LONG group is left


def test_a_negative_bias_slack_is_refused():
    with pytest.raises(ValueError, match=r"bias_slack >= 0; got .*, -1$"):
        GroupStore(batch_size=2, max_staleness=1, topk=2, group_size=4, bias_slack=-1)
    with pytest.raises(ValueError, match="--bias_slack must be >= 0"):
        SelectionOptions(bias_slack=-1).check()
    SelectionOptions(bias_slack=3).check()
