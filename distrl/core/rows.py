"""The Arrow rows of completions: :data:`COMPLETION_SCHEMA` and its IPC stream codec.

A message's optional body (:mod:`distrl.core.wire`) is an Arrow IPC *stream* of these rows: a PUT carries
one record batch per group (:func:`decode_group`), a BATCH a learner's rows (:func:`encode_table`,
:func:`decode_table`). The segment logs (distrl.buffer.segments) store the same stream format. A *group* is the
``group_size`` completions sampled for one prompt instance; it is the unit of PUT. This module defines a
row's shape once; every role reads and writes rows through it. Malformed bodies raise
:class:`distrl.core.errors.WireError`.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from distrl.core.errors import WireError

# One row per completion (an environment's episode: one row, its turns and observations in completion_ids).
# Lists are per token of the completion unless named prompt_* or turn_*.
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
        pa.field("gen_seconds", pa.float64(), nullable=False),  # from the generate call's start to the group's end
        # The weights that generated it (distrl.weights.attest), one entry per version served during the
        # generate call (the first is policy_version); null: not stamped (--no_attest_weights, older runs).
        pa.field("served_versions", pa.list_(pa.int64())),
        pa.field("weights_digests", pa.list_(pa.string())),  # the verified digest of each loaded payload
        pa.field("canary_logprobs", pa.list_(pa.float64())),  # the engine's canary logprob, nats/token
        # Multi-turn episodes (distrl.rollout.envs); null: a single-turn completion, every token the model's.
        # turn_ends: per model turn, the end (exclusive) of its generated tokens in completion_ids; the tokens
        # between one turn's end and the next turn's start are the environment's observation.
        pa.field("turn_ends", pa.list_(pa.int32())),
        # loss_mask: per completion token, 1 where the model generated it (in the loss), 0 where the
        # environment wrote it (an observation: out of the loss, its behavior logprob 0).
        pa.field("loss_mask", pa.list_(pa.int8())),
    ]
)
STAMP_COLUMNS = ("served_versions", "weights_digests", "canary_logprobs")  # optional in table_from_rows
TURN_COLUMNS = ("turn_ends", "loss_mask")  # optional in table_from_rows
OPTIONAL_COLUMNS = STAMP_COLUMNS + TURN_COLUMNS
STAMPED_SCHEMA = pa.schema([f for f in COMPLETION_SCHEMA if f.name not in TURN_COLUMNS])  # before turns
LEGACY_SCHEMA = pa.schema([f for f in STAMPED_SCHEMA if f.name not in STAMP_COLUMNS])  # before stamps
OLD_SCHEMAS = (LEGACY_SCHEMA, STAMPED_SCHEMA)  # what older segment logs hold; read as COMPLETION_SCHEMA


def readable_schema(schema: pa.Schema) -> bool:
    """Whether a segment log of ``schema`` reads as COMPLETION_SCHEMA rows (this one or an older one)."""
    return schema.equals(COMPLETION_SCHEMA) or any(schema.equals(old) for old in OLD_SCHEMAS)


def upgrade(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A record batch of an older schema (:data:`LEGACY_SCHEMA`: before stamps; :data:`STAMPED_SCHEMA`:
    before turns) as COMPLETION_SCHEMA, the columns it lacks null; a batch of COMPLETION_SCHEMA is returned as
    it is. Every newer column is optional and appended at the end, so an old batch is a prefix of the schema."""
    if batch.schema.equals(COMPLETION_SCHEMA):
        return batch
    missing = COMPLETION_SCHEMA.names[batch.num_columns:]
    nulls = [pa.nulls(batch.num_rows, COMPLETION_SCHEMA.field(name).type) for name in missing]
    return pa.RecordBatch.from_arrays(list(batch.columns) + nulls, schema=COMPLETION_SCHEMA)


def table_from_rows(rows: list[dict[str, Any]]) -> pa.Table:
    """Build a completion table from dicts keyed by the schema's field names (KeyError if one is missing;
    the stamp and turn columns may be left out: null)."""
    columns = {f.name: [row[f.name] if f.name not in OPTIONAL_COLUMNS else row.get(f.name) for row in rows]
               for f in COMPLETION_SCHEMA}
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
