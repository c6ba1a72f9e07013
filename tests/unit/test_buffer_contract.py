"""One contract, two transports: the same requests get the same answers from the in-process buffer client
(distrl.buffer.inprocess) as from the ZeroMQ client against a real buffer server on loopback."""

import json

import zmq

from distrl.buffer.inprocess import open_buffer
from distrl.cmd.assemble import buffer_sections
from distrl.cmd.config import BufferConfig
from distrl.core import wire
from distrl.core.buffer_client import BufferApi, BufferClient, BufferRefused
from distrl.core.wire import MsgType
from tests.helpers import BUFFER_TEST_OPTIONS, make_group
from tests.unit.test_buffer_server import malformed_messages, raw_request, serving

GROUPS = {name: make_group(name, policy_version=v, rewards=[0, 5, 1, 4 + i], actor_id=i % 2)
          for i, (name, v) in enumerate([("a", 0), ("b", 0), ("c", 0), ("d", 1), ("e", 0), ("f", 3)])}


def _answer(call):
    """What a request gave: its value, or the kind of error it raised (text left out: it names the address)."""
    try:
        value = call()
    except BufferRefused as exc:
        return ("refused", type(exc).__name__, exc.code)
    except TimeoutError:
        return ("timeout",)
    if hasattr(value, "to_pydict"):  # a batch: its rows, in order
        return ("batch", value.num_rows, value.to_pydict())
    if isinstance(value, dict):  # stats: every counter but the seconds since each sender last spoke
        return {k: v for k, v in value.items() if k != "last_seen_s"}
    return value


def script(c: BufferApi, raw) -> list:
    """The sequence of requests; ``raw(frames)`` sends frames as they are and returns the reply header."""
    g = GROUPS
    steps = [
        lambda: c.stats(),
        lambda: c.credits(3),
        lambda: c.put(g["a"]),
        lambda: c.put_many([g["b"], g["c"]]),
        lambda: c.put(g["a"]),  # re-sent: a duplicate, its original seq
        lambda: c.get(0, timeout_s=5),
        lambda: c.get(0, timeout_s=5),  # asked again: the same selection
        lambda: c.put(g["d"]),
        lambda: c.get(1, rank=1, world_size=2, timeout_s=5),  # staleness 1 allowed: c (v0) and d (v1)
        lambda: c.get(1, rank=0, world_size=2, timeout_s=5),
        lambda: c.put(g["e"]),  # v0 at learner version 1: still eligible
        lambda: c.get(3, timeout_s=0.3),  # e (v0) now too stale: evicted; f not yet PUT: WAIT until timeout
        lambda: c.put(g["f"]),
        lambda: c.stats(),
        lambda: c.credits(10, wait_s=0.2),
        lambda: c.acked_groups(1),
        lambda: c.join(first_id=5),
        lambda: c.join(),
        lambda: c.leave(),
        # bad requests through the client
        lambda: c.put(make_group("short", group_size=3)),
        lambda: c.put(make_group("mixed", sample_ids=["a/0", "a/1", "new/2", "new/3"])),  # seen and unseen ids
        lambda: c.get(0, rank=3, world_size=2),
        lambda: c.get(0, timeout_s=5),  # a version whose batch was handed out and dropped
        lambda: c._request(MsgType.GET, learner_version=-1, rank=0, world_size=1),
        lambda: c._request(MsgType.STATS, body=g["a"]),
        lambda: c._request(MsgType.PUT),
        lambda: c._request(MsgType.LATEST),
        lambda: c.put(g["a"], full_wait_s=0),  # still a duplicate after all that
    ]
    answers = [_answer(step) for step in steps]
    bad = dict(malformed_messages())
    bad["other wire version"] = [json.dumps({"type": "PUT", "schema": wire.SCHEMA_VERSION + 1, "seq": 4}).encode()]
    for name, frames in bad.items():
        header = raw(frames)
        answers.append((name, header.type, header.fields.get("code"), header.seq))
    answers += [_answer(c.stop), _answer(lambda: c.credits(1)), _answer(c.stats), _answer(c.shutdown)]
    return answers


def test_in_process_and_zmq_clients_give_the_same_answers(tmp_path):
    with serving(tmp_path / "zmq") as server, BufferClient(server.address, "test", timeout_s=5.0, retries=1) as c:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        try:
            over_zmq = script(c, lambda frames: raw_request(sock, frames))
        finally:
            sock.close(linger=0)
            ctx.term()
    cfg = BufferConfig(run_dir=str(tmp_path / "inproc"), **BUFFER_TEST_OPTIONS)
    with open_buffer(*buffer_sections(cfg), tmp_path / "inproc") as buffer:
        in_process = script(buffer.client("test"), lambda frames: wire.decode(buffer.handle(frames))[0])
    assert len(in_process) == len(over_zmq)
    for i, (a, b) in enumerate(zip(in_process, over_zmq)):
        assert a == b, f"answer {i} differs:\nin-process {a}\nzmq        {b}"
    # what the sequence is meant to exercise, checked once
    by = dict(enumerate(in_process))
    assert by[1] == {"granted": 3, "learner_version": 0, "min_policy_version": 0, "stop": 0, "full": 0}
    assert (by[2], by[3], by[4]) == (0, [1, 2], 0)
    assert by[5][0] == "batch" and by[5] == by[6] and by[5][2]["group_id"] == ["a"] * 2 + ["b"] * 2
    assert by[8][2]["group_id"] == ["d"] * 2 and by[9][2]["group_id"] == ["c"] * 2
    assert by[11] == ("timeout",) and by[13]["evicted_stale"] == 1
    assert by[15] == 3 and by[16] == 5 and by[17] == 6
    assert [a[2] for a in in_process[19:27]] == ["invalid"] * 7 + ["unsupported"] and in_process[27] == 0
    codes = {a[0]: a[2] for a in in_process[28:-4]}
    assert codes["other wire version"] == "version" and codes["non-JSON header"] == "malformed"
    assert in_process[-3]["stop"] == 1 and in_process[-1] is None


def test_in_process_client_writes_the_segment_log(tmp_path):
    from distrl.buffer.segments import read_consumed, read_segments

    cfg = BufferConfig(run_dir=str(tmp_path), **BUFFER_TEST_OPTIONS)
    with open_buffer(*buffer_sections(cfg), tmp_path) as buffer:
        c = buffer.client("actor0")
        c.put_many([GROUPS["a"], GROUPS["b"]])
        c.get(0)
    assert read_segments(tmp_path).column("group_id").to_pylist() == ["a"] * 4 + ["b"] * 4
    assert [r["group_ids"] for r in read_consumed(tmp_path)] == [["a", "b"]]
