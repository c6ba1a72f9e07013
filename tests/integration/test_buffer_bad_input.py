"""Acceptance: more than 10,000 malformed or random messages at every request socket — the ROUTER of a real
`distrl buffer` process and the weight endpoint's LATEST/FETCH ROUTER — each answered with an ERROR, while
a well-formed client is served at the same time; nothing crashes.

Oversize messages (above ZMQ_MAXMSGSIZE) are not answered: ZeroMQ drops them and the sender's connection
before the server sees them (docs/protocol.md); the test checks that the server keeps serving after them.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import zmq

from distrl.core import wire
from distrl.core.buffer_client import BufferClient
from distrl.core.rows import encode_table
from distrl.core.wire import Header, MsgType
from distrl.weights.base import WeightPublisher, announcement
from tests.helpers import make_group
from tests.integration.test_buffer_faults import free_port

ROOT = Path(__file__).resolve().parents[2]
REPLY_TYPES = ["ACK", "BATCH", "WAIT", "ERROR", "ANNOUNCE", "MANIFEST", "CHUNK"]
JUNK = [None, -1, 2**70, 1.5, "x", [], {"a": 1}, True]
JUNK_W = [j for j in JUNK if j is not True]  # the weight endpoint reads JSON true as the integer 1


def header(msg_type: str, schema=wire.SCHEMA_VERSION, **fields) -> bytes:
    return json.dumps({"type": msg_type, "schema": schema, "sender": "fuzz", "seq": 1, **fields}).encode()


def arrow_variants(rng: random.Random, body: bytes) -> bytes:
    """A body that is not one valid group: truncated, junk, another schema or a wrong-size group."""
    kind = rng.randrange(4)
    if kind == 0:  # cut inside the record batch (a cut of only the 8-byte end-of-stream marker is a valid group)
        return body[: rng.randrange(len(body) - 8)]
    if kind == 1:
        return rng.randbytes(rng.randrange(1, 400))
    if kind == 2:
        other = pa.table({"sample_id": [str(rng.random())], "reward": [rng.random()]})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, other.schema) as w:
            w.write_table(other)
        return sink.getvalue().to_pybytes()
    return encode_table(make_group(f"short{rng.random()}", group_size=rng.choice([1, 2, 3, 5])))


def common_garbage(rng: random.Random, big_header: bool = True) -> list[bytes]:
    """Malformed for any endpoint: not JSON, not an object, wrong version, unknown or reply types, a header
    over wire.MAX_HEADER_BYTES (``big_header``), wrong frame counts."""
    kind = rng.randrange(9)
    if kind == 7 and not big_header:
        kind = 0
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:
        return [b""]
    if kind == 2:
        return [rng.choice([b"[1,2]", b"42", b'"PUT"', b"null", b"{", b"[" * 5000 + b"]" * 5000])]
    if kind == 3:
        return [header("PUT", schema=rng.choice([0, 2, "1", None, 99]))]
    if kind == 4:
        return [header(rng.choice(["FROB", "", "put", "GET ", 7, None, ["PUT"]]))]
    if kind == 5:
        return [header(rng.choice(REPLY_TYPES))]
    if kind == 6:
        return [json.dumps({"type": "GET", "schema": 1, "seq": rng.choice(["1", 1.5, None, [1]])}).encode()]
    if kind == 7:
        return [header("STATS", pad="x" * (wire.MAX_HEADER_BYTES + 10))]
    return [rng.randbytes(rng.randrange(1, 50)) for _ in range(rng.randrange(3, 7))]  # wrong frame count


def bad_buffer_request(rng: random.Random, body: bytes) -> list[bytes]:
    """One message the buffer must answer with ERROR."""
    kind = rng.randrange(6)
    if kind == 0:
        return common_garbage(rng)
    if kind == 1:
        return [header("PUT"), arrow_variants(rng, body)]
    if kind == 2:
        return [header("PUT")]  # no body
    if kind == 3:
        return [header("PUT"), body, body]  # three frames
    if kind == 4:
        good = dict(learner_version=0, rank=0, world_size=1)
        key = rng.choice(list(good))
        good[key] = rng.choice(JUNK + ([] if key == "learner_version" else [10**9]))  # a far version is legal
        if good["rank"] == 0 and good["world_size"] == 1 and good["learner_version"] == 0:
            good["rank"] = 5
        return [header("GET", **good)]
    return [header("CREDIT", want=rng.choice(JUNK + [-5, 2**40]))] if rng.random() < 0.8 else [
        header(rng.choice(["LATEST", "FETCH"]))]


def bad_weight_request(rng: random.Random) -> list[bytes]:
    """One message the weight endpoint must answer with ERROR."""
    if rng.random() < 0.5:
        return common_garbage(rng, big_header=False)  # the endpoint's MAXMSGSIZE is below MAX_HEADER_BYTES
    fields = rng.choice([
        {"version": rng.choice(JUNK_W + [2, 99])},
        {"version": 1, "file": rng.choice(["../../etc/passwd", "x\x00y", "", "/abs", "missing.bin", 7, None])},
        {"version": 1, "file": "adapter.bin", "offset": rng.choice(JUNK_W + [-1]), "length": 10},
        {"version": 1, "file": "adapter.bin", "offset": 0, "length": rng.choice(JUNK_W + [0, 2**40])},
    ])
    return [header(rng.choice(["FETCH", "PUT", "GET", "CREDIT"]) if "file" not in fields else "FETCH", **fields)]


def fire(address: str, messages: list[list[bytes]], window: int = 64) -> list[Header]:
    """Send every message from one DEALER, ``window`` in flight; return the replies (5 s per window)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    replies = []
    try:
        for start in range(0, len(messages), window):
            chunk = messages[start:start + window]
            for frames in chunk:
                sock.send_multipart(frames)
            for _ in chunk:
                assert sock.poll(5000), f"no reply after {len(replies)} messages"
                replies.append(wire.decode_raw(sock.recv_multipart())[0])
    finally:
        sock.close()
        ctx.term()
    return replies


