"""CREDIT with ``wait_s``: the buffer holds a request it can grant nothing to and answers it as soon as
credits free up (or when its wait runs out, or training stops). Real sockets, real segment files."""

import threading
import time

import pytest

from distrl.core.buffer_client import BufferClient
from tests.helpers import make_group, new_buffer

# batch_size 2, max_staleness 1: the rule allows (learner_version + 2) * 2 groups


@pytest.fixture
def server(tmp_path):
    server = new_buffer(tmp_path)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    server.close()


def client(server, name: str) -> BufferClient:
    return BufferClient(server.address, name, timeout_s=10.0, retries=0)


def ask_in_thread(c: BufferClient, want: int, wait_s: float) -> tuple[threading.Thread, dict]:
    """``c.credits(want, wait_s)`` in a thread; the dict gets the reply and the seconds it took."""
    out: dict = {}

    def ask() -> None:
        t0 = time.monotonic()
        out["reply"] = c.credits(want, wait_s=wait_s)
        out["s"] = time.monotonic() - t0

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread, out


def test_a_held_credit_is_granted_when_the_learner_moves_on(server):
    with client(server, "actor0") as a0, client(server, "actor1") as a1, client(server, "learner0") as learner:
        assert a0.credits(10)["granted"] == 4  # all the rule allows at version 0
        thread, out = ask_in_thread(a1, 2, wait_s=10.0)
        time.sleep(0.5)
        assert thread.is_alive()  # held: nothing can be granted
        with pytest.raises(TimeoutError):
            learner.get(1, timeout_s=0.05)  # version 1 (WAIT: no groups), which opens 2 more credits
        thread.join(timeout=5)
        assert out["reply"]["granted"] == 2 and out["reply"]["learner_version"] == 1
        assert out["s"] < 5.0
        stats = learner.stats()
        assert stats["credits_granted"] == 6 and stats["credits_granted"] <= stats["credits_allowed"]


def test_a_held_credit_is_answered_with_nothing_when_its_wait_runs_out(server):
    with client(server, "actor0") as a0, client(server, "actor1") as a1:
        assert a0.credits(4)["granted"] == 4
        t0 = time.monotonic()
        reply = a1.credits(1, wait_s=0.3)
        assert reply["granted"] == 0 and reply["stop"] == 0
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert a1.credits(1)["granted"] == 0  # without wait_s: answered at once, as before


def test_stop_answers_the_held_credits_with_stop(server):
    with client(server, "actor0") as a0, client(server, "actor1") as a1, client(server, "learner0") as learner:
        assert a0.credits(4)["granted"] == 4
        thread, out = ask_in_thread(a1, 1, wait_s=10.0)
        time.sleep(0.3)
        learner.stop()
        thread.join(timeout=5)
        assert out["reply"] == {**out["reply"], "granted": 0, "stop": 1} and out["s"] < 5.0


def test_an_actor_that_put_its_grant_is_held_too(server):
    with client(server, "actor0") as a0:
        assert a0.credits(4)["granted"] == 4
        a0.put_many([make_group(f"g{i}") for i in range(4)])  # its grant is used: nothing owed
        t0 = time.monotonic()
        assert a0.credits(2, wait_s=0.3)["granted"] == 0
        assert time.monotonic() - t0 >= 0.25  # held, not answered at once
