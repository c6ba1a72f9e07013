"""The wire: typed messages and one decoder (the error codes are in :mod:`distrl.core.errors`, the rows of a
body in :mod:`distrl.core.rows`).

Every socket in distrl carries ZeroMQ multipart messages of one shape:

    frame 0: header, a UTF-8 JSON object: one :class:`Message` struct, tagged by its ``type``
    frame 1: optional body, an Arrow IPC *stream* holding rows of :data:`distrl.core.rows.COMPLETION_SCHEMA`
             (raw payload bytes for a weight CHUNK)

Each message type has one frozen msgspec struct (:data:`MESSAGES`) holding the envelope (``schema``,
``sender``, ``seq``) and its own fields, typed and range-checked by the struct itself. :func:`decode`
(and :func:`decode_raw`, same header path) is the one decoder: a frame that is not JSON, an unknown
``type`` or a bad envelope raises :class:`WireError` (code ``malformed``); a field of the wrong type or
out of range raises :class:`FieldError` (``invalid``); another ``schema`` raises :class:`VersionError`
(``version``) naming both versions. Servers answer each with an ``ERROR`` reply whose ``code`` is an
:class:`ErrorCode` (:func:`distrl.core.errors.error_code` maps an exception to it) and keep serving. Nothing
is unpickled.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar, Union

import msgspec
import pyarrow as pa
from msgspec import UNSET, Meta, UnsetType

from distrl.core.errors import ErrorCode, FieldError, VersionError, WireError
from distrl.core.rows import decode_table, encode_table

SCHEMA_VERSION = 2  # 2: typed structs, GRANT replies CREDIT, STATS counters nested, CREDIT asks acked_groups
MAX_HEADER_BYTES = 1024 * 1024  # a full-weight broadcast manifest lists every tensor


class MsgType(str, enum.Enum):
    """Message types. Requests go client -> server; every request gets exactly one reply."""

    PUT = "PUT"  # actor -> buffer: body = whole groups. Reply ACK
    GET = "GET"  # learner -> buffer. Reply BATCH or WAIT
    CREDIT = "CREDIT"  # actor -> buffer. Reply GRANT
    GRANT = "GRANT"  # the buffer's answer to CREDIT
    STATS = "STATS"  # anyone -> buffer, and the reply {counters}
    LATEST = "LATEST"  # actor -> weight endpoint. Reply ANNOUNCE of the newest version
    ANNOUNCE = "ANNOUNCE"  # weight PUB topic and LATEST reply
    FETCH = "FETCH"  # actor -> weight endpoint: {version} -> MANIFEST; {version, file, offset, length} -> CHUNK
    MANIFEST = "MANIFEST"
    CHUNK = "CHUNK"  # body = raw bytes of the payload file (not Arrow)
    STOP = "STOP"  # learner -> buffer: training is over; GRANT replies say stop from now on. Reply ACK
    SHUTDOWN = "SHUTDOWN"  # owner -> server: stop serving. Reply ACK
    JOIN = "JOIN"  # actor -> buffer: a fresh actor id, please (`distrl rollout --join`). Reply ACK {actor_id}
    LEAVE = "LEAVE"  # actor -> buffer: I stop now; my unused credits return. Reply ACK {returned}
    ACK = "ACK"
    BATCH = "BATCH"  # body = the learner's shard of the selection for learner_version
    WAIT = "WAIT"  # not enough fresh groups yet: ask again
    ERROR = "ERROR"


Count = Annotated[int, Meta(ge=0)]
Version = Annotated[int, Meta(ge=0, le=2**40)]
ENVELOPE = frozenset({"schema", "sender", "seq"})


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    """Frame 0 of every message: the envelope, then the fields of its type (a subclass per type).

    ``schema`` is the sender's wire version, ``sender`` its name (``actor3``, ``learner0``), ``seq`` the
    request number a reply echoes. Optional fields default to ``UNSET`` (absent on the wire: JSON null is
    refused)."""

    type: ClassVar[MsgType]
    schema: int
    sender: str = ""
    seq: int = 0

    @property
    def fields(self) -> dict[str, Any]:
        """The type's own fields that are set, by name (the envelope left out)."""
        return {name: value for name in self.__struct_fields__ if name not in ENVELOPE
                and (value := getattr(self, name)) is not UNSET}

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, frame: bytes) -> "Message":
        """Parse frame 0 (see :func:`decode_header`)."""
        return decode_header(frame)


Header = Message  # the name the callers know: ``Header.decode``, ``header.type/.sender/.seq/.fields``


class Put(Message, frozen=True, tag="PUT"):
    """actor -> buffer; the body holds one or more whole groups."""


