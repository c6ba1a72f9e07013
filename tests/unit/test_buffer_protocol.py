"""The buffer's protocol beyond the happy path, over real sockets: error codes, backpressure, WAIT
reasons, resume from the logs, offline replay mode and CURVE authentication."""

import json
import threading
import time

import pytest
import zmq
import zmq.auth

from distrl.buffer.segments import read_consumed, read_segments
from distrl.core import wire
from distrl.core.buffer_client import BufferClient, BufferFullError, BufferRefused, ReplayExhausted, WireVersionMismatch
from distrl.core.wire import MsgType
from tests.helpers import make_group
from tests.unit.test_buffer_server import client, new_server, raw_request, serving


def test_error_codes_name_what_went_wrong(tmp_path):
    with serving(tmp_path) as server:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(server.address)
        try:
            cases = {
                "malformed": [b"\xff\x00garbage"],
                "version": [json.dumps({"type": "PUT", "schema": wire.SCHEMA_VERSION + 1, "seq": 4}).encode()],
                "unsupported": wire.encode(MsgType.LATEST, "raw", 5),
                "invalid": wire.encode(MsgType.GET, "raw", 6, learner_version=-1, rank=0, world_size=1),
            }
            for code, frames in cases.items():
                header = raw_request(raw, frames)
                assert (header.type, header.fields["code"]) == (MsgType.ERROR, code), header
            huge = raw_request(raw, wire.encode(MsgType.GET, "raw", 7, learner_version=0, rank=0, world_size=10**9))
            assert huge.fields["code"] == "invalid" and "world_size" in huge.fields["error"]
        finally:
            raw.close(linger=0)
            ctx.term()
        with client(server) as c:
            with pytest.raises(BufferRefused, match=r"refused GET \(invalid\)") as info:
                c.get(0, rank=3, world_size=2)
            assert info.value.code == "invalid" and c.stats()["bad_requests"] == 6


def test_full_buffer_refuses_puts_with_a_distinct_error_until_learners_consume(tmp_path):
    with serving(tmp_path, batch_size=1, topk=2, max_rows=8) as server, client(server) as c:
        c.put(make_group("a"))
        c.put(make_group("b"))
        assert c.credits(1) == {"granted": 0, "learner_version": 0, "min_policy_version": 0, "stop": 0, "full": 1}
        with pytest.raises(BufferFullError, match=r"refused PUT \(full\): BufferFull: buffer full") as info:
            c.put(make_group("c"), full_wait_s=0)
        assert info.value.code == "full" and c.stats()["refused_full"] == 1
        done = {}
        waiter = BufferClient(server.address, "waiter", timeout_s=5.0)
        thread = threading.Thread(target=lambda: done.setdefault("seq", waiter.put(make_group("c"), full_wait_s=10)))
        thread.start()
        time.sleep(0.3)
        assert "seq" not in done  # still refused, waiting
        c.get(0)  # the learner consumes "a": room for one group
        thread.join(timeout=10)
        waiter.close()
        assert done == {"seq": 2} and c.stats()["groups"] == 2


