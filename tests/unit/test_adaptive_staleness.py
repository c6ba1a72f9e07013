"""The adaptive staleness bound (`--max_staleness auto[:CEILING]`): parsing, the controller's rule, the store's
announced bound and its credits, the wire field and the consumption log's bound column."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.buffer.inprocess import open_buffer
from distrl.buffer.segments import read_consumed
from distrl.buffer.store import GroupStore
from distrl.cmd.assemble import buffer_sections
from distrl.cmd.config import BufferConfig, LearnConfig, TrainConfig
from distrl.core import wire
from distrl.core.run_options import StalenessBound, StalenessOptions
from distrl.core.wire import MsgType
from distrl.learn.staleness import SIGNALS, StalenessBand, StalenessController
from tests.helpers import BUFFER_TEST_OPTIONS, make_group
from tests.unit.test_buffer_server import client, serving

ROOT = Path(__file__).resolve().parents[2]
IN_BAND = {SIGNALS["kl"]: 0.001, SIGNALS["spread"]: 0.01, SIGNALS["clip"]: 0.0}


# ---- parsing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, ceiling, auto, initial", [
    (0, 0, False, 0), (3, 3, False, 3), ("2", 2, False, 2), ("auto", 4, True, 0), ("auto:6", 6, True, 0),
    ("auto:0", 0, True, 0),
])
def test_bounds_parse(value, ceiling, auto, initial):
    bound = StalenessBound.parse(value)
    assert (bound.ceiling, bound.auto, bound.initial) == (ceiling, auto, initial)
    assert StalenessBound.parse(str(bound)) == bound  # str() gives the flag's own text back


@pytest.mark.parametrize("value", [-1, "-1", "auto:", "auto:-2", "auto6", "automatic", "1.5", "", True])
def test_bad_bounds_name_the_flag(value):
    with pytest.raises(ValueError, match="--max_staleness"):
        StalenessOptions(max_staleness=value).check()


def test_configs_take_auto_and_plain_integers_round_trip():
    cfg = TrainConfig(max_staleness="auto:6")
    assert cfg.staleness.bound == StalenessBound(6, auto=True)
    again = TrainConfig.from_json(cfg.to_json())  # a saved config.json
    assert again.max_staleness == "auto:6" and again.staleness.bound.ceiling == 6
    old = TrainConfig.from_json(json.dumps({"max_staleness": 2}))  # an old run's config.json
    assert old.max_staleness == 2 and old.staleness.bound == StalenessBound(2)
    assert LearnConfig(max_staleness="auto").staleness.bound.ceiling == 4


def test_command_line_exits_2_naming_the_flag():
    proc = subprocess.run([sys.executable, "-m", "distrl", "train", "--max_staleness", "auto:x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--max_staleness must be an integer >= 0" in proc.stderr and "'auto:x'" in proc.stderr


@pytest.mark.parametrize("flag, value", [("staleness_kl_max", 0.0), ("staleness_spread_max", -1.0),
                                         ("staleness_clip_max", 0.0), ("staleness_patience", 0)])
def test_bad_band_flags_name_the_flag(flag, value):
    with pytest.raises(ValueError, match=f"--{flag}"):
        TrainConfig(max_staleness="auto", **{flag: value})


# ---- the controller -----------------------------------------------------------------------------

def test_controller_raises_by_one_after_patience_versions_in_band():
    c = StalenessController(ceiling=2, band=StalenessBand(patience=3))
    bounds = [c.update(IN_BAND) for _ in range(9)]
    assert bounds == [0, 0, 1, 1, 1, 2, 2, 2, 2]  # +1 after every 3 calm versions, never past the ceiling


@pytest.mark.parametrize("signal, value", [("kl", 0.03), ("spread", 0.25), ("clip", 0.21)])
def test_controller_halves_at_once_when_any_signal_leaves_its_band(signal, value):
    c = StalenessController(ceiling=8, initial=5)
    c.calm = 2
    assert c.update({**IN_BAND, SIGNALS[signal]: value}) == 2  # 5 // 2
    assert c.calm == 0
    assert [c.update({**IN_BAND, SIGNALS[signal]: value}) for _ in range(3)] == [1, 0, 0]


def test_an_out_of_band_version_restarts_the_patience():
    c = StalenessController(ceiling=4, band=StalenessBand(patience=2), initial=1)
    assert c.update(IN_BAND) == 1
    assert c.update({**IN_BAND, SIGNALS["kl"]: 1.0}) == 0
    assert [c.update(IN_BAND) for _ in range(4)] == [0, 1, 1, 2]


def test_versions_without_signals_change_nothing_and_missing_signals_are_left_out():
    c = StalenessController(ceiling=4, band=StalenessBand(patience=1), initial=2)
    assert c.update({"learner/loss": 9.0}) == 2 and c.calm == 0  # a skipped step reports none
    pg = {SIGNALS["kl"]: 0.001, SIGNALS["spread"]: 0.01}  # --learner pg reports no clip fraction
    assert c.update(pg) == 3
    assert c.update({**pg, SIGNALS["spread"]: 0.2}) == 4  # at the limit is in band
    assert c.update({SIGNALS["kl"]: 0.0201}) == 2


def test_controller_state_round_trips_and_is_clipped_to_its_ceiling():
    c = StalenessController(ceiling=3, initial=9)
    assert c.bound == 3
    c.calm = 2
    other = StalenessController(ceiling=3)
    other.load_state_dict(c.state_dict())
    assert (other.bound, other.calm) == (3, 2)
    other.load_state_dict({"bound": 7, "calm": 0})
    assert other.bound == 3


# ---- the store ----------------------------------------------------------------------------------

def store(max_staleness: int) -> GroupStore:
    return GroupStore(batch_size=2, max_staleness=max_staleness, topk=2, group_size=4)


def test_announce_bound_moves_eligibility_and_the_credit_rule():
    s = store(0)
    assert s.grant_credits(100) == 2  # (0 + 0 + 1) * 2
    s.announce_bound(3)
    assert s.max_staleness == 3 and s.stats()["max_staleness"] == 3
    assert s.grant_credits(100) == 6  # (0 + 3 + 1) * 2 - 2 granted
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        s.announce_bound(-1)


def test_a_lowered_bound_with_outstanding_credits_strands_no_actor():
    s = store(4)
    assert s.grant_credits(100) == 10  # (0 + 4 + 1) * 2
    for i in range(4):  # four groups made at version 0 and put: six credits still out
        s.put(make_group(f"old{i}", policy_version=0))
    assert s.select(0, 0, 1) is not None and s.select(1, 0, 1) is not None
    s.put(make_group("late", policy_version=0))  # held: 1 stale at bound 4; five credits still out
    s.announce_bound(1)  # the learners' GET for version 2 lowers the bound ...
    assert s.select(2, 0, 1) is None  # ... so "late", 2 stale, is evicted and its credit refunded
    assert (s.stats()["evicted_stale"], s.stats()["groups"]) == (1, 0)
    assert s.open_credits() == 0  # 9 credits in play, the new rule allows (2 + 1 + 1) * 2 = 8
    # the outstanding credits are honoured: groups within the new bound are held and trained on ...
    for i in range(4):
        s.put(make_group(f"v1_{i}", policy_version=1))
    # ... and a group beyond it is evicted on arrival, its credit refunded
    s.put(make_group("v0_late", policy_version=0))
    assert s.stats()["evicted_stale"] == 2
    batch = s.select(2, 0, 1)
    assert sorted(set(batch.column("group_id").to_pylist())) == ["v1_0", "v1_1"]
    assert s.open_credits() == 0  # 8 in play, 8 allowed
    assert s.select(3, 0, 1) is None  # v1_2 and v1_3 are 2 stale at version 3: evicted, refunded
    stats = s.stats()
    assert stats["evicted_stale"] == 4 and stats["credit_violations"] == 0
    assert s.open_credits() == 4  # (3 + 1 + 1) * 2 - (10 - 4): the actors get credits again


def test_a_raised_bound_keeps_held_groups_and_grants_at_once():
    s = store(0)
    s.grant_credits(2)
    s.put(make_group("a", policy_version=0))
    s.announce_bound(2)
    assert s.stats()["groups"] == 1 and s.open_credits() == 4


# ---- wire, GET and the consumption log ----------------------------------------------------------

def test_get_carries_an_optional_bound_and_old_headers_still_parse():
    frames = wire.encode(MsgType.GET, "learner0", 3, learner_version=5, rank=0, world_size=1, max_staleness=2)
    header = wire.decode(frames)[0]
    assert header.max_staleness == 2 and header.fields["max_staleness"] == 2
    old = wire.decode(wire.encode(MsgType.GET, "learner0", 4, learner_version=5, rank=0, world_size=1))[0]
    assert old.max_staleness is wire.UNSET and "max_staleness" not in old.fields
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode(MsgType.GET, "learner0", 5, learner_version=5, rank=0, world_size=1,
                                max_staleness=-1))


def test_consumption_log_records_the_bound_of_each_selection(tmp_path):
    cfg = BufferConfig(run_dir=str(tmp_path), **{**BUFFER_TEST_OPTIONS, "max_staleness": "auto:3"})
    with open_buffer(*buffer_sections(cfg), tmp_path) as buffer:
        assert buffer.store.max_staleness == 0 and buffer.store.bound_moves  # auto starts on-policy
        c = buffer.client("learner0")
        c.put_many([make_group(name, policy_version=0) for name in "abcd"])
        c.get(0)  # no bound announced: the buffer keeps its own (0)
        c.get(1, max_staleness=2)  # version 0's groups are 1 stale: eligible at bound 2
    records = read_consumed(tmp_path)
    assert [(r["learner_version"], r["max_staleness"]) for r in records] == [(0, 0), (1, 2)]
    assert [max(1 - v for v in r["policy_versions"]) for r in records[1:]] == [1]


def test_a_buffer_run_alone_takes_the_bound_over_zmq(tmp_path):
    with serving(tmp_path, max_staleness=1) as server, client(server) as c:
        c.put_many([make_group(name, policy_version=0) for name in "abcd"])
        c.get(0)
        assert c.stats()["max_staleness"] == 1
        with pytest.raises(TimeoutError):  # lowered to 0: version 0's two groups left are stale at version 1
            c.get(1, timeout_s=0.2, max_staleness=0)
        stats = c.stats()
    assert (stats["max_staleness"], stats["evicted_stale"], stats["groups"]) == (0, 2, 0)


def test_a_resumed_buffer_starts_from_the_last_announced_bound(tmp_path):
    from tests.helpers import new_buffer

    with serving(tmp_path, max_staleness="auto:3") as server, client(server) as c:
        assert c.stats()["max_staleness"] == 0
        c.put_many([make_group(name, policy_version=0) for name in "abcd"])
        c.get(0, max_staleness=0)
        c.get(1, max_staleness=2)
    resumed = new_buffer(tmp_path, resume=True, max_staleness="auto:3")
    try:
        assert resumed.handlers.store.max_staleness == 2
    finally:
        resumed.close()
    fixed = new_buffer(tmp_path, resume=True, max_staleness=1)  # a fixed bound is the config's, not the log's
    try:
        assert fixed.handlers.store.max_staleness == 1
    finally:
        fixed.close()
