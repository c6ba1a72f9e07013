"""The wire: message types, headers and the Arrow schema of a completion.

Every socket in distrl carries ZeroMQ multipart messages of one shape:

    frame 0: header, UTF-8 JSON object (see :class:`Header`)
    frame 1: optional body, an Arrow IPC *stream* holding rows of :data:`COMPLETION_SCHEMA`

Nothing is ever unpickled. A frame that is not valid JSON, a header with an unknown type or a
different schema version, or a body that is not an Arrow stream of exactly this schema raises
:class:`WireError`; servers answer it with an ``ERROR`` reply and keep serving.

A *group* is the ``group_size`` completions sampled for one prompt instance; it is the unit of PUT.
This module defines a row's shape once; every role reads and writes rows through it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1
MAX_HEADER_BYTES = 1024 * 1024  # a full-weight broadcast manifest lists every tensor


class WireError(ValueError):
    """A message that does not follow this module's format (the text says what is wrong)."""


class VersionError(WireError):
    """A header whose ``schema`` (protocol version) is not :data:`SCHEMA_VERSION`."""


# The ``code`` field of an ERROR reply (docs/protocol.md): what went wrong, so a client can react.
ERROR_CODES = ("malformed", "version", "unsupported", "invalid", "full", "exhausted", "no_progress", "internal")


class MsgType(str, enum.Enum):
    """Message types. Requests go client -> server; every request gets exactly one reply."""

    PUT = "PUT"  # actor -> buffer: body = one whole group. Reply ACK {seq_no, duplicate}
    GET = "GET"  # learner -> buffer: {learner_version, rank, world_size}. Reply BATCH or WAIT
    CREDIT = "CREDIT"  # actor -> buffer: {want}. Reply CREDIT {granted, learner_version, min_policy_version}
    STATS = "STATS"  # anyone -> buffer. Reply STATS {counters}
    LATEST = "LATEST"  # actor -> weight endpoint. Reply ANNOUNCE of the newest version
    ANNOUNCE = "ANNOUNCE"  # weight PUB topic and LATEST reply: {version, format, digest, location}
    FETCH = "FETCH"  # actor -> weight endpoint: {version} -> MANIFEST; {version, file, offset, length} -> CHUNK
    MANIFEST = "MANIFEST"  # {version, digest, files: [[name, size], ...]}
    CHUNK = "CHUNK"  # {version, file, offset}; body = raw bytes of the payload file (not Arrow)
    STOP = "STOP"  # learner -> buffer: training is over; CREDIT replies say stop=true from now on. Reply ACK
    SHUTDOWN = "SHUTDOWN"  # owner -> server: stop serving. Reply ACK
    ACK = "ACK"
    BATCH = "BATCH"  # body = the learner's shard of the selection for learner_version
    WAIT = "WAIT"  # not enough fresh groups yet: ask again
    ERROR = "ERROR"  # {error: text, code: one of ERROR_CODES}


_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with options builds one per call
_TYPES = {t.value: t for t in MsgType}  # faster than MsgType(value)


@dataclass
class Header:
    """Frame 0 of every message: ``{"type", "schema", "sender", "seq", ...fields}``."""

    type: MsgType
    sender: str = ""
    seq: int = 0
    fields: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        doc = {"type": self.type.value, "schema": SCHEMA_VERSION, "sender": self.sender, "seq": self.seq}
        doc.update(self.fields)
        return _JSON.encode(doc).encode()

    @classmethod
    def decode(cls, frame: bytes) -> "Header":
        """Parse frame 0. Raises WireError on bad JSON, unknown type or another schema version."""
        if len(frame) > MAX_HEADER_BYTES:
            raise WireError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
        try:
            doc = json.loads(frame)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise WireError(f"header is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise WireError("header must be a JSON object")
        if doc.get("schema") != SCHEMA_VERSION:
            raise VersionError(f"schema version {doc.get('schema')!r}, this side speaks {SCHEMA_VERSION}")
        name = doc.pop("type", None)
        msg_type = _TYPES.get(name) if isinstance(name, str) else None
        if msg_type is None:
            raise WireError(f"unknown message type in header {frame[:80]!r}")
        sender, seq = doc.pop("sender", ""), doc.pop("seq", 0)
        doc.pop("schema")
        if not isinstance(sender, str) or not isinstance(seq, int):
            raise WireError("header 'sender' must be a string and 'seq' an integer")
        return cls(msg_type, sender, seq, doc)


# One row per completion. Lists are per token of the completion unless named prompt_*.
COMPLETION_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # unique per completion; duplicates dropped
        pa.field("group_id", pa.string(), nullable=False),  # shared by the n completions of one prompt
        pa.field("prompt_id", pa.string(), nullable=False),  # the task's id of the problem
        pa.field("actor_id", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),  # version at generate start
        pa.field("last_policy_version", pa.int64(), nullable=False),  # newest version seen in flight
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behavior_logprobs", pa.list_(pa.float32()), nullable=False),  # after temperature
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("reward_components", pa.map_(pa.string(), pa.float32()), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),  # computed over the full group
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length"
        pa.field("prompt_text", pa.string(), nullable=False),
        pa.field("completion_text", pa.string(), nullable=False),
        pa.field("gen_start_time", pa.float64(), nullable=False),  # unix seconds
        pa.field("gen_seconds", pa.float64(), nullable=False),  # wall time of the generate call
    ]
)