def good_client(address: str, stop: threading.Event, done: dict) -> None:
    """PUT, CREDIT, GET and STATS in a loop, checking every answer, until ``stop``."""
    with BufferClient(address, "good", timeout_s=5.0, retries=0) as c:
        version = 0
        while not stop.is_set():
            assert c.credits(1)["stop"] == 0
            c.put(make_group(f"good{version}a", policy_version=version))
            c.put(make_group(f"good{version}b", policy_version=version))
            batch = c.get(version, timeout_s=5)
            assert set(batch.column("group_id").to_pylist()) == {f"good{version}a", f"good{version}b"}
            version += 1
        done["versions"] = version
        done["stats"] = c.stats()


def test_ten_thousand_bad_messages_are_answered_and_a_good_client_is_served(tmp_path):
    rng = random.Random(0)
    body = encode_table(make_group("valid-body"))
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "distrl", "buffer", "--address", address, "--run_dir",
                             str(tmp_path / "run"), "--batch_size", "2", "--topk", "4",
                             "--max_msg_bytes", str(4 * 2**20)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    publisher = WeightPublisher()
    payload = tmp_path / "v000001"
    payload.mkdir()
    (payload / "adapter.bin").write_bytes(b"w" * 100)
    publisher.announce(announcement(1, "lora", "digest", str(payload)))
    stop, done = threading.Event(), {}
    try:
        assert "serving at" in proc.stdout.readline()
        thread = threading.Thread(target=good_client, args=(address, stop, done))
        thread.start()
        t0 = time.perf_counter()
        to_buffer = [bad_buffer_request(rng, body) for _ in range(8000)]
        to_weights = [bad_weight_request(rng) for _ in range(2500)]
        buffer_replies = fire(address, to_buffer)
        weight_replies = fire(publisher.latest_address, to_weights)
        # Oversize: zmq drops the message and the connection (no reply); the server keeps serving.
        ctx = zmq.Context()
        big = ctx.socket(zmq.DEALER)
        big.linger = 0
        big.connect(address)
        for _ in range(3):
            big.send_multipart([header("PUT"), b"x" * (5 * 2**20)])
        assert not big.poll(500)
        big.close()
        ctx.term()
        elapsed = time.perf_counter() - t0
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive() and done["versions"] >= 3, done
        for replies in (buffer_replies, weight_replies):
            assert all(h.type is MsgType.ERROR and h.fields.get("error") for h in replies)
        buffer_codes = {h.fields["code"] for h in buffer_replies}
        assert buffer_codes <= {"malformed", "version", "unsupported", "invalid"}, buffer_codes  # no "internal"
        with BufferClient(address, "after", timeout_s=5.0) as c:
            stats = c.stats()
            assert stats["bad_requests"] == len(to_buffer)
            assert stats["groups_put"] == 2 * done["versions"]
            c.shutdown()
        assert proc.wait(timeout=10) == 0
        assert publisher._thread.is_alive()
        print(f"\n{len(to_buffer)} bad messages to the buffer, {len(to_weights)} to the weight endpoint, all "
              f"answered ERROR (codes {sorted(buffer_codes)}) in {elapsed:.1f}s; the good client trained "
              f"{done['versions']} versions meanwhile")
    finally:
        stop.set()
        publisher.close()
        if proc.poll() is None:
            proc.kill()
