"""Credits over a changing set of actors (issue 21): JOIN, LEAVE and the liveness timeout, over real sockets,
and the store's count of groups accepted beyond AReaL's rule (``credit_violations``)."""

import contextlib
import threading
import time

import pytest

from distrl.buffer.store import GroupStore
from distrl.core import wire
from distrl.core.buffer_client import BufferClient
from distrl.core.wire import MsgType
from tests.helpers import make_group, new_buffer


@contextlib.contextmanager
def serving(run_dir, **kw):
    """A BufferServer on a free port, served by a thread (ticks every poll); closed on exit."""
    server = new_buffer(run_dir, batch_size=2, max_staleness=0, topk=4, **kw)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def client(server, name: str) -> BufferClient:
    return BufferClient(server.address, name, timeout_s=5.0, retries=1)


def test_leave_returns_the_unused_credits_at_once(tmp_path):
    """Rule at version 0, max_staleness 0, batch 2: 2 groups. A takes both, PUTs one, leaves: the other
    returns and B can take it; nothing is beyond the rule."""
    with serving(tmp_path) as server, client(server, "actor0") as a, client(server, "actor1") as b:
        assert a.credits(2)["granted"] == 2
        assert b.credits(2)["granted"] == 0  # the rule is used up
        a.put(make_group("a0", actor_id=0))
        assert a.leave() == 1
        assert b.credits(2)["granted"] == 1
        b.put(make_group("b0", actor_id=1))
        stats = b.stats()
    assert (stats["left"], stats["credits_returned_on_leave"], stats["credits_owed"]) == (1, 1, 0)
    assert (stats["credit_violations"], stats["credit_excess_max"], stats["credits_allowed"]) == (0, 0, 2)


def test_a_silent_actor_loses_its_credits_after_the_timeout(tmp_path):
    """A takes the whole rule and goes silent (as if killed): after --credit_timeout_s its credits return
    (counted 'lost'); a PUT of them afterwards would be beyond the rule, and is counted so."""
    with serving(tmp_path, credit_timeout_s=0.5) as server, client(server, "actor0") as a, \
            client(server, "actor1") as b:
        assert a.credits(2)["granted"] == 2
        assert b.credits(1)["granted"] == 0
        time.sleep(0.3)
        assert b.credits(1)["granted"] == 0  # A's silence is not yet long enough
        deadline = time.monotonic() + 10
        while b.stats()["lost"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = b.stats()
        assert (stats["lost"], stats["credits_returned_on_timeout"], stats["credits_owed"]) == (1, 2, 0)
        assert b.credits(2)["granted"] == 2
        b.put_many([make_group("b0", actor_id=1), make_group("b1", actor_id=1)])
        assert b.stats()["credit_violations"] == 0
        a.put(make_group("a0", actor_id=0))  # the "lost" actor was alive after all
        stats = b.stats()
    assert (stats["credit_violations"], stats["credit_excess_max"]) == (1, 1)


def test_join_hands_out_fresh_actor_ids(tmp_path):
    with serving(tmp_path) as server, client(server, "joiner") as j, client(server, "actor5") as five:
        five.credits(1)
        assert j.join(first_id=2) == 6  # above every sender actor<N> seen
        assert j.join(first_id=2) == 7  # and every id handed out
        assert j.join(first_id=9) == 9
        assert j.stats()["joined_actors"] == []  # joined ids count as live once they speak


def test_leave_and_join_are_typed_messages():
    assert wire.decode(wire.encode(MsgType.LEAVE, "actor3", 4))[0].type is MsgType.LEAVE
    header, _ = wire.decode(wire.encode(MsgType.ACK, "buffer", 4, returned=3))
    assert header.returned == 3
    with pytest.raises(wire.FieldError):
        wire.decode(wire.encode_raw(MsgType.JOIN, "x", 1, first_id=-1))


def test_store_counts_groups_beyond_the_rule():
    """(learner_version + max_staleness + 1) * batch_size: 2 * 2 = 4 groups at version 0; 6 at version 1."""
    store = GroupStore(batch_size=2, max_staleness=1, topk=4, group_size=4)
    for i in range(4):
        store.put(make_group(f"g{i}"))
    assert (store.credit_violations, store.credit_excess_max) == (0, 0)
    store.put(make_group("g4"))
    assert (store.credit_violations, store.credit_excess_max) == (1, 1)
    assert store.select(1, 0, 1) is not None  # version 1 allows 6: one more fits
    store.put(make_group("g5", policy_version=1))
    assert store.credit_violations == 1


def test_a_silent_actor_that_put_all_it_was_granted_is_not_lost(tmp_path):
    with serving(tmp_path, credit_timeout_s=0.3) as server, client(server, "actor0") as a, \
            client(server, "actor1") as b:
        assert a.credits(1)["granted"] == 1
        a.put(make_group("a0", actor_id=0))
        time.sleep(1.5)  # a few ticks past the timeout
        stats = b.stats()
    assert (stats["lost"], stats["owed"], stats["credits_returned_on_timeout"]) == (0, {}, 0)
