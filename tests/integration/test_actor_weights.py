"""A real rollout actor (HF engine, tiny model) against a real buffer and weight publisher: it serves
strictly increasing versions, refuses a corrupted payload and keeps serving what it has, and an actor
started late serves the current version before its first generate."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from distrl.cmd.assemble import actor_sections
from distrl.cmd.config import TrainConfig
from distrl.core.tiny import build_tiny_model
from distrl.rollout.actor import ActorEndpoints, RolloutActor
from distrl.weights import PayloadDirectory, WeightPublisher, announcement
from tests.helpers import new_buffer


def save_adapter(base: Path, seed: int):
    """A writer of a LoRA adapter with random non-zero B (so each version changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def write(d: Path) -> None:
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                               LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                          target_modules=["q_proj", "v_proj", "down_proj"]))
        model.save_pretrained(str(d))
    return write


@pytest.fixture
def stack(tmp_path):
    base = build_tiny_model(tmp_path / "tiny")
    server = new_buffer(tmp_path / "run", batch_size=2, max_staleness=8, topk=2, group_size=2)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    publisher = WeightPublisher()
    transport = PayloadDirectory(tmp_path / "weights")
    cfg = TrainConfig(model=str(base), task="half_vocab", engine="hf", group_size=2, batch_size=2,
                      max_new_tokens=8, lora_rank=8, run_name="t", log_dir=str(tmp_path))
    endpoints = ActorEndpoints(server.address, *publisher.addresses)
    yield dict(base=base, cfg=cfg, endpoints=endpoints, publisher=publisher, transport=transport, tmp=tmp_path)
    publisher.close()
    stop.set()
    thread.join(timeout=10)
    server.close()


def actor(stack, actor_id: int) -> RolloutActor:
    return RolloutActor(*actor_sections(stack["cfg"]), actor_id, stack["endpoints"], str(stack["base"]),
                        work_dir=str(stack["tmp"] / f"a{actor_id}"))


def greedy(a: RolloutActor) -> list[int]:
    return a.engine.generate(["12+34="], 1, 0.0, 8)[0].completions[0].token_ids


def test_versions_increase_corruption_is_refused_and_late_actor_starts_current(stack):
    pub, transport = stack["publisher"], stack["transport"]
    a = actor(stack, 0)
    served = [a.version]
    v0 = greedy(a)
    pub.announce(transport.publish(1, "lora", save_adapter(stack["base"], 1)))
    a._refresh_weights(1)
    served.append(a.version)
    v1 = greedy(a)
    assert v1 != v0
    # Version 2's payload is corrupted after its digest was announced: refused, version 1 still served.
    ann2 = transport.publish(2, "lora", save_adapter(stack["base"], 2))
    weights_file = Path(ann2.location) / "adapter_model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-8] + b"\0" * 8)
    pub.announce(ann2)
    a._refresh_weights(0)
    assert a.version == 1 and greedy(a) == v1
    # A good version 3 is served; an older announcement can never replace it.
    pub.announce(transport.publish(3, "lora", save_adapter(stack["base"], 3)))
    a._refresh_weights(3)
    served.append(a.version)
    assert served == [0, 1, 3]
    with pytest.raises(ValueError, match="not newer"):
        pub.announce(announcement(2, "lora", ann2.digest, ann2.location))
    # An actor started now (PUB/SUB has dropped every earlier announcement) serves version 3 at once.
    late = actor(stack, 1)
    late._refresh_weights(0)
    assert late.version == 3 and greedy(late) == greedy(a)
    a.close()
    late.close()