def test_wait_reply_says_that_the_zero_variance_filter_dropped_everything(tmp_path, caplog):
    with serving(tmp_path, batch_size=1, topk=4, filter_zero_variance=True) as server, client(server) as c:
        for i in range(3):
            c.put(make_group(f"flat{i}", rewards=[2, 2, 2, 2]))
        with pytest.raises(TimeoutError, match="3 groups since the last batch were dropped by --filter_zero_variance"):
            c.get(0, timeout_s=0.2)
        assert c.stats()["evicted_zero_variance"] == 3
    assert any("filter_zero_variance" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_resume_serves_unconsumed_groups_drops_resent_duplicates_and_repeats_the_last_selection(tmp_path):
    with serving(tmp_path, batch_size=2, topk=4) as server, client(server) as c:
        for i in range(3):
            c.put(make_group(f"g{i}"))
        first = c.get(0)
    with serving(tmp_path, batch_size=2, topk=4, resume=True) as server, client(server) as c:
        stats = c.stats()
        assert (stats["groups"], stats["groups_put"], stats["learner_version"]) == (1, 3, 0)
        assert c.put(make_group("g0")) == 0 and c.stats()["duplicates"] == 1  # an actor's re-sent PUT
        assert c.get(0).equals(first)  # a learner's retried GET gets the same batch
        assert c.put(make_group("g3")) == 3
        second = c.get(1)
        assert set(second.column("group_id").to_pylist()) == {"g2", "g3"}  # consumed ones are not served again
    assert [r["learner_version"] for r in read_consumed(tmp_path)] == [0, 1]
    with pytest.raises(FileExistsError, match="--resume"):
        new_server(tmp_path, batch_size=2, topk=4)


def test_resume_with_replay_ratio_serves_consumed_groups_again(tmp_path):
    with serving(tmp_path, batch_size=1, topk=4) as server, client(server) as c:
        c.put(make_group("g0"))
        c.get(0)
    with serving(tmp_path, batch_size=1, topk=4, resume=True, replay_ratio=2) as server, client(server) as c:
        assert c.get(1).column("group_id")[0].as_py() == "g0"


def test_replay_mode_refuses_puts_says_stop_and_ends_with_exhausted(tmp_path):
    source = tmp_path / "source"
    with serving(source, batch_size=1, topk=4) as server, client(server) as c:
        for i in range(2):
            c.put(make_group(f"g{i}"))
    with serving(tmp_path / "replay", batch_size=1, topk=4, max_staleness=5, replay_from=source, replay_ratio=2) \
            as server, \
            client(server) as c:
        assert c.credits(4)["stop"] == 1
        with pytest.raises(BufferRefused, match="takes no PUTs") as info:
            c.put(make_group("new"))
        assert info.value.code == "unsupported"
        assert [c.get(v).column("group_id")[0].as_py() for v in range(4)] == ["g0", "g1", "g0", "g1"]
        with pytest.raises(ReplayExhausted, match="cannot feed version 4"):
            c.get(4)
    assert len(read_consumed(tmp_path / "replay")) == 4


def test_curve_lets_in_only_clients_with_an_allowed_key(tmp_path):
    server_dir, allowed, other = tmp_path / "server", tmp_path / "allowed", tmp_path / "other"
    for d in (server_dir, allowed, other, tmp_path / "clients"):
        d.mkdir()
    _, server_secret = zmq.auth.create_certificates(server_dir, "buffer")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path / "clients", "actor0")
    _, stranger_secret = zmq.auth.create_certificates(other, "stranger")
    (allowed / "actor0.key").write_bytes(open(client_public, "rb").read())
    server_public = server_dir / "buffer.key"
    with serving(tmp_path / "run", curve_secret_key=server_secret, curve_client_keys=str(allowed)) as server:
        with BufferClient(server.address, "actor0", timeout_s=5.0, retries=0, curve_server_key=server_public,
                          curve_client_key=client_secret) as good:
            assert good.put(make_group("a")) == 0
        for kw in ({"curve_server_key": server_public, "curve_client_key": stranger_secret}, {}):
            with BufferClient(server.address, "x", timeout_s=0.3, retries=0, **kw) as bad, \
                    pytest.raises(TimeoutError):
                bad.stats()
        with pytest.raises(ValueError, match="holds no secret key"):
            BufferClient(server.address, "x", curve_server_key=server_public, curve_client_key=server_public)


def test_put_many_acknowledges_each_group_and_its_retry(tmp_path):
    with serving(tmp_path, batch_size=3, topk=2) as server, client(server) as c:
        groups = [make_group(f"g{i}", rewards=[i, 0, 3, 1]) for i in range(3)]
        assert c.put_many(groups) == [0, 1, 2]
        assert c.put_many(groups) == [0, 1, 2] and c.stats()["duplicates"] == 3
        assert c.put_many([make_group("solo")]) == [3]
        assert c.get(0).column("reward").to_pylist() == [3, 1, 1, 3, 2, 3]  # top-2 of g0, g1, g2
    assert read_segments(tmp_path).column("group_id").to_pylist() == sum(([f"g{i}"] * 4 for i in range(3)), []) + [
        "solo"] * 4


