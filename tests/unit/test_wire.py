"""Round trips and refusals of distrl.core.wire: nothing malformed gets through, nothing is unpickled."""

import json
import random

import pyarrow as pa
import pytest

from distrl.core import wire
from distrl.core.wire import COMPLETION_SCHEMA, Header, MsgType, WireError
from tests.helpers import make_group


def roundtrip(table: pa.Table) -> pa.Table:
    header, body = wire.decode(wire.encode(MsgType.PUT, "actor0", 7, body=table, extra=1))
    assert (header.type, header.sender, header.seq, header.fields) == (MsgType.PUT, "actor0", 7, {"extra": 1})
    return body


def test_empty_table_roundtrip():
    body = roundtrip(COMPLETION_SCHEMA.empty_table())
    assert body.num_rows == 0 and body.schema.equals(COMPLETION_SCHEMA)


def test_group_roundtrip():
    group = make_group("g1", policy_version=3, group_size=5)
    assert roundtrip(group).equals(group)


def test_large_lists_roundtrip():
    group = make_group("big", group_size=16, completion_len=50_000, prompt_len=4_000)
    body = roundtrip(group)
    assert body.equals(group)
    assert len(body.column("completion_ids")[15].as_py()) == 50_015


def test_header_only_message():
    header, body = wire.decode(wire.encode(MsgType.STATS, "x", 1))
    assert header.type is MsgType.STATS and body is None


def test_wrong_schema_refused():
    other = pa.table({"sample_id": ["a"], "reward": [1.0]})
    with pytest.raises(WireError):
        wire.encode_table(other)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, other.schema) as writer:
        writer.write_table(other)
    with pytest.raises(WireError, match="schema"):
        wire.decode([Header(MsgType.PUT).encode(), sink.getvalue().to_pybytes()])


@pytest.mark.parametrize("cut", [1, 10, 100, -200, -1])
def test_truncated_body_refused(cut):
    body = wire.encode_table(make_group())
    with pytest.raises(WireError):
        wire.decode_table(body[:cut])


def test_mutated_bodies_raise_only_wire_errors():
    body = wire.encode_table(make_group())
    rng = random.Random(0)
    for _ in range(3000):
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            wire.decode_table(bytes(mutated))
        except WireError:
            pass


def test_garbage_body_refused():
    with pytest.raises(WireError):
        wire.decode_table(b"\x80\x04\x95pickle-ish bytes")


@pytest.mark.parametrize("frame", [
    b"not json",
    b"\xff\xfe",
    b"[1, 2]",
    json.dumps({"type": "PUT"}).encode(),  # no schema version
    json.dumps({"type": "PUT", "schema": 99}).encode(),
    json.dumps({"type": "FROB", "schema": wire.SCHEMA_VERSION}).encode(),
    json.dumps({"type": "PUT", "schema": wire.SCHEMA_VERSION, "seq": "3"}).encode(),
    json.dumps({"type": "PUT", "schema": wire.SCHEMA_VERSION, "sender": 5}).encode(),
    b"{" + b" " * wire.MAX_HEADER_BYTES + b"}",
    b"[" * 30_000 + b"]" * 30_000,  # nesting deeper than the JSON parser's recursion limit
])
def test_bad_headers_refused(frame):
    with pytest.raises(WireError):
        Header.decode(frame)


@pytest.mark.parametrize("n_frames", [0, 3])
def test_wrong_frame_count_refused(n_frames):
    frames = [Header(MsgType.STATS).encode()] * n_frames
    with pytest.raises(WireError, match="frames"):
        wire.decode(frames)


def test_error_reply():
    header, _ = wire.decode(wire.error("boom", "buffer", 4))
    assert header.type is MsgType.ERROR and header.fields == {"error": "boom", "code": "invalid"} and header.seq == 4
    header, _ = wire.decode(wire.error("full", code="full"))
    assert header.fields["code"] == "full" and "full" in wire.ERROR_CODES


def test_another_schema_version_is_a_version_error():
    with pytest.raises(wire.VersionError, match="schema version 2"):
        Header.decode(json.dumps({"type": "PUT", "schema": 2}).encode())


def test_decode_group_returns_the_batch_and_its_raw_message():
    group = make_group("g", group_size=3)
    frame = wire.encode_table(group)
    batch, message = wire.decode_group(frame)
    assert pa.Table.from_batches([batch]).equals(group)
    stream = COMPLETION_SCHEMA.serialize().to_pybytes() + bytes(message) + b"\xff\xff\xff\xff\x00\x00\x00\x00"
    assert pa.ipc.open_stream(stream).read_all().equals(group)  # the message appends to any stream as is
    two = wire.encode_table(pa.concat_tables([make_group("a"), make_group("b")]))
    for bad, match in [(two, "one record batch"), (frame[:-20], "record batch|not a valid Arrow"),
                       (b"", "record batch|not a valid Arrow"), (frame[:200], "not a valid Arrow"),
                       (wire.encode_table(COMPLETION_SCHEMA.empty_table()), "not a valid Arrow")]:
        with pytest.raises(WireError, match=match):
            wire.decode_group(bad)