class Get(Message, frozen=True, tag="GET"):
    """learner -> buffer: rank ``rank`` of ``world_size`` asks for its shard of version ``learner_version``.
    ``wait_s``: while no batch can be made the buffer may hold the request up to this many seconds and
    answer BATCH as soon as one can (0: answer WAIT at once). ``max_staleness``: the staleness bound in force
    from this version on, announced by learners that move it (``--max_staleness auto``); absent, the buffer
    keeps its own."""

    learner_version: Version
    rank: Annotated[int, Meta(ge=0, le=4095)]
    world_size: Annotated[int, Meta(ge=1, le=4096)]
    wait_s: Annotated[float, Meta(ge=0.0, le=60.0)] = 0.0
    max_staleness: Version | UnsetType = UNSET


class Credit(Message, frozen=True, tag="CREDIT"):
    """actor -> buffer: may I generate ``want`` groups? With ``actor_id`` the GRANT also says how many
    groups of that actor id the buffer has accepted (a restarted or resumed actor skips that many problems).
    ``wait_s``: while the buffer would grant nothing (the credit rule, or memory full), it may hold the
    request up to this many seconds and answer as soon as credits free up (0: answer at once)."""

    want: Annotated[int, Meta(ge=0, le=2**31)]
    actor_id: Annotated[int, Meta(ge=0, le=2**31)] | UnsetType = UNSET
    wait_s: Annotated[float, Meta(ge=0.0, le=60.0)] = 0.0


class Grant(Message, frozen=True, tag="GRANT"):
    """buffer -> actor: ``granted`` groups may be generated; ``stop``: training is over; ``full``: the
    buffer holds its memory bound; ``reason`` says why nothing is granted; ``acked_groups`` answers a
    CREDIT that named an ``actor_id``."""

    granted: Count
    learner_version: Count
    min_policy_version: Count
    stop: bool = False
    full: bool = False
    reason: str | UnsetType = UNSET
    acked_groups: Count | UnsetType = UNSET


class Stats(Message, frozen=True, tag="STATS"):
    """The request has no field; the buffer's reply carries ``counters`` (GroupStore.stats and the server's)."""

    counters: dict[str, Any] | UnsetType = UNSET


class Stop(Message, frozen=True, tag="STOP"):
    """learner -> buffer: training is over."""


class Shutdown(Message, frozen=True, tag="SHUTDOWN"):
    """owner -> server: stop serving."""


class Join(Message, frozen=True, tag="JOIN"):
    """actor -> buffer: a joining actor asks for an actor id no other actor of the run has used; ``first_id``:
    the lowest it may take (the launcher's --number_of_actors: ids below it belong to the launcher's actors)."""

    first_id: Annotated[int, Meta(ge=0, le=2**31)] = 0


class Leave(Message, frozen=True, tag="LEAVE"):
    """actor -> buffer: this sender stops generating; the credits it was granted and did not PUT return now."""


class Ack(Message, frozen=True, tag="ACK"):
    """Reply to PUT (``seq_no`` of its first group, ``duplicate`` if every group was; with several groups
    ``seq_nos`` and the count of ``duplicates``), JOIN (``actor_id``: the new actor's id), LEAVE
    (``returned``: the sender's unused credits given back), STOP and SHUTDOWN (no field)."""

    seq_no: Count | UnsetType = UNSET
    duplicate: bool = False
    seq_nos: list[int] | UnsetType = UNSET
    duplicates: Count = 0
    actor_id: Count | UnsetType = UNSET
    returned: Count | UnsetType = UNSET


class Batch(Message, frozen=True, tag="BATCH"):
    """Reply to GET; the body is the rank's shard (``rows`` completions). ``held_ms``: how long the buffer
    held the GET (``wait_s``) before the batch could be made. The sampling-bias monitor's view
    (:mod:`distrl.buffer.bias`), for ``--bias_correction``: ``bias_generated`` and ``bias_trained``, groups per
    (length, difficulty) cell generated and trained so far; ``bias_cells``, the cell of each group of this
    rank's shard, by ``group_id`` (all three absent from an older buffer)."""

    learner_version: Count
    rank: Count
    world_size: Count
    rows: Count
    held_ms: Annotated[float, Meta(ge=0.0)] = 0.0
    bias_generated: list[Count] | UnsetType = UNSET
    bias_trained: list[Count] | UnsetType = UNSET
    bias_cells: dict[str, Count] | UnsetType = UNSET


class Wait(Message, frozen=True, tag="WAIT"):
    """Reply to GET: not enough fresh groups for ``learner_version`` yet (``reason`` says why)."""

    fresh_groups: Count
    batch_size: Count
    learner_version: Count
    reason: str = ""


class Latest(Message, frozen=True, tag="LATEST"):
    """actor -> weight endpoint: the newest announcement, please."""


class Announce(Message, frozen=True, tag="ANNOUNCE"):
    """A published policy version: the one announcement type (distrl.weights.base.announcement makes one), as the
    publisher sends it, LATEST answers it and subscribers, loaders and actors use it."""

    version: Count
    format: str
    digest: str
    location: str
    published_at: float = 0.0
    nbytes: Count = 0
    manifest: tuple = ()


