"""The same-host weight transport (distrl/weights/shm.py): slots in shared memory, read by another process."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
from msgspec.structs import replace

from distrl.weights import WeightError
from distrl.weights.shm import SharedMemoryLoader, SharedMemoryPublisher, map_slot, stamped_version


class Model(torch.nn.Module):
    """Parameters of three dtypes and a tied pair (named_parameters lists it once)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(7, 4, generator=g))
        self.norm = torch.nn.Parameter(torch.randn(5, generator=g).bfloat16())
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed
        self.scale = torch.nn.Parameter(torch.randn(3, generator=g).half())


def expected(seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in Model(seed).named_parameters()}


@pytest.fixture
def publisher(tmp_path):
    pub = SharedMemoryPublisher(tmp_path)
    yield pub
    pub.close()


def receive_in_child(ann, results):
    """Receive `ann` in this process; put (version, {name: equal to the learner's tensor, same dtype})."""
    try:
        version, named = SharedMemoryLoader("cpu").receive(ann)
        want = expected(ann.version)
        results.put((version, {n: torch.equal(t, want[n]) and t.dtype == want[n].dtype for n, t in named}))
    except WeightError as exc:
        results.put((-1, str(exc)))


def test_another_process_receives_each_version_bit_exact(publisher):
    ctx = mp.get_context("spawn")
    for version in (1, 2, 3):
        ann = publisher.publish(version, Model(version))
        assert ann.format == "full" and ann.location.startswith("shm://")
        assert ann.nbytes == 7 * 4 * 4 + 5 * 2 + 3 * 2 and ann.digest.startswith("sum64:")
        results = ctx.Queue()
        child = ctx.Process(target=receive_in_child, args=(ann, results))
        child.start()
        got_version, equal = results.get(timeout=60)
        child.join(timeout=30)
        assert got_version == version
        assert equal == dict.fromkeys(expected(version), True)  # every parameter, bit-exact


def test_two_slots_alternate_and_an_overwritten_version_is_refused(publisher):
    loader = SharedMemoryLoader("cpu")
    anns = [publisher.publish(v, Model(v)) for v in (1, 2)]
    assert anns[0].location != anns[1].location  # the newest version's slot is never the one written next
    assert loader.receive(anns[0])[0] == 1 and loader.receive(anns[1])[0] == 2
    anns.append(publisher.publish(3, Model(3)))
    assert anns[2].location == anns[0].location
    with pytest.raises(WeightError, match="version 1 is no longer in shared memory"):
        loader.receive(anns[0])
    assert loader.receive(anns[1])[0] == 2 and loader.receive(anns[2])[0] == 3
    assert loader.bytes_fetched == 4 * anns[0].nbytes


def test_a_slot_changed_under_the_reader_fails_its_checksum(publisher):
    ann = publisher.publish(1, Model(1))
    slot = publisher.slots[publisher.newest][1]
    assert stamped_version(slot) == 1
    slot[64] ^= 0x01  # the first payload byte changes, the version stamp does not: as a torn read would
    with pytest.raises(WeightError, match="overwritten while loading"):
        SharedMemoryLoader("cpu").receive(ann)


def test_an_actor_on_another_host_gets_a_clear_error(publisher, tmp_path):
    ann = publisher.publish(1, Model(1))
    moved = replace(ann, location=f"shm://{tmp_path}/elsewhere")
    with pytest.raises(WeightError, match="needs every actor on the learner's host"):
        SharedMemoryLoader("cpu").receive(moved)


def test_close_removes_the_slots_and_lora_is_refused(tmp_path):
    pub = SharedMemoryPublisher(tmp_path)
    pub.publish(1, Model(1))
    assert len(list(tmp_path.glob("distrl-weights-*"))) == 2
    peft_like = Model(1)
    peft_like.peft_config = {}
    with pytest.raises(ValueError, match="carries full weights"):
        pub.publish(2, peft_like)
    pub.close()
    assert not list(tmp_path.glob("distrl-weights-*"))


def test_a_restarted_learner_of_the_run_removes_the_slots_of_the_crashed_one(tmp_path):
    crashed = SharedMemoryPublisher(tmp_path, run="/runs/a/weights")
    crashed.publish(1, Model(1))
    other_run = SharedMemoryPublisher(tmp_path, run="/runs/b/weights")
    other_run.publish(1, Model(1))
    restarted = SharedMemoryPublisher(tmp_path, run="/runs/a/weights")
    ann = restarted.publish(2, Model(2))
    try:
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {p.name for p, _ in restarted.slots + other_run.slots}
        assert SharedMemoryLoader("cpu").receive(ann)[0] == 2
    finally:
        for pub in (crashed, other_run, restarted):
            pub.close()


def test_no_room_for_the_slots_is_a_clear_error(tmp_path):
    with pytest.raises(WeightError, match=r"no room for 2 x .* MiB of weights .* --weights_transport fs"):
        map_slot(tmp_path / "too-big", 2**60, create=True)
    assert os.listdir(tmp_path) == []