def test_put_is_acknowledged_only_after_its_fsync_and_other_requests_do_not_wait(tmp_path, monkeypatch):
    from distrl.buffer import segments

    disk = threading.Event()
    real_sync = segments._sync
    monkeypatch.setattr(segments, "_sync", lambda fd: (disk.wait(10), real_sync(fd)))
    with serving(tmp_path, fsync="batch") as server, client(server) as c, client(server) as other:
        done = {}
        thread = threading.Thread(target=lambda: done.setdefault("seq", c.put(make_group("a"))))
        thread.start()
        time.sleep(0.3)
        assert "seq" not in done  # written, but its fsync has not returned: no ACK yet
        assert other.stats()["groups_put"] == 1  # a STATS is answered meanwhile
        disk.set()
        thread.join(timeout=10)
        assert done == {"seq": 0}


def test_a_wire_version_mismatch_is_refused_naming_both_versions(tmp_path):
    """A peer of another SCHEMA_VERSION, over real sockets: the buffer answers ERROR ``version`` naming both
    versions and keeps serving; a client whose buffer speaks another version raises WireVersionMismatch."""
    theirs = wire.SCHEMA_VERSION + 1
    with serving(tmp_path) as server:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(server.address)
        try:  # a newer client's GET, whatever its fields look like
            frames = [json.dumps({"type": "GET", "schema": theirs, "sender": "new", "seq": 3,
                                  "learner_version": {"v": 0}}).encode()]
            header = raw_request(raw, frames)
        finally:
            raw.close(linger=0)
            ctx.term()
        assert (header.type, header.code, header.seq) == (MsgType.ERROR, wire.ErrorCode.VERSION, 0)
        assert header.error == f"client speaks wire version {theirs}, this buffer speaks {wire.SCHEMA_VERSION}"
        with client(server) as c:
            assert c.put(make_group("after")) == 0 and c.stats()["bad_requests"] == 1

    ctx = zmq.Context()
    old = ctx.socket(zmq.ROUTER)  # a buffer of another wire version: answers every request in its own
    old.bind("tcp://127.0.0.1:*")
    address = old.getsockopt_string(zmq.LAST_ENDPOINT)

    def answer():
        identity, request = old.recv_multipart()
        reply = {"type": "ERROR", "schema": theirs, "sender": "buffer", "seq": json.loads(request)["seq"],
                 "error": "client speaks wire version 2, this buffer speaks 3", "code": "version"}
        old.send_multipart([identity, json.dumps(reply).encode()])
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with BufferClient(address, "actor0", timeout_s=5.0, retries=0) as c, \
                pytest.raises(WireVersionMismatch, match=f"buffer at {address} speaks wire version {theirs}, this "
                                                         f"client speaks {wire.SCHEMA_VERSION}") as info:
            c.credits(1)
        assert info.value.code == "version" and c.resends == 0
    finally:
        thread.join(timeout=5)
        old.close(linger=0)
        ctx.term()


def test_acked_groups_per_actor_survive_a_resume(tmp_path):
    """A CREDIT naming an actor id is answered with that actor's accepted groups (duplicates not counted),
    also after the buffer restarts from its segment log: where a restarted actor resumes its prompts."""
    with serving(tmp_path, batch_size=2, topk=4) as server, client(server) as c:
        c.put_many([make_group("a0", actor_id=0), make_group("a1", actor_id=0), make_group("b0", actor_id=1)])
        c.put(make_group("a0", actor_id=0))  # a re-sent PUT
        assert [c.acked_groups(i) for i in range(3)] == [2, 1, 0]
        assert c.credits(1)["granted"] == 1  # asking acked_groups took no credit
        c.get(0)
    with serving(tmp_path, batch_size=2, topk=4, resume=True) as server, client(server) as c:
        assert [c.acked_groups(i) for i in range(3)] == [2, 1, 0]
        c.put(make_group("b1", actor_id=1))
        assert c.acked_groups(1) == 2
