"""IPv6 addresses (``tcp://[::1]:0``): the buffer, its log replica and the weight endpoints bind them and their
clients connect over them (zmq's IPV6 option is off by default: the bind failed with "No such device").
Skipped only where this machine has no IPv6 loopback."""

from __future__ import annotations

import socket

import pytest
import zmq

from distrl.buffer.replica import ReplicaServer
from distrl.cmd.preflight import ZMQ_ADDRESS
from distrl.core.buffer_client import BufferClient
from distrl.core.tcp import allow_ipv6, is_ipv6
from distrl.weights import PayloadDirectory, WeightPublisher, WeightSubscriber, ZmqFetcher
from tests.helpers import make_group
from tests.unit.test_buffer_server import serving
from tests.unit.test_weights import write_payload


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
ADDRESS = "tcp://[::1]:0"


def test_only_bracketed_ipv6_hosts_turn_the_option_on():
    assert [is_ipv6(a) for a in ("tcp://[::1]:0", "tcp://[::1]", "tcp://[fe80::1%eth0]:5555", "tcp://[::]:*")] == \
        [True] * 4
    assert not any(is_ipv6(a) for a in ("tcp://127.0.0.1:0", "tcp://localhost:5555", "tcp://*:5555",
                                         "ipc:///tmp/x.sock", "inproc://x"))
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        assert allow_ipv6(sock, "tcp://127.0.0.1:1").getsockopt(zmq.IPV6) == 0
        assert allow_ipv6(sock, "tcp://[::1]:1").getsockopt(zmq.IPV6) == 1


def test_preflight_accepts_bracketed_ipv6_hosts():
    assert all(ZMQ_ADDRESS.fullmatch(a) for a in ("tcp://[::1]:0", "tcp://[::1]:5555", "tcp://[fe80::1]:*"))
    assert not ZMQ_ADDRESS.fullmatch("tcp://::1:5555")  # unbracketed: the port cannot be told apart


@needs_ipv6
def test_buffer_on_ipv6_loopback_answers_a_client(tmp_path):
    with serving(tmp_path, address=ADDRESS) as server:
        assert server.address.startswith("tcp://[::1]:") and not server.address.endswith(":0")
        with BufferClient(server.address, "actor0", timeout_s=5.0, retries=1) as client:
            assert client.credits(2)["granted"] == 2
            assert client.put(make_group("a", rewards=[0, 1, 2, 3])) == 0


@needs_ipv6
def test_replica_on_ipv6_loopback_mirrors_the_log(tmp_path):
    replica = ReplicaServer(tmp_path / "replica", ADDRESS).start()
    try:
        assert replica.address.startswith("tcp://[::1]:")
        with serving(tmp_path / "run", address=ADDRESS, replica=replica.address) as server:
            with BufferClient(server.address, "actor0", timeout_s=5.0, retries=1) as client:
                client.put(make_group("a", actor_id=0))
        assert replica.error is None and replica.records > 0
    finally:
        replica.close()


@needs_ipv6
def test_weight_endpoints_on_ipv6_loopback(tmp_path):
    publisher = WeightPublisher(ADDRESS, ADDRESS)
    try:
        assert publisher.pub_address.startswith("tcp://[::1]:")
        ann = PayloadDirectory(tmp_path / "weights").publish(1, "lora", write_payload(1000, 1))
        publisher.announce(ann)
        subscriber = WeightSubscriber(publisher.pub_address, publisher.latest_address)
        assert subscriber.request_latest().version == 1
        subscriber.close()
        path = ZmqFetcher(publisher.latest_address, tmp_path / "cache").fetch(ann)
        published = tmp_path / "weights" / "v000001" / "sub" / "weights.bin"
        assert (path / "sub" / "weights.bin").read_bytes() == published.read_bytes()
    finally:
        publisher.close()