def table_from_rows(rows: list[dict[str, Any]]) -> pa.Table:
    """Build a completion table from dicts keyed by the schema's field names (KeyError if one is missing)."""
    columns = {f.name: [row[f.name] for row in rows] for f in COMPLETION_SCHEMA}
    return pa.Table.from_pydict(columns, schema=COMPLETION_SCHEMA)


def encode_table(table: pa.Table) -> bytes:
    """Serialize a completion table as an Arrow IPC stream (one frame)."""
    if not table.schema.equals(COMPLETION_SCHEMA):
        raise WireError("table does not have the completion schema")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, COMPLETION_SCHEMA) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_table(frame: bytes) -> pa.Table:
    """Parse an Arrow IPC stream frame. Raises WireError if truncated, corrupt or of another schema."""
    try:
        with pa.ipc.open_stream(pa.py_buffer(frame)) as reader:
            if not reader.schema.equals(COMPLETION_SCHEMA):
                raise WireError(f"body schema differs from the completion schema: {reader.schema}")
            table = reader.read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError, EOFError) as exc:  # ArrowException: e.g. NotImplemented on garbage
        raise WireError(f"body is not a valid Arrow IPC stream: {exc}") from None
    return table


def encode(msg_type: MsgType, sender: str = "", seq: int = 0, body: pa.Table | None = None,
           **fields: Any) -> list[bytes]:
    """Build the frames of one message."""
    frames = [Header(msg_type, sender, seq, fields).encode()]
    if body is not None:
        frames.append(encode_table(body))
    return frames


def decode(frames: list[bytes]) -> tuple[Header, pa.Table | None]:
    """Parse the frames of one message into its header and optional completion table."""
    if not frames or len(frames) > 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    header = Header.decode(frames[0])
    body = decode_table(frames[1]) if len(frames) == 2 else None
    return header, body


def encode_raw(msg_type: MsgType, sender: str = "", seq: int = 0, body: bytes | None = None,
               **fields: Any) -> list[bytes]:
    """Build the frames of a message whose body is raw bytes (weight payload chunks), not Arrow."""
    frames = [Header(msg_type, sender, seq, fields).encode()]
    if body is not None:
        frames.append(body)
    return frames


def decode_raw(frames: list[bytes]) -> tuple[Header, bytes | None]:
    """Parse a message whose optional body is raw bytes. Raises WireError on a bad header or frame count."""
    if not frames or len(frames) > 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    return Header.decode(frames[0]), (frames[1] if len(frames) == 2 else None)


_SCHEMA_MESSAGE = COMPLETION_SCHEMA.serialize().to_pybytes()  # how this pyarrow writes the schema message
_END_OF_STREAM = (b"", b"\xff\xff\xff\xff\x00\x00\x00\x00", b"\x00\x00\x00\x00")


def decode_group(frame: bytes) -> tuple[pa.RecordBatch, memoryview]:
    """Parse a PUT body: an Arrow IPC stream of COMPLETION_SCHEMA holding exactly one record batch.

    Returns the batch (zero-copy over ``frame``, fully validated) and the raw bytes of its IPC
    message, which a stream of the same schema (a segment file) can append as they are. A stream
    whose schema message is byte-identical to this side's skips schema parsing (the common case,
    several times faster). Raises WireError if the stream is truncated, corrupt, of another schema,
    or holds no or several record batches.
    """
    try:
        source = pa.BufferReader(pa.py_buffer(frame))
        if bytes(frame[:len(_SCHEMA_MESSAGE)]) == _SCHEMA_MESSAGE:  # bytes: faster than comparing memoryviews
            source.seek(len(_SCHEMA_MESSAGE))
        else:
            schema = pa.ipc.read_schema(pa.ipc.read_message(source))
            if not schema.equals(COMPLETION_SCHEMA):
                raise WireError(f"body schema differs from the completion schema: {schema}")
        start = source.tell()
        message = pa.ipc.read_message(source)
        end = source.tell()
        if message.type != "record batch":
            raise WireError(f"body holds a {message.type} message where one record batch belongs")
        if bytes(frame[end:end + 9]) not in _END_OF_STREAM:
            raise WireError("a group must be one record batch; the body holds several messages")
        batch = pa.ipc.read_record_batch(message, COMPLETION_SCHEMA)
        batch.validate(full=True)
    except (pa.ArrowException, OSError, EOFError, TypeError) as exc:
        raise WireError(f"body is not a valid Arrow IPC stream of one record batch: {exc}") from None
    return batch, memoryview(frame)[start:end]


def error(text: str, sender: str = "", seq: int = 0, code: str = "invalid") -> list[bytes]:
    """The frames of an ERROR reply; ``code`` is one of :data:`ERROR_CODES`."""
    return encode(MsgType.ERROR, sender, seq, error=text, code=code)