class Fetch(Message, frozen=True, tag="FETCH"):
    """actor -> weight endpoint: ``version``'s MANIFEST, or with ``file`` a CHUNK of ``length`` bytes at ``offset``."""

    version: int
    file: str | UnsetType = UNSET
    offset: int | UnsetType = UNSET
    length: int | UnsetType = UNSET


class Manifest(Message, frozen=True, tag="MANIFEST"):
    """The files of a version's payload: ``[[name, size in bytes], ...]``."""

    version: Count
    digest: str
    files: list[tuple[str, int]]


class Chunk(Message, frozen=True, tag="CHUNK"):
    """Bytes of ``file`` from ``offset``; the body holds them."""

    version: Count
    file: str
    offset: Count


class Error(Message, frozen=True, tag="ERROR"):
    """The reply to a request that cannot be answered: ``error`` says why, ``code`` what kind."""

    error: str
    code: ErrorCode


MESSAGES: dict[MsgType, type[Message]] = {}
for _cls in Message.__subclasses__():
    _cls.type = MsgType(_cls.__struct_config__.tag)
    MESSAGES[_cls.type] = _cls
assert set(MESSAGES) == set(MsgType), "one struct per message type"
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Union[tuple(MESSAGES.values())])  # noqa: UP007 - a runtime union of classes


class _Envelope(msgspec.Struct):
    """What a header must hold whatever its type and version: read only to explain a refused header."""

    schema: Any = None
    type: Any = None


def decode_header(frame: bytes) -> Message:
    """Parse frame 0 into its message struct.

    Raises VersionError if its ``schema`` is not SCHEMA_VERSION (checked first: a peer of another version
    is told so whatever else differs), FieldError if a field of a known type is of the wrong type or out
    of range, WireError if it is too long, not a JSON object, of an unknown type or with a bad envelope.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        msg = _DECODER.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _refusal(frame, exc) from None
    if msg.schema != SCHEMA_VERSION:
        raise VersionError(msg.schema, SCHEMA_VERSION)
    return msg


def _refusal(frame: bytes, exc: Exception) -> WireError:
    """The WireError that explains why ``frame`` did not decode (see :func:`decode_header`)."""
    try:
        envelope = msgspec.json.decode(frame, type=_Envelope)
    except (msgspec.DecodeError, RecursionError):
        return WireError(f"header is not a JSON object: {exc}")
    if envelope.schema != SCHEMA_VERSION:
        return VersionError(envelope.schema, SCHEMA_VERSION)
    where = str(exc).rpartition("at `$.")[2].rstrip("`")  # the field msgspec names, if any
    known = isinstance(envelope.type, str) and envelope.type in MsgType.__members__
    if not known or not isinstance(exc, msgspec.ValidationError) or where in ENVELOPE | {"type"}:
        return WireError(f"bad header {bytes(frame[:80])!r}: {exc}")
    return FieldError(f"{envelope.type} header: {exc}")


def message(msg_type: MsgType, sender: str = "", seq: int = 0, **fields: Any) -> Message:
    """The struct of one message (not validated: the receiving side's :func:`decode` checks ranges).
    Raises TypeError naming a field that ``msg_type`` does not have."""
    return MESSAGES[msg_type](schema=SCHEMA_VERSION, sender=sender, seq=seq, **fields)


def encode(msg_type: MsgType, sender: str = "", seq: int = 0, body: pa.Table | None = None,
           **fields: Any) -> list[bytes]:
    """Build the frames of one message (body: a completion table, sent as an Arrow IPC stream)."""
    frames = [_ENCODER.encode(message(msg_type, sender, seq, **fields))]
    if body is not None:
        frames.append(encode_table(body))
    return frames


def decode(frames: list[bytes]) -> tuple[Message, pa.Table | None]:
    """Parse the frames of one message into its header struct and optional completion table.
    Raises WireError (see :func:`decode_header`, :func:`decode_table`) or on a wrong frame count."""
    header, body = decode_raw(frames)
    return header, (None if body is None else decode_table(body))


def encode_raw(msg_type: MsgType, sender: str = "", seq: int = 0, body: bytes | None = None,
               **fields: Any) -> list[bytes]:
    """Build the frames of a message whose body is raw bytes (weight payload chunks), not Arrow."""
    frames = [_ENCODER.encode(message(msg_type, sender, seq, **fields))]
    if body is not None:
        frames.append(body)
    return frames


def decode_raw(frames: list) -> tuple[Message, Any]:
    """Parse a message whose optional body is left as it is (raw bytes, a buffer). Raises WireError on a
    bad header (:func:`decode_header`) or frame count."""
    if not frames or len(frames) > 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    return decode_header(frames[0]), (frames[1] if len(frames) == 2 else None)


def error(text: str, sender: str = "", seq: int = 0, code: ErrorCode | str = ErrorCode.INVALID) -> list[bytes]:
    """The frames of an ERROR reply; ``code`` is an :class:`ErrorCode` (or its value)."""
    return encode(MsgType.ERROR, sender, seq, error=text, code=ErrorCode(code))
