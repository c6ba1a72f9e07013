"""The buffer's pure core: validation, duplicates, staleness, top-k, sharding and credits."""

import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.store import GroupStore, topk_rows
from tests.helpers import make_group


def store(batch_size=2, max_staleness=1, topk=2, group_size=4, **kw) -> GroupStore:
    return GroupStore(batch_size=batch_size, max_staleness=max_staleness, topk=topk, group_size=group_size, **kw)


# ---- put ----------------------------------------------------------------------------------------

def test_put_assigns_increasing_seq_numbers():
    s = store()
    assert [s.put(make_group(f"g{i}")) for i in range(3)] == [(0, False), (1, False), (2, False)]
    assert s.stats()["groups"] == 3 and s.stats()["rows"] == 12


@pytest.mark.parametrize("table, match", [
    (make_group("g", group_size=3), "group_size=4"),
    (pa.concat_tables([make_group("a", group_size=2), make_group("b", group_size=2)]), "share group_id"),
    (pa.concat_tables([make_group("a", 0, group_size=2),
                       make_group("a", 1, group_size=2, sample_ids=["x", "y"])]), "share group_id"),
    (make_group("g", sample_ids=["s", "s", "t", "u"]), "not unique"),
    (make_group("g", rewards=[0, float("nan"), 1, 2]), "NaN reward"),
    (pa.table({"sample_id": ["a"]}), "COMPLETION_SCHEMA"),
])
def test_put_refuses_invalid_groups(table, match):
    s = store()
    with pytest.raises(ValueError, match=match):
        s.put(table)
    assert s.stats()["groups_put"] == 0


def test_duplicates_are_dropped_and_acked_with_original_seq():
    s, persisted = store(), []
    s.put(make_group("a"), persisted.append)
    assert s.put(make_group("b"), persisted.append) == (1, False)
    assert s.put(make_group("b"), persisted.append) == (1, True)
    stats = s.stats()
    assert (stats["groups"], stats["groups_put"], stats["duplicates"], len(persisted)) == (2, 2, 1, 2)
    with pytest.raises(ValueError, match="reuses sample ids"):  # partial overlap is not a retry
        s.put(make_group("c", sample_ids=["a/0", "c/1", "c/2", "c/3"]))


def test_failed_persist_changes_nothing():
    def fail(table):
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
    assert s.put(make_group("old", policy_version=1), persisted.append) == (1, False)
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
    assert s.select(1, 0, 1) is None and s.learner_version == 2


@settings(max_examples=200, deadline=None)
@given(
    max_staleness=st.integers(0, 3), batch_size=st.integers(1, 3), topk=st.integers(1, 2),
    world_size=st.integers(1, 2),
    ops=st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(-4, 2)), max_size=60),
)
def test_staleness_bound_is_never_violated(max_staleness, batch_size, topk, world_size, ops):
    s = store(batch_size=batch_size, max_staleness=max_staleness, topk=topk, group_size=2)
    served: dict[str, int] = {}  # sample id -> version it was handed out for
    for i, (op, delta) in enumerate(ops):
        if op == "put":
            s.put(make_group(f"g{i}", policy_version=max(0, s.learner_version + delta), group_size=2))
            continue
        version = max(0, s.learner_version + delta)
        shards = [s.select(version, rank, world_size) for rank in range(world_size)]
        if shards[0] is None:
            continue
        batch = pa.concat_tables(shards)
        assert batch.num_rows == batch_size * topk
        for sample_id, pv in zip(batch.column("sample_id").to_pylist(), batch.column("policy_version").to_pylist()):
            assert version - pv <= max_staleness
            assert served.setdefault(sample_id, version) == version  # never handed out for two versions
    stats = s.stats()
    consumed_groups = len({sid.split("/")[0] for sid in served})
    assert stats["groups_put"] == stats["groups"] + stats["evicted_stale"] + consumed_groups


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
    code = ("import sys, buffer, buffer.server, buffer.client; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'rollout', 'learn')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
