"""The actor and learner loops as units: one actor step and one learner step of the real code (HF engine,
transformers learner, CPU, the session's tiny Qwen2) against the in-process buffer (distrl.buffer.inprocess:
the real GroupStore and handlers, no buffer sockets, no Ray); weights go through the real fs publisher. Each role
gets its sections of a `distrl train` config, as distrl/cmd/assemble.py hands them out."""

from __future__ import annotations

import pytest

from distrl.buffer.inprocess import open_buffer
from distrl.buffer.segments import read_consumed, read_segments
from distrl.cmd.assemble import actor_sections, buffer_sections, generator_sections, learner_sections
from distrl.cmd.config import TrainConfig
from distrl.learn.learner import Learner
from distrl.rollout.actor import ActorEndpoints, RolloutActor
from distrl.weights import DirectoryPublisher


@pytest.fixture
def parts(tmp_path, qwen_tiny):
    cfg = TrainConfig(model=str(qwen_tiny), task="arith", engine="hf", backend="hf", dtype="float32", group_size=4,
                      batch_size=2, max_new_tokens=6, max_steps=1, run_name="t", log_dir=str(tmp_path),
                      attest_weights=False, weights_transport="fs", learning_rate=1e-2)
    buffer = open_buffer(*buffer_sections(cfg), tmp_path / "buffer")
    publisher = DirectoryPublisher(tmp_path / "weights")
    endpoints = ActorEndpoints("in-process", *publisher.addresses)
    actor = RolloutActor(*actor_sections(cfg), 0, endpoints, str(qwen_tiny), work_dir=str(tmp_path),
                         client=buffer.client("actor0"))
    try:
        yield dict(cfg=cfg, buffer=buffer, publisher=publisher, actor=actor, model=str(qwen_tiny), tmp=tmp_path)
    finally:
        actor.close()
        publisher.close()
        buffer.close()


def test_one_actor_step_puts_groups_and_one_learner_step_makes_version_1(parts):
    actor, buffer = parts["actor"], parts["buffer"]
    grant = actor.client.credits(want=2)
    assert grant["granted"] == 2 and grant["min_policy_version"] == 0
    stats = actor.step(grant["granted"])
    assert stats["actor/groups"] == 2 and stats["actor/inflight_versions"] == 0
    rows = read_segments(parts["tmp"] / "buffer").to_pylist()  # in the segment log before the ACK
    groups = {r["group_id"] for r in rows}
    assert len(rows) == 8 and len(groups) == 2 and all(g.startswith("actor0-") for g in groups)
    assert {(r["policy_version"], r["last_policy_version"], r["actor_id"]) for r in rows} == {(0, 0, 0)}
    assert buffer.store.stats()["groups"] == 2

    asked = []  # the buffer's address may come late (distrl train: a Ray reference): asked once, after the load
    learner = Learner(*learner_sections(parts["cfg"]), 0, 1, lambda: asked.append(1) or "in-process", parts["model"],
                      parts["publisher"], client=buffer.client("learner0"))
    assert asked == [1] and learner.buffer_address == "in-process"
    try:
        result = learner.run()  # max_steps 1: GET version 0's batch, one optimizer step, publish version 1
    finally:
        learner.close()
    assert result["version"] == learner.version == 1 and len(result["history"]) == 1
    assert result["history"][0]["learner/staleness_max"] == 0
    [consumed] = read_consumed(parts["tmp"] / "buffer")
    assert consumed["learner_version"] == 0 and set(consumed["group_ids"]) == groups
    stats = buffer.store.stats()
    assert stats["selections"] == 1 and stats["groups"] == 0  # top-k rows handed out once: none held
    assert actor.client.credits(want=1)["stop"] == 1  # the learner said STOP after its last version

    actor._refresh_weights(1)  # the actor takes the announced version 1 from the fs publisher
    assert actor.version == 1


def test_learner_generates_its_own_batch_through_the_in_process_buffer(tmp_path, qwen_tiny):
    from distrl.rollout.learner_generates import LearnerGenerator

    cfg = TrainConfig(model=str(qwen_tiny), task="arith", engine="hf", backend="hf", dtype="float32", group_size=4,
                      batch_size=2, max_new_tokens=6, max_steps=1, run_name="t", log_dir=str(tmp_path),
                      attest_weights=False, weights_transport="fs", number_of_actors=0, learner_generates=True)
    publisher = DirectoryPublisher(tmp_path / "weights")
    with open_buffer(*buffer_sections(cfg), tmp_path / "buffer") as buffer:
        learner = Learner(*learner_sections(cfg), 0, 1, "in-process", str(qwen_tiny), publisher,
                          client=buffer.client("learner0"))
        generator = LearnerGenerator(*generator_sections(cfg), 0, cfg.number_of_learners, learner.model,
                                     buffer.client("learner0@test"), str(qwen_tiny),
                                     policy_version=lambda: learner.version)
        learner.while_waiting = generator.generate_once  # as build_learner wires --learner_generates
        try:
            result = learner.run()
        finally:
            generator.close()
            learner.close()
            publisher.close()
    assert result["version"] == 1 and generator.summary()["groups"] == 2
    rows = read_segments(tmp_path / "buffer").to_pylist()
    assert len(rows) == 8 and {(r["actor_id"], r["policy_version"]) for r in rows} == {(-1, 0)}
    assert all(r["group_id"].startswith("learner0@test-") for r in rows)
