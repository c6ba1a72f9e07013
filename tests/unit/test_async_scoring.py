"""--async_scoring: a generator scores its hand-backs in threads while its engine decodes on, and PUTs each group
when its own rewards are in (distrl/rollout/scoring.py), so a slow reward delays only its own group."""

from __future__ import annotations

import threading
import time

import pytest

from distrl.buffer.inprocess import open_buffer
from distrl.buffer.segments import read_segments
from distrl.cmd.assemble import actor_sections, buffer_sections
from distrl.cmd.config import TrainConfig
from distrl.rollout.actor import ActorEndpoints, RolloutActor
from distrl.rollout.scoring import Scoring
from distrl.weights import DirectoryPublisher

SLOW_REWARD = """
import os, time
from pathlib import Path
from distrl.rollout.rewards import integer_match

HERE = Path(__file__).parent

def reward(completion_text, problem):
    if not completion_text:  # the actor's check at start
        return 0.0
    with open(HERE / "calls.log", "a") as log:  # which groups have started scoring
        log.write(f"{problem.meta['op']} {problem.prompt_id}\\n")
    while problem.meta.get("op") == "*" and not (HERE / "release").exists():  # the slow slice waits for the test
        time.sleep(0.02)
    return integer_match(completion_text, problem.gold)
"""


def wait_for(check, what: str, timeout_s: float = 60.0):
    deadline = time.time() + timeout_s
    while not check():
        assert time.time() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def test_limit_0_scores_in_the_callers_thread():
    scoring = Scoring(0)
    assert scoring.submit(threading.get_ident, 1) == [threading.get_ident()]
    assert scoring.waiting() == 0 and scoring.collect(drain=True) == []


def test_jobs_that_end_first_come_first_and_the_limit_makes_the_caller_wait():
    scoring = Scoring(2)
    gate = threading.Event()
    assert scoring.submit(lambda: gate.wait(5) and "slow", 1) == []  # still running: returned later
    got = scoring.submit(lambda: "fast", 1)  # ["fast"] if it ended already
    time.sleep(0.1)
    assert got + scoring.collect() == ["fast"] and scoring.waiting() == 1
    threading.Timer(0.3, gate.set).start()
    out = scoring.submit(lambda: gate.wait(5) and "third", 2)  # 3 groups await > limit 2: waits for a job's end
    assert gate.is_set() and out and scoring.waiting() <= 2
    assert sorted(out + scoring.collect(drain=True)) == ["slow", "third"] and scoring.waiting() == 0
    scoring.close()


def test_a_jobs_exception_reaches_the_caller():
    scoring = Scoring(4)
    with pytest.raises(ZeroDivisionError):  # from submit if the job ended already, else from collect
        scoring.submit(lambda: time.sleep(0.05) or 1 / 0, 1)
        scoring.collect(drain=True)
    scoring.close()
    with pytest.raises(ValueError, match="--async_scoring"):
        Scoring(-1)


def test_an_actor_puts_fast_groups_while_slow_ones_await_their_rewards(tmp_path, qwen_tiny):
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    cfg = TrainConfig(model=str(qwen_tiny), task="arith", arith_ops="+*", engine="hf", backend="hf", dtype="float32",
                      group_size=2, batch_size=8, max_new_tokens=4, max_steps=1, run_name="t", log_dir=str(tmp_path),
                      attest_weights=False, weights_transport="fs", reward=f"{reward}:reward", reward_timeout_s=None,
                      async_scoring=8, seed=3)
    publisher = DirectoryPublisher(tmp_path / "weights")
    with open_buffer(*buffer_sections(cfg), tmp_path / "buffer") as buffer:
        endpoints = ActorEndpoints("in-process", *publisher.addresses)
        actor = RolloutActor(*actor_sections(cfg), 0, endpoints, str(qwen_tiny), work_dir=str(tmp_path),
                             client=buffer.client("actor0"))
        try:
            stats = actor.step(actor.client.credits(want=8)["granted"])
            assert stats["actor/groups"] == 8 and stats["actor/scoring_waiting"] > 0  # the step did not wait
            calls = tmp_path / "calls.log"
            started = lambda: dict(line.split()[::-1] for line in calls.read_text().splitlines())  # noqa: E731
            wait_for(lambda: calls.exists() and len(started()) == 8, "scoring start for each group")
            slow = sum(op == "*" for op in started().values())
            assert 0 < slow < 8
            put = lambda: read_segments(tmp_path / "buffer").to_pylist()  # noqa: E731
            wait_for(lambda: actor.rollouts.flush() is not None and len({r["group_id"] for r in put()}) == 8 - slow,
                     "fast groups")
            assert actor.rollouts.scoring.waiting() == slow and all("*" not in r["prompt_text"] for r in put())
            (tmp_path / "release").touch()
            wait_for(lambda: actor.rollouts.flush() is not None and not actor.rollouts.scoring.waiting(), "slow groups")
            rows = put()
            assert len({r["group_id"] for r in rows}) == 8 and len(rows) == 16
            assert all("*" in r["prompt_text"] for r in rows[-2 * slow:])  # PUT last: the slow slice
        finally:
            (tmp_path / "release").touch()  # a failed check above must not leave the scoring threads waiting
            actor.close()
            publisher.close()
