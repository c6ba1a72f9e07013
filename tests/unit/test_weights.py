"""Weights by version over real ZMQ sockets: announce/subscribe, late joiners, digests, both transports."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from distrl.core import wire
from distrl.weights import (
    FsFetcher,
    PayloadDirectory,
    WeightError,
    WeightPublisher,
    WeightSubscriber,
    ZmqFetcher,
    announcement,
)


def write_payload(size: int, seed: int):
    def write(d):
        (d / "adapter_config.json").write_text(f'{{"r": 8, "seed": {seed}}}')
        (d / "sub").mkdir()
        (d / "sub" / "weights.bin").write_bytes(os.urandom(size))
    return write


@pytest.fixture
def publisher():
    pub = WeightPublisher()
    yield pub
    pub.close()


def wait_until(fn, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_versions_seen_are_strictly_increasing_and_late_joiner_gets_current(publisher, tmp_path):
    transport = PayloadDirectory(tmp_path / "weights", keep=3)
    sub = WeightSubscriber(*publisher.addresses)
    time.sleep(0.2)  # let SUB connect before the first announcement
    seen = []
    for v in range(1, 6):
        publisher.announce(transport.publish(v, "lora", write_payload(100, v)))
        wait_until(lambda: sub.poll().version == v)  # noqa: B023 (called before the loop moves on)
        seen.append(sub.newest.version)
    assert seen == [1, 2, 3, 4, 5]
    # An older announcement never replaces a newer one.
    with pytest.raises(ValueError, match="not newer"):
        publisher.announce(announcement(3, "lora", "x", "/nowhere"))
    late = WeightSubscriber(*publisher.addresses)
    assert late.poll().version == 0  # PUB/SUB dropped what was sent before it connected
    assert late.request_latest().version == 5
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000003", "v000004", "v000005"]
    sub.close()
    late.close()


@pytest.mark.parametrize("fetcher_kind", ["fs", "zmq"])
def test_fetch_returns_identical_payload_and_refuses_corruption(publisher, tmp_path, fetcher_kind):
    transport = PayloadDirectory(tmp_path / "weights")
    ann = transport.publish(1, "lora", write_payload(300_000, 1))
    publisher.announce(ann)
    fetcher = FsFetcher() if fetcher_kind == "fs" else ZmqFetcher(publisher.latest_address, tmp_path / "cache",
                                                                   chunk_bytes=64 * 1024, window=3)
    path = fetcher.fetch(ann)
    published = tmp_path / "weights" / "v000001" / "sub" / "weights.bin"
    assert (path / "sub" / "weights.bin").read_bytes() == published.read_bytes()
    if fetcher_kind == "zmq":
        assert path != tmp_path / "weights" / "v000001" and fetcher.bytes_fetched > 300_000
    # A payload whose bytes differ from the announced digest is refused.
    bad = announcement(1, "lora", "0" * 64, ann.location)
    fetcher2 = FsFetcher() if fetcher_kind == "fs" else ZmqFetcher(publisher.latest_address, tmp_path / "cache2")
    with pytest.raises(WeightError, match="digest"):
        fetcher2.fetch(bad)


def test_zmq_fetch_of_unknown_version_and_bad_requests_get_errors(publisher, tmp_path):
    ann = PayloadDirectory(tmp_path / "w").publish(1, "lora", write_payload(10, 1))
    publisher.announce(ann)
    with pytest.raises(WeightError, match="not retained"):
        ZmqFetcher(publisher.latest_address, tmp_path / "c", timeout_s=5).fetch(announcement(7, "lora", "d", "x"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(publisher.latest_address)
    bad_requests = [
        [b"not json"],
        wire.encode_raw(wire.MsgType.FETCH, version=1, file="../../etc/passwd", offset=0, length=10),
        wire.encode_raw(wire.MsgType.FETCH, version=1, file="adapter_config.json", offset=-1, length=10),
        wire.encode_raw(wire.MsgType.PUT),
        [b"{}", b"x", b"y"],
    ]
    for frames in bad_requests:
        sock.send_multipart(frames)
        assert sock.poll(5000)
        header, _ = wire.decode_raw(sock.recv_multipart())
        assert header.type == wire.MsgType.ERROR
    # ...and the endpoint still answers a good request.
    sock.send_multipart(wire.encode(wire.MsgType.LATEST))
    assert sock.poll(5000)
    header, _ = wire.decode_raw(sock.recv_multipart())
    assert header.type == wire.MsgType.ANNOUNCE and header.fields["version"] == 1
    sock.close()
