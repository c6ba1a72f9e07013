"""The buffer's pure core: validation, duplicates, staleness, top-k, orders, bounds, replay and credits."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distrl.buffer.groups import RecentIds, as_batch, parse_groups
from distrl.buffer.selection import first_k, topk_rows
from distrl.buffer.store import BufferFull, GroupStore
from distrl.core.errors import NoProgress
from tests.helpers import make_group


def store(batch_size=2, max_staleness=1, topk=2, group_size=4, **kw) -> GroupStore:
    return GroupStore(batch_size=batch_size, max_staleness=max_staleness, topk=topk, group_size=group_size, **kw)


# ---- put ----------------------------------------------------------------------------------------

def test_put_assigns_increasing_seq_numbers():
    s = store()
    assert [s.put(make_group(f"g{i}")) for i in range(3)] == [(0, False), (1, False), (2, False)]
    assert s.stats()["groups"] == 3 and s.stats()["rows"] == 12  # whole groups are held


@pytest.mark.parametrize("table, match", [
    (make_group("g", group_size=3), "group_size=4"),
    (pa.concat_tables([make_group("a", group_size=2), make_group("b", group_size=2)]), "share group_id"),
    (pa.concat_tables([make_group("a", 0, group_size=2),
                       make_group("a", 1, group_size=2, sample_ids=["x", "y"])]), "share group_id"),
    (make_group("g", sample_ids=["s", "s", "t", "u"]), "not unique"),
    (make_group("g", rewards=[0, float("nan"), 1, 2]), "NaN or infinite reward"),
    (make_group("g", advantages=[0, float("inf"), 1, 2]), "NaN or infinite advantage"),
    (make_group("g", policy_version=-1), "negative policy_version"),
    (pa.table({"sample_id": ["a"]}), "COMPLETION_SCHEMA"),
])
def test_put_refuses_invalid_groups(table, match):
    s = store()
    with pytest.raises(ValueError, match=match):
        s.put(table)
    assert s.stats()["groups_put"] == 0


def test_duplicates_are_dropped_and_acked_with_original_seq():
    s, persisted = store(), []
    s.put(make_group("a"), lambda t, seq: persisted.append(seq))
    assert s.put(make_group("b"), lambda t, seq: persisted.append(seq)) == (1, False)
    assert s.put(make_group("b"), lambda t, seq: persisted.append(seq)) == (1, True)
    stats = s.stats()
    assert (stats["groups"], stats["groups_put"], stats["duplicates"], len(persisted)) == (2, 2, 1, 2)
    with pytest.raises(ValueError, match="reuses sample ids"):  # partial overlap is not a retry
        s.put(make_group("c", sample_ids=["a/0", "c/1", "c/2", "c/3"]))


def test_failed_persist_changes_nothing():
    def fail(table, seq):
        raise OSError("disk full")

    s = store()
    with pytest.raises(OSError):
        s.put(make_group("a"), fail)
    assert s.stats()["groups_put"] == 0 and s.put(make_group("a")) == (0, False)


def test_group_stale_on_arrival_is_accepted_then_evicted():
    s = store(batch_size=1, max_staleness=1, topk=4)
    s.put(make_group("new", policy_version=3))
    assert s.select(3, 0, 1) is not None and s.learner_version == 3
    persisted = []
    assert s.put(make_group("old", policy_version=1), lambda t, seq: persisted.append(seq)) == (1, False)
    stats = s.stats()
    assert (stats["groups"], stats["evicted_stale"], len(persisted)) == (0, 1, 1)


# ---- selection ----------------------------------------------------------------------------------

def test_topk_keeps_the_k_best_of_each_group_in_original_order():
    group = make_group("g", group_size=8, rewards=[3, 1, 4, 1, 5, 9, 2, 6])
    kept = topk_rows(group, 3)
    assert kept.column("reward").to_pylist() == [5, 9, 6]
    assert kept.column("sample_id").to_pylist() == ["g/4", "g/5", "g/7"]


def test_topk_ties_go_to_earlier_rows():
    kept = topk_rows(make_group("g", rewards=[1, 0, 1, 1]), 2)
    assert kept.column("sample_id").to_pylist() == ["g/0", "g/2"]


def test_topk_by_abs_advantage():
    kept = topk_rows(make_group("g", advantages=[0.1, -2.0, 0.5, 1.0]), 2, by="abs_advantage")
    assert kept.column("sample_id").to_pylist() == ["g/1", "g/3"]


def test_select_applies_topk_to_every_group():
    s = store(batch_size=2, topk=2)
    s.put(make_group("a", rewards=[0, 5, 1, 4]))
    s.put(make_group("b", rewards=[7, 2, 9, 3]))
    batch = s.select(0, 0, 1)
    assert batch.column("reward").to_pylist() == [5, 4, 7, 9]


def test_select_waits_for_batch_size_groups_and_takes_oldest_first():
    s = store(batch_size=2, max_staleness=5)
    s.put(make_group("a"))
    assert s.select(0, 0, 1) is None
    s.put(make_group("b"))
    s.put(make_group("c"))
    batch = s.select(0, 0, 1)
    assert list(dict.fromkeys(batch.column("group_id").to_pylist())) == ["a", "b"]
    assert s.stats()["groups"] == 1


def test_select_skips_and_evicts_stale_groups():
    s = store(batch_size=1, max_staleness=1, topk=4)
    s.put(make_group("v0", policy_version=0))
    s.put(make_group("v1", policy_version=1))
    s.put(make_group("v2", policy_version=2))
    batch = s.select(2, 0, 1)  # v0 has staleness 2 > 1: evicted, never returned
    assert set(batch.column("group_id").to_pylist()) == {"v1"}
    assert s.stats()["evicted_stale"] == 1 and s.stats()["last_staleness"] == [1] * 4


def test_sharding_two_ranks_is_a_disjoint_cover_of_the_selection():
    groups = [make_group(f"g{i}", rewards=[i, 3 * i, 2, 1]) for i in range(4)]
    whole, sharded = store(batch_size=4), store(batch_size=4)
    for g in groups:
        whole.put(g)
        sharded.put(g)
    selection = whole.select(0, 0, 1)
    shard0, shard1 = sharded.select(0, 0, 2), sharded.select(0, 1, 2)
    ids0, ids1 = set(shard0.column("sample_id").to_pylist()), set(shard1.column("sample_id").to_pylist())
    assert not ids0 & ids1
    assert ids0 | ids1 == set(selection.column("sample_id").to_pylist())
    assert set(shard0.column("group_id").to_pylist()) == {"g0", "g2"}


def test_selection_is_kept_until_every_rank_got_its_shard_and_retries_are_idempotent():
    s = store(batch_size=2)
    for i in range(4):
        s.put(make_group(f"g{i}"))
    first = s.select(0, 1, 2)
    assert s.select(0, 1, 2).equals(first)  # a retried GET
    assert s.stats()["selections"] == 1 and s.stats()["groups"] == 2
    s.select(0, 0, 2)
    assert s.select(0, 0, 2) is not None and s.stats()["selections"] == 1
    with pytest.raises(ValueError, match="world_size"):
        s.select(0, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        s.select(1, 2, 2)


def test_learner_version_only_moves_forward():
    s = store(batch_size=1, max_staleness=0)
    s.put(make_group("a", policy_version=2))
    assert s.select(2, 0, 1) is not None
    assert s.select(4, 0, 1) is None and s.learner_version == 4  # a WAIT moves the version too
    with pytest.raises(ValueError, match="version 1 is not newer than version 2"):
        s.select(1, 0, 1)  # older than a batch already handed out: the learners have moved on


@settings(max_examples=300, deadline=None)
@given(
    max_staleness=st.integers(0, 3), batch_size=st.integers(1, 3), topk=st.integers(1, 2),
    world_size=st.integers(1, 2), order=st.sampled_from(["fifo", "freshest", "variance"]),
    replay_ratio=st.integers(1, 3), restamp=st.booleans(),
    ops=st.lists(st.tuples(st.sampled_from(["put", "get", "credit"]), st.integers(-4, 2)), max_size=60),
)
def test_staleness_bound_and_credit_rule_are_never_violated(max_staleness, batch_size, topk, world_size, order,
                                                             replay_ratio, restamp, ops):
    s = store(batch_size=batch_size, max_staleness=max_staleness, topk=topk, group_size=2, order=order,
              replay_ratio=replay_ratio, restamp=restamp)
    served: dict[str, list[int]] = {}  # sample id -> versions it was handed out for
    done: set[int] = set()  # versions whose batch was handed out
    for i, (op, delta) in enumerate(ops):
        if op == "put":
            s.put(make_group(f"g{i}", policy_version=max(0, s.learner_version + delta), group_size=2,
                             rewards=[i % 3, delta]))
        elif op == "credit":
            s.grant_credits(abs(delta) * 2)
            in_play = s.credits_granted - s.credits_refunded
            assert in_play <= (s.learner_version + max_staleness + 1) * batch_size  # AReaL's rule
        else:
            version = max(0, s.learner_version + delta)
            if version <= max(done, default=-1) and version not in s._selections:  # the learners moved on
                with pytest.raises(ValueError, match="not newer"):
                    s.select(version, 0, world_size)
                continue
            shards = [s.select(version, rank, world_size) for rank in range(world_size)]
            if shards[0] is None:
                continue
            done.add(version)
            batch = pa.concat_tables(shards)
            assert batch.num_rows == batch_size * topk
            for sid, pv in zip(batch.column("sample_id").to_pylist(), batch.column("policy_version").to_pylist()):
                assert 0 <= version - pv <= max_staleness
                if version not in served.setdefault(sid, []):
                    served[sid].append(version)
    assert all(len(v) <= replay_ratio for v in served.values())  # used at most replay_ratio times
    stats = s.stats()
    used_up = len({sid.split("/")[0] for sid, v in served.items() if len(v) == replay_ratio})
    assert stats["groups_put"] == stats["groups"] + stats["evicted_stale"] + stats["evicted_zero_variance"] + used_up


# ---- credits ------------------------------------------------------------------------------------

def test_credits_follow_areal_rule():
    s = store(batch_size=4, max_staleness=1)
    assert s.grant_credits(3) == 3
    assert s.grant_credits(10) == 5  # (0 + 1 + 1) * 4 - 3
    assert s.grant_credits(1) == 0
    for i in range(4):
        s.put(make_group(f"g{i}"))
    s.put(make_group("extra"))
    s.select(0, 0, 1)
    assert s.grant_credits(10) == 0  # the learner is still at version 0
    s.select(1, 0, 1)  # learner reaches version 1 (WAIT: only one group left)
    assert s.grant_credits(10) == 4 and s.min_policy_version == 0
    with pytest.raises(ValueError):
        s.grant_credits(-1)


def test_credits_of_stale_groups_are_given_back():
    s = store(batch_size=1, max_staleness=0, topk=4)
    assert s.grant_credits(5) == 1
    s.put(make_group("late", policy_version=0))
    assert s.select(1, 0, 1) is None  # "late" is now stale: evicted, its credit refunded
    assert s.stats()["evicted_stale"] == 1 and s.min_policy_version == 1
    assert s.grant_credits(5) == 2  # (1 + 0 + 1) * 1 - (1 - 1)


def test_stats_has_every_counter():
    keys = {"rows", "groups", "bytes", "groups_put", "duplicates", "evicted_stale", "credits_granted",
            "learner_version", "selections", "last_staleness", "min_policy_version"}
    assert keys <= set(store().stats())


def test_buffer_imports_neither_torch_nor_other_roles():
    code = ("import sys, distrl.buffer, distrl.buffer.server, distrl.core.buffer_client; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.split('.')[:2] in "
            "(['distrl', 'rollout'], ['distrl', 'learn'])]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))


# ---- orders, top-k, filters, bounds, replay -----------------------------------------------------

def hand_built(s: GroupStore) -> None:
    """a..e in PUT order: (policy version, rewards, population variance of the rewards)."""
    s.put(make_group("a", policy_version=0, rewards=[0, 0, 0, 0]))  # variance 0
    s.put(make_group("b", policy_version=1, rewards=[0, 1, 0, 1]))  # 0.25
    s.put(make_group("c", policy_version=1, rewards=[0, 4, 0, 4]))  # 4
    s.put(make_group("d", policy_version=0, rewards=[1, 2, 3, 4]))  # 1.25
    s.put(make_group("e", policy_version=1, rewards=[1, 0, 1, 0]))  # 0.25


@pytest.mark.parametrize("order, expected", [
    ("fifo", ["a", "b", "c"]),  # PUT order
    ("freshest", ["e", "c", "b"]),  # version 1 first, newest PUT first
    ("variance", ["c", "d", "b"]),  # 4, 1.25, then 0.25: b before e (earlier PUT)
])
def test_each_order_takes_exactly_the_expected_groups(order, expected):
    s = store(batch_size=3, max_staleness=5, order=order)
    hand_built(s)
    batch = s.select(1, 0, 1)
    assert list(dict.fromkeys(batch.column("group_id").to_pylist())) == expected
    assert s.stats()["groups"] == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 45))
def test_first_k_equals_a_full_sort(primary, k):
    secondary = list(range(len(primary)))[::-1]  # unique tie-breaks
    got = first_k(np.array(primary), np.array(secondary), k).tolist()
    assert got == sorted(range(len(primary)), key=lambda i: (primary[i], secondary[i]))[:k]


def test_zero_variance_filter_drops_refunds_and_says_why():
    s = store(batch_size=1, topk=4, filter_zero_variance=True)
    assert s.grant_credits(2) == 2
    persisted = []
    assert s.put(make_group("flat", rewards=[1, 1, 1, 1]), lambda t, seq: persisted.append(seq)) == (0, False)
    stats = s.stats()
    assert (stats["groups"], stats["evicted_zero_variance"], stats["credits_refunded"], persisted) == (0, 1, 1, [0])
    assert s.select(0, 0, 1) is None
    assert "1 groups since the last batch were dropped by --filter_zero_variance" in s.wait_reason(0)
    s.put(make_group("signal", rewards=[1, 0, 1, 1]))
    assert s.select(0, 0, 1).column("group_id").to_pylist() == ["signal"] * 4
    assert "filter" not in s.wait_reason(1)
    unfiltered = store(batch_size=1, topk=4)
    unfiltered.put(make_group("flat", rewards=[1, 1, 1, 1]))
    assert unfiltered.select(0, 0, 1).num_rows == 4


def test_consecutive_filtered_groups_stop_the_run_naming_the_flag():
    s = store(batch_size=1, topk=4, filter_zero_variance=True, max_filtered_groups=3)
    flat = lambda name: make_group(name, rewards=[0, 0, 0, 0])  # noqa: E731
    s.put(flat("f0"))
    s.put(flat("f1"))
    s.check_progress()  # two in a row: not yet
    s.put(make_group("signal", rewards=[1, 0, 0, 0]))  # a group that passes resets the count
    s.put_groups(pa.concat_tables([flat("f2"), flat("f3")]))
    assert s.stats()["filtered_in_a_row"] == 2
    s.check_progress()
    s.put(flat("f4"))
    with pytest.raises(NoProgress, match=r"^3 groups in a row had equal rewards .*--filter_zero_variance.*"
                                         r"raise --max_filtered_groups, or check --reward\)$"):
        s.check_progress()
    # In one PUT, only the filtered groups after the last that passed count.
    t = store(batch_size=1, topk=4, filter_zero_variance=True, max_filtered_groups=3)
    t.put_groups(pa.concat_tables([flat("a"), flat("b"), make_group("c", rewards=[1, 0, 0, 0]), flat("d")]))
    assert t.filtered_in_a_row == 1
    # Joint admission of several PUTs (put_messages) counts the same way.
    u = store(batch_size=1, topk=4, filter_zero_variance=True, max_filtered_groups=3)
    u.put_messages([(as_batch(flat(f"m{i}")), None, None) for i in range(3)])
    with pytest.raises(NoProgress):
        u.check_progress()


def test_sparse_reward_is_never_stopped_and_zero_means_no_limit():
    s = store(batch_size=1, topk=4, filter_zero_variance=True, max_filtered_groups=50)
    for i in range(2000):  # one group in 40 varies: 39 flat groups in a row at most, 1950 dropped
        s.put(make_group(f"g{i}", rewards=[1, 0, 0, 0] if i % 40 == 0 else [0, 0, 0, 0]))
        s.check_progress()
    assert s.stats()["evicted_zero_variance"] == 1950
    off = store(batch_size=1, topk=4, filter_zero_variance=True, max_filtered_groups=0)
    for i in range(100):
        off.put(make_group(f"g{i}", rewards=[0, 0, 0, 0]))
    off.check_progress()
    assert off.filtered_in_a_row == 100


def test_memory_bound_refuses_puts_and_stops_credits_until_learners_consume():
    s = store(batch_size=1, topk=2, max_rows=8)  # room for two groups of 4 rows
    s.put(make_group("a"))
    assert not s.full and s.grant_credits(1) == 1
    s.put(make_group("b"))
    assert s.full and s.grant_credits(5) == 0
    persisted = []
    with pytest.raises(BufferFull, match="max_rows=8"):
        s.put(make_group("c"), lambda t, seq: persisted.append(seq))
    stats = s.stats()
    assert (persisted, stats["groups_put"], stats["refused_full"], stats["rows"]) == ([], 2, 1, 8)
    s.select(0, 0, 1)
    assert s.put(make_group("c")) == (2, False)
    with pytest.raises(ValueError, match="cannot hold one batch"):
        store(batch_size=4, topk=2, max_rows=15)
    by_bytes = store(batch_size=1, max_bytes=1)
    with pytest.raises(BufferFull, match="max_bytes=1"):
        by_bytes.put(make_group("a"))


def test_replay_ratio_hands_each_group_out_that_many_times_back_of_the_queue():
    s = store(batch_size=1, topk=4, max_staleness=5, replay_ratio=2)
    s.put(make_group("a"))
    s.put(make_group("b"))
    got = [s.select(v, 0, 1).column("group_id")[0].as_py() for v in range(4)]
    assert got == ["a", "b", "a", "b"]
    assert s.select(4, 0, 1) is None and s.stats()["groups"] == 0


def test_restamp_counts_staleness_from_first_use():
    s = store(batch_size=1, topk=4, max_staleness=1, replay_ratio=3, restamp=True)
    s.put(make_group("old", policy_version=7))  # recorded version 7, from another run
    first = s.select(0, 0, 1)
    assert set(first.column("policy_version").to_pylist()) == {0} and s.last_staleness == [0] * 4
    again = s.select(1, 0, 1)
    assert set(again.column("policy_version").to_pylist()) == {0} and s.last_staleness == [1] * 4
    assert s.select(2, 0, 1) is None  # staleness 2 > 1: evicted, though used only twice of three
    assert s.stats()["evicted_stale"] == 1


def test_future_groups_wait_for_their_version():
    s = store(batch_size=1, topk=4, max_staleness=2)
    s.put(make_group("ahead", policy_version=3))
    assert s.select(1, 0, 1) is None
    assert "1 held groups come from policy versions newer than 1" in s.wait_reason(1)
    assert s.select(3, 0, 1).column("group_id")[0].as_py() == "ahead"


def test_restore_skips_used_up_groups_but_remembers_their_sample_ids():
    s = store(batch_size=1, topk=4, replay_ratio=1)
    s.restore(make_group("used"), seq=0, uses=1)
    s.restore(make_group("fresh"), seq=1, uses=0)
    stats = s.stats()
    assert (stats["groups"], stats["groups_put"], stats["credits_granted"]) == (1, 2, 2)
    assert s.put(make_group("used")) == (0, True)  # a re-sent PUT after the restart
    # a log may hold a group twice: re-sent after the de-duplication window forgot it; the last one counts
    s.restore(make_group("fresh"), seq=2)
    assert s.put(make_group("fresh")) == (2, True) and s.stats()["groups"] == 2


def test_put_groups_takes_several_groups_drops_duplicates_and_persists_only_new_rows():
    s, persisted = store(batch_size=3, topk=2), []
    s.put(make_group("b"))
    batch = pa.concat_tables([make_group("a", rewards=[0, 5, 1, 4]), make_group("b"), make_group("c")])
    results = s.put_groups(batch, lambda b, seq: persisted.append((b.column("group_id").to_pylist(), seq)))
    assert results == [(1, False), (0, True), (2, False)]
    assert persisted == [(["a"] * 4 + ["c"] * 4, 1)]  # one append of the two new groups, first seq 1
    assert s.put_groups(batch) == [(1, True), (0, True), (2, True)]  # a re-sent PUT
    assert s.stats()["duplicates"] == 4 and s.stats()["groups"] == 3
    assert s.select(0, 0, 1).column("reward").to_pylist() == [2, 3, 5, 4, 2, 3]  # b, a, c: top-2 each
    bad = pa.concat_tables([make_group("d"), make_group("e", rewards=[0, float("nan"), 1, 1])])
    with pytest.raises(ValueError, match="NaN"):
        s.put_groups(bad)
    assert s.stats()["groups_put"] == 3  # nothing of a refused PUT is kept
    with pytest.raises(ValueError, match="whole groups"):
        s.put_groups(pa.concat_tables([make_group("f"), make_group("g", group_size=2)]))


def test_top_k_of_groups_from_one_put_equals_top_k_of_each():
    groups = [make_group(f"g{i}", rewards=[(3 * i + j) % 5 for j in range(4)]) for i in range(5)]
    together, apart = store(batch_size=5, topk=2), store(batch_size=5, topk=2)
    together.put_groups(pa.concat_tables(groups[:3]))  # runs of one message, then single ones
    for g in groups[3:]:
        together.put(g)
    for g in groups:
        apart.put(g)
    expected = pa.concat_tables([topk_rows(g, 2) for g in groups])
    assert together.select(0, 0, 1).equals(expected) and apart.select(0, 0, 1).equals(expected)


def test_groups_not_yet_logged_are_neither_handed_out_nor_fresh():
    s = store(batch_size=2)
    for g in ("a", "b", "c"):
        s.put(make_group(g))
    s.logged_below = 1  # the server's log holds only seq 0 so far
    assert s.fresh_groups(0) == 1 and s.select(0, 0, 1) is None
    s.logged_below = 3
    assert s.select(0, 0, 1).column("group_id").to_pylist() == ["a", "a", "b", "b"]


def test_reward_variance_is_numpys_population_variance_and_exactly_zero_when_rewards_are_equal():
    rng = np.random.default_rng(0)
    rewards = (rng.standard_normal((6, 5)) * 10.0 ** rng.integers(-8, 8, (6, 1))).astype(np.float32)
    rewards[2], rewards[4] = 0.3, -7.1e-5  # all equal: exactly 0.0, whatever the rounding of the mean
    batch = pa.concat_tables([make_group(f"g{i}", group_size=5, rewards=r.tolist())
                              for i, r in enumerate(rewards)]).combine_chunks().to_batches()[0]
    variance = parse_groups(batch, 5, 2, "reward").variance.tolist()
    assert variance == rewards.astype(np.float64).var(axis=1).tolist()
    assert variance[2] == 0.0 and variance[4] == 0.0 and min(variance[:2] + variance[5:]) > 0.0


@pytest.mark.parametrize("restamp", [False, True])
def test_several_groups_a_put_equal_one_group_a_put(restamp):
    """The vectorized path (one put_groups of many groups) against one put per group, through duplicates,
    zero-variance and stale groups, re-used slots and slot growth (more than 1024 groups held)."""
    rng = np.random.default_rng(0)
    kw = dict(batch_size=8, max_staleness=2, topk=1, group_size=2, filter_zero_variance=True, replay_ratio=2,
              restamp=restamp)
    together, apart, sent, version, most = store(**kw), store(**kw), [], 0, 0
    for step in range(40):
        fresh = [make_group(f"s{step}g{i}", policy_version=int(rng.integers(max(0, version - 3), version + 2)),
                 group_size=2, rewards=rng.integers(0, 3, 2).tolist()) for i in range(50)]
        resent = [sent[i] for i in rng.choice(len(sent), size=min(3, len(sent)), replace=False)]
        groups = fresh + resent
        sent += fresh
        assert together.put_groups(pa.concat_tables(groups)) == [apart.put(g) for g in groups]
        most = max(most, together.stats()["groups"])
        if step >= 30:
            version += 1
            a, b = together.select(version, 0, 1), apart.select(version, 0, 1)
            assert (a is None) == (b is None) and (a is None or a.equals(b))
    a, b = together.stats(), apart.stats()
    assert a.pop("bytes") > 0 and b.pop("bytes") > 0  # a multi-group PUT splits its message's bytes evenly
    assert a == b and most > 1024 and a["duplicates"] > 0 and a["evicted_zero_variance"] > 0
    assert restamp or a["evicted_stale"] > 0


def test_put_messages_equals_one_put_groups_per_message():
    """The server's path (the PUTs queued at one poll admitted together) against one put_groups per PUT:
    the same answers, errors included, and the same state, through re-sent PUTs, a message repeated
    within one call, invalid messages, a group id reused with new sample ids, zero-variance and stale
    groups, and a full buffer. Both paths must be taken."""
    rng = np.random.default_rng(1)
    kw = dict(batch_size=6, max_staleness=1, topk=1, group_size=2, filter_zero_variance=True, max_rows=40)
    together, apart, sent, version = store(**kw), store(**kw), [], 0
    joint = []
    put_together = together.intake._put_together
    together.intake._put_together = lambda puts: joint.append(put_together(puts)) or joint[-1]

    def answer(put, batch):
        try:
            return put(batch)
        except (ValueError, BufferFull) as exc:
            return type(exc), str(exc)

    def message(step, i):
        kind = rng.integers(0, 12)
        groups = [make_group(f"s{step}m{i}g{j}", policy_version=int(rng.integers(max(0, version - 2), version + 1)),
                             group_size=2, rewards=rng.integers(0, 3, 2).tolist()) for j in range(rng.integers(1, 4))]
        if kind == 0 and sent:
            return sent[rng.integers(len(sent))]  # a re-sent PUT
        if kind == 1:
            groups[-1] = make_group("bad", group_size=2, rewards=[0, float("nan")])
        if kind == 2:
            groups.append(make_group("odd", group_size=1))
        if kind == 3:  # a reused group id with new sample ids: accepted (sample ids are the key)
            groups[0] = make_group("again", group_size=2, rewards=[0, 1], sample_ids=[f"a{step}{i}", f"b{step}{i}"])
        return as_batch(pa.concat_tables(groups))

    for step in range(60):
        batches = [message(step, i) for i in range(int(rng.integers(1, 7)))]
        if rng.random() < 0.2:
            batches.append(batches[0])  # the same PUT twice in one poll (a retry queued behind its original)
        sent += batches
        persisted_a, persisted_b = [], []
        # the callbacks run inside these calls, before the loop moves on
        got = together.put_messages([(b, lambda b, seq: persisted_a.append((b.num_rows, seq)), None)  # noqa: B023
                                     for b in batches])
        want = [answer(lambda b: apart.put_groups(b, lambda b, seq: persisted_b.append((b.num_rows, seq))), b)  # noqa: B023
                for b in batches]
        assert [r if isinstance(r, list) else (type(r), str(r)) for r in got] == want
        assert persisted_a == persisted_b
        if step % 3 == 2:
            version += 1
            a, b = together.select(version, 0, 1), apart.select(version, 0, 1)
            assert (a is None) == (b is None) and (a is None or a.equals(b))
    a, b = together.stats(), apart.stats()
    assert a == b and a["duplicates"] > 0 and a["refused_full"] > 0 and a["evicted_zero_variance"] > 0
    assert a["evicted_stale"] > 0
    assert any(r is not None for r in joint) and any(r is None for r in joint)


def test_recent_ids_remember_at_least_the_window_and_at_most_twice_it():
    ids = RecentIds(window=4)
    for i in range(4):
        ids.update([(f"a{i}", i)])
    assert len(ids) == 4 and ids.get("a0") == 0
    ids.update([("b0", 10), ("b1", 11)])  # the newer generation was full: it becomes the older
    assert ids.get("a0") == 0 and ids.get("b1") == 11 and not ids.isdisjoint(["x", "a3"])
    ids.update([("b2", 12), ("b3", 13)])
    assert len(ids) == 8  # twice the window, the most it holds between updates
    ids.update([("c0", 20)])  # the a's go
    assert ids.get("a0") is None and ids.isdisjoint(["a0", "a1", "a2", "a3"])
    assert [ids.get(f"b{i}") for i in range(4)] == [10, 11, 12, 13] and len(ids) == 5
    with pytest.raises(ValueError, match="window"):
        RecentIds(0)


def test_a_resent_put_is_a_duplicate_within_the_dedup_window_and_memory_stays_bounded():
    s = store(batch_size=1, group_size=4, dedup_window=16, max_rows=10_000)
    assert s.put(make_group("first")) == (0, False)
    for i in range(3):  # 12 newer sample ids: still within the window of 16
        s.put(make_group(f"g{i}"))
    assert s.put(make_group("first")) == (0, True)
    for i in range(3, 200):
        s.put(make_group(f"g{i}"))
        assert len(s.intake._seen) <= 2 * 16 + 4
    assert s.put(make_group("first")) == (201, False)  # long forgotten: accepted again, as documented
    assert s.stats()["duplicates"] == 1
