"""The collective weight transport on CPU (gloo): the same code path NCCL runs on GPUs."""

from __future__ import annotations

import multiprocessing as mp
import socket

import msgspec
import torch

from distrl.weights import WeightError
from distrl.weights.flat import Layout, checksum
from distrl.weights.nccl import BroadcastReceiver, BroadcastSender


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def named_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("embed.weight", torch.randn(7, 4, generator=g)), ("norm.weight", torch.randn(4, generator=g).bfloat16()),
            ("head.bias", torch.randn(3, generator=g)), ("count", torch.arange(5, dtype=torch.int64) + version)]


def actor(address, rank, actors, announcements, results):
    receiver = BroadcastReceiver(address, rank, actors)
    for _ in range(2):
        ann = announcements.get(timeout=60)
        try:
            version, named = receiver.receive(ann, announcement_of=lambda v: ann)  # noqa: B023 (called at once)
            results.put((rank, version, {n: t.clone() for n, t in named}))
        except WeightError as exc:
            results.put((rank, -1, str(exc)))


def test_layout_views_round_trip():
    named = named_weights(3)
    layout = Layout.of(named)
    assert [dt for dt, _ in layout.sizes()] == ["float32", "bfloat16", "int64"]
    buffers = [torch.cat([t.reshape(-1) for _, t in named if str(t.dtype) == f"torch.{dt}"])
               for dt, _ in layout.sizes()]
    for (name, t), (name2, v) in zip(named, layout.views(buffers)):
        assert name == name2 and torch.equal(t, v)
    assert checksum(buffers) != checksum([b.clone().add_(1) for b in buffers])


def test_checksum_in_pieces_is_the_whole_sum():
    """The digest is the int64 sum of the payload's int16 words (uint8 bytes), whatever the piece size."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 11, generator=g), torch.randn(5, 6, generator=g).to(torch.bfloat16).t(),
               torch.randint(0, 255, (29,), dtype=torch.uint8, generator=g), torch.tensor(3.5)]
    whole = sum(int(t.contiguous().reshape(-1).view(torch.int16 if t.element_size() % 2 == 0 else torch.uint8)
                    .to(torch.int64).sum()) for t in tensors)
    assert {checksum(tensors, chunk) for chunk in (1, 7, 64, 1 << 24)} == {f"sum64:{whole}"}


def test_two_actors_receive_each_version_bit_exact_and_refuse_a_bad_checksum():
    ctx = mp.get_context("spawn")
    port, actors = free_port(), 2
    queues = [ctx.Queue() for _ in range(actors)]
    results = ctx.Queue()
    procs = [ctx.Process(target=actor, args=(f"nccl://127.0.0.1:{port}", 1 + i, actors, queues[i], results))
             for i in range(actors)]
    for p in procs:
        p.start()
    sender = BroadcastSender("127.0.0.1", port, actors)
    try:
        ann1 = sender.publish(1, named_weights(1))
        assert ann1.format == "full" and ann1.nbytes == 7 * 4 * 4 + 4 * 2 + 3 * 4 + 5 * 8
        for q in queues:
            q.put(ann1)
        got = [results.get(timeout=60) for _ in range(actors)]
        for _rank, version, tensors in got:
            assert version == 1
            for name, t in named_weights(1):
                assert torch.equal(tensors[name], t), name
        # A payload that does not match the announced checksum is refused.
        ann2 = sender.publish(2, named_weights(2))
        bad = msgspec.structs.replace(ann2, digest="sum64:0")
        for q in queues:
            q.put(bad)
        got = [results.get(timeout=60) for _ in range(actors)]
        assert all(version == -1 and "checksum" in text for _, version, text in got)
        # The receivers can finish a round before the sender's poll sees its end: wait for it, then count.
        assert sender.flush(timeout_s=30)
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=30)
    assert sender.rounds == 2
