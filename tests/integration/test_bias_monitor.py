"""The sampling-bias monitor on a real buffer server (ZMQ, segment log, TensorBoard) fed a deliberately slow,
long-answer slice: every version an actor PUTs 4 short, easy groups at once and one long, hard group two
versions late, which the buffer evicts as stale. The slice's lateness is scripted by version, not by the clock,
so the gaps are exact. (``tests/data/slow_slice_reward.py`` is the same slice in a `distrl train` run:
bench/bias_correction.py.)"""

from __future__ import annotations

import threading

import pytest

from distrl.cmd.report import read_scalars
from distrl.core.buffer_client import BufferClient
from tests.helpers import make_group, new_buffer

SHORT = dict(completion_len=2, rewards=[1, 1, 1, 0])  # 2..5 tokens: mean 3.5; mean reward 0.75
LONG = dict(completion_len=20, rewards=[0, 0, 0, 1])  # 20..23 tokens: mean 21.5; mean reward 0.25
VERSIONS, FAST, LATE = 5, 4, 2


def test_slow_long_slice_shows_length_and_difficulty_gaps(tmp_path):
    server = new_buffer(tmp_path, batch_size=FAST, max_staleness=1, topk=4, group_size=4)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    granted, cells = 0, []
    try:
        with BufferClient(server.address, "actor0", timeout_s=5.0) as actor, \
                BufferClient(server.address, "learner0", timeout_s=5.0) as learner:
            for v in range(VERSIONS):
                granted += actor.credits(want=FAST + 1)["granted"]
                actor.put_many([make_group(f"fast{v}.{i}", v, **SHORT) for i in range(FAST)])
                if v >= LATE:  # the long group of version v - 2 arrives now; the learner is at v - 1
                    actor.put(make_group(f"slow{v - LATE}", v - LATE, **LONG))
                learner.get(v, timeout_s=10)  # version v: the slow group (v - 2 < v - 1) is evicted as stale
                cells.append(learner.last_bias[2])
            counters = actor.stats()
    finally:
        stop.set()
        thread.join(timeout=10)
    server.handlers.tick()  # the metrics of the final counters (the serve loop writes them about once a second)
    server.close()
    bias = counters["bias"]
    fast, slow = VERSIONS * FAST, VERSIONS - LATE
    assert counters["evicted_stale"] == slow
    assert bias["generated"]["groups"] == fast + slow and bias["trained"]["groups"] == fast
    assert bias["evicted"] == {"groups": slow, "length": 21.5, "difficulty": 0.25, "lag": 2.0}
    gen_len = (fast * 3.5 + slow * 21.5) / (fast + slow)
    gen_reward = (fast * 0.75 + slow * 0.25) / (fast + slow)
    assert bias["len_gap"] == pytest.approx(3.5 - gen_len) and bias["len_gap"] < 0  # trained answers are shorter
    assert bias["difficulty_gap"] == pytest.approx(0.75 - gen_reward) and bias["difficulty_gap"] > 0  # and easier
    assert bias["lag_mean"] == 0.0 and bias["issued"] == granted
    assert bias["untrained_share"] == pytest.approx(1 - fast / granted)
    assert [row["version"] for row in bias["by_version"]] == list(range(VERSIONS))
    assert bias["by_version"][0]["evicted"]["groups"] == 1 and bias["by_version"][4]["evicted"]["groups"] == 0
    # every BATCH named the cells of its groups: 3.5 tokens -> length bucket 1, mean reward 0.75 -> bucket 3
    assert cells == [{f"fast{v}.{i}": 1 * 4 + 3 for i in range(FAST)} for v in range(VERSIONS)]
    scalars = read_scalars(tmp_path / "tb" / "buffer0")
    assert scalars["bias/len_gap"][-1][1] == pytest.approx(bias["len_gap"], rel=1e-6)
    assert scalars["bias/difficulty_gap"][-1][1] == pytest.approx(bias["difficulty_gap"], rel=1e-6)
