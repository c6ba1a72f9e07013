"""Round trips and refusals of distrl.core.wire: nothing malformed gets through, nothing is unpickled."""

import json
import random

import pyarrow as pa
import pytest

from distrl.core import wire
from distrl.core.errors import NoProgress, error_code
from distrl.core.rows import COMPLETION_SCHEMA, decode_group, decode_table, encode_table
from distrl.core.wire import ErrorCode, FieldError, Header, MsgType, WireError
from tests.helpers import make_group


def roundtrip(table: pa.Table) -> pa.Table:
    header, body = wire.decode(wire.encode(MsgType.PUT, "actor0", 7, body=table))
    assert (header.type, header.sender, header.seq, header.fields) == (MsgType.PUT, "actor0", 7, {})
    assert isinstance(header, wire.Put)
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
        encode_table(other)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, other.schema) as writer:
        writer.write_table(other)
    with pytest.raises(WireError, match="schema"):
        wire.decode([wire.encode(MsgType.PUT)[0], sink.getvalue().to_pybytes()])


@pytest.mark.parametrize("cut", [1, 10, 100, -200, -1])
def test_truncated_body_refused(cut):
    body = encode_table(make_group())
    with pytest.raises(WireError):
        decode_table(body[:cut])


def test_mutated_bodies_raise_only_wire_errors():
    body = encode_table(make_group())
    rng = random.Random(0)
    for _ in range(3000):
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            decode_table(bytes(mutated))
        except WireError:
            pass


def test_garbage_body_refused():
    with pytest.raises(WireError):
        decode_table(b"\x80\x04\x95pickle-ish bytes")


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
    frames = wire.encode(MsgType.STATS) * n_frames
    with pytest.raises(WireError, match="frames"):
        wire.decode(frames)


def test_error_reply():
    header, _ = wire.decode(wire.error("boom", "buffer", 4))
    assert header.type is MsgType.ERROR and header.fields == {"error": "boom", "code": ErrorCode.INVALID}
    assert header.seq == 4 and header.code == "invalid"  # a str enum: equal to its value
    header, _ = wire.decode(wire.error("full", code="full"))
    assert header.code is ErrorCode.FULL
    with pytest.raises(ValueError):
        wire.error("x", code="no such code")
    with pytest.raises(FieldError):
        Header.decode(json.dumps({"type": "ERROR", "schema": wire.SCHEMA_VERSION, "error": "x",
                                  "code": "made-up"}).encode())


def test_another_schema_version_is_a_version_error_naming_both():
    theirs = wire.SCHEMA_VERSION + 1
    with pytest.raises(wire.VersionError, match=f"peer speaks wire version {theirs}, this side speaks "
                                                f"{wire.SCHEMA_VERSION}") as info:
        Header.decode(json.dumps({"type": "PUT", "schema": theirs}).encode())
    assert (info.value.theirs, info.value.ours, info.value.code) == (theirs, wire.SCHEMA_VERSION, ErrorCode.VERSION)
    # checked before the fields: a peer whose messages changed shape still hears about the version
    with pytest.raises(wire.VersionError):
        Header.decode(json.dumps({"type": "GET", "schema": theirs, "learner_version": "new"}).encode())


def test_every_type_has_one_struct_and_fields_round_trip():
    assert set(wire.MESSAGES) == set(MsgType)
    frames = wire.encode(MsgType.GRANT, "buffer", 3, granted=2, learner_version=5, min_policy_version=4,
                         acked_groups=7)
    header, _ = wire.decode(frames)
    assert isinstance(header, wire.Grant) and (header.granted, header.acked_groups, header.stop) == (2, 7, False)
    assert header.fields == {"granted": 2, "learner_version": 5, "min_policy_version": 4, "stop": False,
                             "full": False, "acked_groups": 7}  # reason is unset: absent
    assert b"reason" not in frames[0]
    with pytest.raises(TypeError, match="frob"):
        wire.encode(MsgType.GET, frob=1)


@pytest.mark.parametrize("fields, where", [
    ({"learner_version": -1, "rank": 0, "world_size": 1}, "learner_version"),
    ({"learner_version": 0, "rank": 0, "world_size": 10**9}, "world_size"),
    ({"learner_version": 0, "rank": "0", "world_size": 1}, "rank"),
    ({"learner_version": True, "rank": 0, "world_size": 1}, "learner_version"),
    ({"learner_version": 2**70, "rank": 0, "world_size": 1}, "learner_version"),
    ({"rank": 0, "world_size": 1}, "learner_version"),
])
def test_fields_are_checked_by_the_struct(fields, where):
    frame = json.dumps({"type": "GET", "schema": wire.SCHEMA_VERSION, **fields}).encode()
    with pytest.raises(FieldError, match=where) as info:
        Header.decode(frame)
    assert error_code(info.value) is ErrorCode.INVALID


def test_optional_fields_refuse_null():
    frame = json.dumps({"type": "FETCH", "schema": wire.SCHEMA_VERSION, "version": 1, "file": None}).encode()
    with pytest.raises(FieldError, match="file"):
        Header.decode(frame)
    header = Header.decode(json.dumps({"type": "FETCH", "schema": wire.SCHEMA_VERSION, "version": 1}).encode())
    assert header.fields == {"version": 1} and "file" not in header.fields


def test_error_codes_of_exceptions():
    cases = [(WireError("x"), "malformed"), (wire.VersionError(3, 2), "version"), (FieldError("x"), "invalid"),
             (NoProgress("x"), "no_progress"), (ValueError("x"), "invalid"), (KeyError("x"), "invalid"),
             (RuntimeError("x"), "internal")]
    assert [error_code(exc).value for exc, _ in cases] == [code for _, code in cases]


def test_decode_group_returns_the_batch_and_its_raw_message():
    group = make_group("g", group_size=3)
    frame = encode_table(group)
    batch, message = decode_group(frame)
    assert pa.Table.from_batches([batch]).equals(group)
    stream = COMPLETION_SCHEMA.serialize().to_pybytes() + bytes(message) + b"\xff\xff\xff\xff\x00\x00\x00\x00"
    assert pa.ipc.open_stream(stream).read_all().equals(group)  # the message appends to any stream as is
    two = encode_table(pa.concat_tables([make_group("a"), make_group("b")]))
    for bad, match in [(two, "one record batch"), (frame[:-20], "record batch|not a valid Arrow"),
                       (b"", "record batch|not a valid Arrow"), (frame[:200], "not a valid Arrow"),
                       (encode_table(COMPLETION_SCHEMA.empty_table()), "not a valid Arrow")]:
        with pytest.raises(WireError, match=match):
            decode_group(bad)
