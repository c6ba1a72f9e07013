"""`distrl train`'s in-memory CURVE keys (distrl.core.security.RunKeys, issue 20) over real sockets: the buffer and
learner 0's weight endpoints answer a client with the run's keys and give nothing to one without them (plain
TCP, or CURVE with a key pair of its own); when the driver keys a run; the flags that cannot go with it."""

from __future__ import annotations

import pytest
import zmq

from distrl.cmd.config import TrainConfig
from distrl.cmd.nodes import curve_keys
from distrl.core import wire
from distrl.core.buffer_client import BufferClient
from distrl.core.security import RunKeys, use_run_keys
from distrl.core.wire import MsgType
from distrl.weights.base import WeightPublisher, WeightSubscriber, announcement
from distrl.weights.fs import directory_digest
from distrl.weights.zmq import ZmqFetcher
from tests.helpers import make_group
from tests.unit.test_buffer_server import serving


@pytest.fixture
def keys():
    """This process's run keys for the test (as begin_role sets them in a role), plain TCP again after it."""
    keys = RunKeys.make()
    use_run_keys(keys)
    yield keys
    use_run_keys(None)


def no_answer(address: str, server_public: bytes | None, send, kind: int = zmq.DEALER) -> bool:
    """Whether a socket that is no client of the run (plain TCP with ``server_public`` None, else CURVE with a key
    pair of its own) connected to ``address`` gets nothing in 5 rounds of ``send(sock)`` and 0.2 s of waiting."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.linger = 0
    if server_public is not None:
        sock.curve_serverkey = server_public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    try:
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        for _ in range(5):
            try:
                send(sock)
            except zmq.Again:  # no peer took it: the handshake failed
                pass
            if sock.poll(200):
                return False
        return True
    finally:
        sock.close()
        ctx.term()


def test_buffer_answers_only_the_runs_client_key(tmp_path, keys):
    with serving(tmp_path) as server:
        with BufferClient(server.address, "actor0", timeout_s=5.0, retries=0) as good:
            assert good.put(make_group("a")) == 0
            stats = wire.encode(MsgType.STATS, "stranger", 1)
            for server_public in (None, keys.buffer[0]):
                assert no_answer(server.address, server_public, lambda sock: sock.send_multipart(stats, zmq.NOBLOCK))
            assert good.stats()["groups_put"] == 1  # still serving the run's clients


def test_weight_endpoints_answer_only_the_runs_client_key(tmp_path, keys):
    payload = tmp_path / "v1"
    payload.mkdir()
    (payload / "adapter.bin").write_bytes(b"\x01" * 1000)
    ann = announcement(1, "lora", directory_digest(payload), str(payload))
    publisher = WeightPublisher()
    subscriber = WeightSubscriber(*publisher.addresses, "actor0")
    try:
        publisher.announce(ann)
        assert subscriber.request_latest(timeout_s=5.0) == ann  # LATEST on the ROUTER
        fetched = ZmqFetcher(publisher.latest_address, tmp_path / "cache", timeout_s=5.0).fetch(ann)  # FETCH
        assert (fetched / "adapter.bin").read_bytes() == b"\x01" * 1000
        version = 1
        while subscriber.poll().version == 1 and version < 50:  # PUB: the subscription takes a moment
            version += 1
            publisher.announce(announcement(version, "base", "", ""))
            subscriber._sub.poll(200)
        assert subscriber.poll().version == version > 1  # announced on the PUB
        versions = iter(range(version + 1, version + 100))
        for server_public in (None, keys.weights[0]):
            assert no_answer(publisher.latest_address, server_public,
                             lambda sock: sock.send_multipart(wire.encode(MsgType.LATEST, "stranger"), zmq.NOBLOCK))
            assert no_answer(publisher.pub_address, server_public,
                             lambda sock: publisher.announce(announcement(next(versions), "base", "", "")), zmq.SUB)
        assert subscriber.poll().version > version  # the run's subscriber got those announcements
    finally:
        subscriber.close()
        publisher.close()


def test_keys_are_made_off_loopback_unless_no_auth():
    assert curve_keys(TrainConfig(), {"buffer0": "127.0.0.1", "actor0": "127.0.0.2"}) is None  # one host
    keys = curve_keys(TrainConfig(), {"buffer0": "127.0.0.1", "actor0": "10.0.0.2"})
    assert isinstance(keys, RunKeys) and keys.buffer != keys.weights != keys.client
    assert keys.client[1].decode() not in repr(keys) and keys.buffer[1].decode() not in repr(keys)
    assert curve_keys(TrainConfig(auth=False), {"actor0": "10.0.0.2"}) is None


def test_key_files_in_train_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--buffer_curve_server_key is for `distrl learn"):
        TrainConfig(buffer_curve_server_key="buffer.key", buffer_curve_client_key="actor.key_secret")
