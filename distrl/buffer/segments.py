"""On-disk logs of the buffer: accepted groups (Arrow IPC stream segments) and what was handed out.

Layout under a run directory::

    segments/segment-00000.arrow   Arrow IPC *streams* of COMPLETION_SCHEMA, one record batch per group
    segments/segment-00001.arrow   (a new one at each buffer start and whenever one reaches its size limit)
    consumed.jsonl                 one JSON line per learner shard of each selection

The stream format is used because the file format's footer would be lost on a crash: a stream is
readable up to its last complete message. A record batch holds one or more whole groups (one PUT);
each segment's schema metadata holds ``distrl.group_size`` (rows per group) and ``distrl.first_seq``,
the sequence number of its first group, so group ``i`` of a segment has ``seq = first_seq + i`` even
after older segments were deleted by retention.

Durability (``fsync``): every append is written and flushed to the OS before it returns, so it
survives a killed process; ``always`` also fsyncs each append, ``batch`` fsyncs at :meth:`commit`
(the server's commit thread appends what the loop accepted, commits, then sends their ACKs),
``never`` leaves it to the OS (a power loss may lose acknowledged groups).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from distrl.buffer.groups import as_batch
from distrl.core.rows import COMPLETION_SCHEMA, readable_schema, upgrade

SEGMENT_DIR = "segments"
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC: continuation marker, length 0
CONSUMED_FILE = "consumed.jsonl"
FIRST_SEQ_KEY = b"distrl.first_seq"
GROUP_SIZE_KEY = b"distrl.group_size"
FSYNC_POLICIES = ("always", "batch", "never")
_sync = getattr(os, "fdatasync", os.fsync)  # data and size, not timestamps: cheaper where the OS has it
RELEASE_BYTES = 1 << 20  # under batch and never, the log's pages are released each time this much more was written
_FADVISE = hasattr(os, "posix_fadvise")  # Linux, the BSDs; not macOS
_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16  # buffers per os.writev (1024 on Linux)


def _segment_dir(directory: str | os.PathLike) -> Path:
    """``<directory>/segments`` for a run directory; ``directory`` itself if it holds segment files."""
    d = Path(directory)
    if not (d / SEGMENT_DIR).is_dir() and any(d.glob("segment-*.arrow")):
        return d
    return d / SEGMENT_DIR


def segment_paths(directory: str | os.PathLike) -> list[Path]:
    """Segment files of a run directory (or of a segments directory), oldest first."""
    return sorted(_segment_dir(directory).glob("segment-*.arrow"))


class _SyncedFile:
    """A binary append-only file with the fsync policy: write+flush always, fsync per policy."""

    def __init__(self, path: Path, fsync: str, mode: str = "xb") -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.path, self.fsync = path, fsync
        self.file = open(path, mode)
        self._dirty = False
        self._released = self.file.tell()  # the file's size at the last release

    def written(self) -> None:
        """Call after each logical append: flush to the OS; fsync now under ``always``; under the others,
        release the file's pages each further RELEASE_BYTES written (:meth:`_release`), so that a
        commit's fsync finds little left to write."""
        self.file.flush()
        if self.fsync == "always":
            self._sync()
            return
        self._dirty = True
        if self.file.tell() - self._released >= RELEASE_BYTES:
            self._release()

    def commit(self) -> None:
        """fsync what was written since the last commit (``batch``; a no-op for the other policies)."""
        if self._dirty and self.fsync == "batch":
            self._sync()
        self._dirty = False

    def _sync(self) -> None:
        _sync(self.file.fileno())
        self._release()

    def _release(self) -> None:
        """``posix_fadvise(DONTNEED)`` over the whole file: the OS starts writing its dirty pages to the
        disk, without waiting, and drops the clean ones from the page cache. The log is not read while
        serving, so its pages would only hold memory; new writes reuse them instead of memory new to the
        machine (docs/buffer.md, "Ingest")."""
        if _FADVISE:
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        self._released = self.file.tell()


class SegmentLog:
    """Appends accepted groups to ``<directory>/segments/segment-NNNNN.arrow``, rotating by size.

    Args:
        directory: the run directory.
        fsync: ``always``, ``batch`` or ``never`` (see the module docstring).
        max_bytes: a segment is closed and the next one opened once it reaches this size.
        first_seq: seq of the next group (non-zero when resuming).
        retention_bytes, retention_s: see :meth:`apply_retention` (None: keep everything).
        group_size: rows per group (each append may hold several groups); None: one group per append.
    A new process never rewrites an old segment: it opens the next free number. Not thread-safe: the
    server uses it from its commit thread alone while serving.
    """

    def __init__(self, directory: str | os.PathLike, fsync: str = "batch", max_bytes: int = 256 * 2**20,
                 first_seq: int = 0, retention_bytes: int | None = None, retention_s: float | None = None,
                 group_size: int | None = None) -> None:
        self.dir = Path(directory) / SEGMENT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.max_bytes, self.group_size = fsync, max_bytes, group_size
        self.retention_bytes, self.retention_s = retention_bytes, retention_s
        existing = segment_paths(directory)
        self._index = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self._first_seqs: dict[Path, int | None] = {}
        self.groups = self.deleted = 0
        self._open(first_seq)

    def _open(self, first_seq: int) -> None:
        self.path = self.dir / f"segment-{self._index:05d}.arrow"
        self._out = _SyncedFile(self.path, self.fsync)
        metadata = {FIRST_SEQ_KEY: str(first_seq).encode()}
        if self.group_size is not None:
            metadata[GROUP_SIZE_KEY] = str(self.group_size).encode()
        schema = COMPLETION_SCHEMA.with_metadata(metadata)
        self._size = self._out.file.write(schema.serialize())  # the stream's schema message
        self._out.written()
        self.first_seq = self.next_seq = first_seq

    def append(self, group: pa.Table | pa.RecordBatch, seq: int, message: bytes | memoryview | None = None) -> None:
        """Write whole groups (one, or several of ``group_size`` rows) with the first one's ``seq`` as one
        record batch (flushed; fsynced per policy); rotate if the file is full.

        ``message``: their IPC record batch message as received and validated
        (:func:`distrl.core.rows.decode_group`), written as it is; None serializes ``group``. Raises
        ValueError on another schema or an out-of-order seq, OSError on disk errors.
        """
        self.append_many([(group, seq, message)])

    def append_many(self, appends: list[tuple[pa.Table | pa.RecordBatch, int, bytes | memoryview | None]]) -> None:
        """:meth:`append` each ``(group, seq, message)`` in order, with one ``os.writev`` per segment file
        and one flush (under ``always``: one write and fsync per append, as :meth:`append`). The server's
        commit thread writes a commit's appends so: each system call releases the GIL, which it then waits
        for while the serving loop runs (up to the 5 ms switch interval), so one call per commit instead of
        one per PUT. The appends before a bad one are written before ValueError is raised."""
        pending: list[memoryview] = []
        for group, seq, message in appends:
            try:
                view = self._message(group, seq, message)
            except ValueError:
                self._write(pending)
                raise
            pending.append(view)
            self._size += len(view)
            groups = 1 if self.group_size is None else group.num_rows // self.group_size
            self.next_seq, self.groups = seq + groups, self.groups + groups
            if self.fsync == "always" or self._size >= self.max_bytes:
                self._write(pending)
                pending = []
            if self._size >= self.max_bytes:
                self._close_current()
                self._index += 1
                self._open(self.next_seq)
        self._write(pending)

    def _message(self, group: pa.Table | pa.RecordBatch, seq: int, message: bytes | memoryview | None) -> memoryview:
        """The bytes :meth:`append` writes for ``group`` (``message``, else ``group`` serialized). Raises
        ValueError on another schema or an out-of-order seq."""
        if seq != self.next_seq:
            raise ValueError(f"segment log expects seq {self.next_seq}, got {seq}")
        if message is None:
            batch = as_batch(group)
            if not batch.schema.equals(COMPLETION_SCHEMA):
                raise ValueError("segment log takes only groups of distrl.core.rows.COMPLETION_SCHEMA")
            message = batch.serialize()
        return memoryview(message).cast("B")

    def _write(self, views: list[memoryview]) -> None:
        """Write ``views`` at the end of the current file (``os.writev``, resumed after a partial write),
        then flush and fsync per policy (:meth:`_SyncedFile.written`). Raises OSError on disk errors."""
        if not views:
            return
        self._out.file.flush()  # nothing buffered may land after them
        fd, i = self._out.file.fileno(), 0
        while i < len(views):
            written = os.writev(fd, views[i:i + _IOV_MAX])
            while i < len(views) and written >= len(views[i]):
                written -= len(views[i])
                i += 1
            if written:
                views[i] = views[i][written:]
        self._out.written()

    def commit(self) -> None:
        """fsync the appends since the last commit (policy ``batch``)."""
        self._out.commit()

    def _close_current(self) -> None:
        self._out.file.write(END_OF_STREAM)
        self._out.written()
        self._out.commit()
        self._out.file.close()

    def apply_retention(self, oldest_held_seq: int, now: float | None = None) -> list[Path]:
        """Delete closed segments, oldest first, while their total size exceeds ``retention_bytes`` or
        they are older than ``retention_s`` (mtime) — but only segments whose every group has
        ``seq < oldest_held_seq`` (none is still in memory). Returns the deleted paths.
        """
        if self.retention_bytes is None and self.retention_s is None:
            return []
        closed = [p for p in segment_paths(self.dir.parent) if p != self.path]
        starts = [self._first_seq(p) for p in closed] + [self.first_seq]
        total = sum(p.stat().st_size for p in closed) + self.path.stat().st_size
        now, deleted = time.time() if now is None else now, []
        for path, end in zip(closed, starts[1:]):
            too_big = self.retention_bytes is not None and total > self.retention_bytes
            too_old = self.retention_s is not None and now - path.stat().st_mtime > self.retention_s
            if end is None or end > oldest_held_seq or not (too_big or too_old):
                break
            total -= path.stat().st_size
            path.unlink()
            deleted.append(path)
        self.deleted += len(deleted)
        return deleted

    def _first_seq(self, path: Path) -> int | None:
        if path not in self._first_seqs:
            self._first_seqs[path] = _first_seq(_read_stream(path, header_only=True)[0])
        return self._first_seqs[path]

    def close(self) -> None:
        """Write the end-of-stream marker, fsync and close the file (idempotent)."""
        if not self._out.file.closed:
            self._close_current()


def _read_stream(path: Path, header_only: bool = False) -> tuple[dict, list[pa.RecordBatch]]:
    """(schema metadata, record batches) of one segment, up to its first unreadable message (a crash)."""
    with open(path, "rb") as f:
        return _read_source(f, path, header_only)


def _read_source(f, path: Path, header_only: bool = False) -> tuple[dict, list[pa.RecordBatch]]:
    """:func:`_read_stream` of an open file ``f`` (a Python file, or a ``pa.memory_map``) of ``path``."""
    batches: list[pa.RecordBatch] = []
    try:
        reader = pa.ipc.open_stream(f)
    except (pa.ArrowInvalid, OSError, EOFError):
        return {}, batches  # crashed before the schema was complete
    if not readable_schema(reader.schema):
        raise ValueError(f"{path} does not hold distrl.core.rows.COMPLETION_SCHEMA rows")
    legacy = not reader.schema.equals(COMPLETION_SCHEMA)  # written before stamps or turns: read with those null
    metadata = dict(reader.schema.metadata or {})
    while not header_only:
        try:
            batches.append(upgrade(reader.read_next_batch()) if legacy else reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError, EOFError):
            break  # truncated last message: never acknowledged
    return metadata, batches


def _first_seq(metadata: dict) -> int | None:
    return int(metadata[FIRST_SEQ_KEY]) if FIRST_SEQ_KEY in metadata else None


def _split_groups(batch: pa.RecordBatch, group_size: int | None) -> list[pa.RecordBatch]:
    """The groups of one record batch: runs of ``group_size`` rows, or (older logs) runs of one group_id."""
    if group_size is not None:
        return [batch.slice(i, group_size) for i in range(0, batch.num_rows, group_size)]
    ids = batch.column("group_id").to_pylist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
    return [batch.slice(a, b - a) for a, b in zip(starts, starts[1:])]


def read_groups(directory: str | os.PathLike) -> Iterator[tuple[int, pa.Table]]:
    """``(seq, group)`` for every complete group of the log, in write order.

    Segments without ``distrl.first_seq`` (older logs) continue the count of the previous one.
    Raises ValueError if a segment has another schema.
    """
    seq = 0
    for path in segment_paths(directory):
        metadata, batches = _read_stream(path)
        seq = seq if _first_seq(metadata) is None else _first_seq(metadata)
        size = int(metadata[GROUP_SIZE_KEY]) if GROUP_SIZE_KEY in metadata else None
        for batch in batches:
            for group in _split_groups(batch, size):
                yield seq, pa.Table.from_batches([group], schema=COMPLETION_SCHEMA)
                seq += 1


def groups_by_actor(directory: str | os.PathLike) -> dict[int, int]:
    """Complete groups in the log per ``actor_id`` (a learner's ``--learner_generates`` groups under its
    negative id): what the buffer accepted from each over the whole run, across actor restarts and
    ``--resume`` (segments deleted by retention no longer count). The segments are memory-mapped and
    only their ``actor_id`` column is read. Raises ValueError if a segment has another schema.
    """
    counts: dict[int, int] = {}
    for path in segment_paths(directory):
        with pa.memory_map(str(path)) as source:
            metadata, batches = _read_source(source, path)
            size = int(metadata[GROUP_SIZE_KEY]) if GROUP_SIZE_KEY in metadata else None
            for batch in batches:
                if size is None:  # older logs: groups are runs of one group_id
                    heads = [g.column("actor_id")[0].as_py() for g in _split_groups(batch, None)]
                else:
                    heads = batch.column("actor_id").to_numpy()[::size].tolist()
                for actor in heads:
                    counts[actor] = counts.get(actor, 0) + 1
    return counts


def read_segments(directory: str | os.PathLike) -> pa.Table:
    """All rows of all segment files of a run directory (or segments directory), in write order.

    A truncated last message in a file (a crash mid-write) is skipped: it was never acknowledged.
    Raises ValueError if a segment has another schema.
    """
    batches = [b for p in segment_paths(directory) for b in _read_stream(p)[1]]
    return pa.Table.from_batches(batches, schema=COMPLETION_SCHEMA)


class ConsumptionLog:
    """Appends one JSON line per learner shard to ``<directory>/consumed.jsonl`` (fsync per policy).

    Each line: ``{"learner_version", "rank", "world_size", "group_ids", "sample_ids", "policy_versions",
    "time", "max_staleness"}`` (``max_staleness``: the bound in force when the selection was made, when the
    buffer gave it); ``policy_versions`` are those of the rows as handed out (re-stamped ones under replay
    ``restamp``), ``time`` is unix seconds. All shards of a selection are written when it is made.
    """

    def __init__(self, directory: str | os.PathLike, fsync: str = "batch") -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path, self.fsync = Path(directory) / CONSUMED_FILE, fsync
        self._out = _SyncedFile(self.path, fsync, mode="ab")

    def append(self, learner_version: int, rank: int, shard: pa.Table, world_size: int = 1,
               max_staleness: int | None = None) -> None:
        """Record the groups and samples of one shard (flushed; fsynced per policy)."""
        group_ids = list(dict.fromkeys(shard.column("group_id").to_pylist()))
        line = {"learner_version": learner_version, "rank": rank, "world_size": world_size,
                "group_ids": group_ids, "sample_ids": shard.column("sample_id").to_pylist(),
                "policy_versions": shard.column("policy_version").to_pylist(), "time": time.time()}
        if max_staleness is not None:
            line["max_staleness"] = max_staleness
        self._out.file.write((json.dumps(line) + "\n").encode())
        self._out.written()

    def commit(self) -> None:
        self._out.commit()

    def close(self) -> None:
        if not self._out.file.closed:
            self._out.commit()
            self._out.file.close()


def read_consumed(directory: str | os.PathLike) -> list[dict]:
    """The records of ``consumed.jsonl`` (empty if there is none). Raises ValueError on a bad inner line."""
    path = Path(directory) / CONSUMED_FILE
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return records  # a half-written last line (a crash) is skipped


def lineage(directory: str | os.PathLike) -> pa.Table:
    """One row per completion of a run's log, for analysis (pandas: ``lineage(run).to_pandas()``).

    Columns: every COMPLETION_SCHEMA column except the per-token lists, then ``seq`` (its group's
    position in the log), ``completion_tokens``, ``trained_versions`` (list<int64>: the learner
    versions whose batch held it, from consumed.jsonl) and ``staleness`` (list<int64>: each of those
    versions minus the policy version it was handed out with). Never-trained rows have empty lists.
    """
    seqs, tables = [], []
    for seq, group in read_groups(directory):
        seqs.append(pa.array([seq] * group.num_rows, pa.int64()))
        tables.append(group)
    table = pa.concat_tables(tables) if tables else COMPLETION_SCHEMA.empty_table()
    trained: dict[str, list[tuple[int, int]]] = {}
    for rec in read_consumed(directory):
        versions = rec.get("policy_versions") or [None] * len(rec["sample_ids"])
        for sid, pv in zip(rec["sample_ids"], versions):
            trained.setdefault(sid, []).append((rec["learner_version"], pv))
    ids = table.column("sample_id").to_pylist()
    recorded = table.column("policy_version").to_pylist()
    uses = [trained.get(sid, []) for sid in ids]
    out = table.drop_columns(["prompt_ids", "completion_ids", "behavior_logprobs", "turn_ends", "loss_mask"])
    out = out.append_column("seq", pa.chunked_array(seqs, pa.int64()))
    out = out.append_column("completion_tokens", pc.list_value_length(table.column("completion_ids")))
    out = out.append_column("trained_versions", pa.array([[v for v, _ in u] for u in uses], pa.list_(pa.int64())))
    staleness = [[v - (rec if pv is None else pv) for v, pv in u] for u, rec in zip(uses, recorded)]
    return out.append_column("staleness", pa.array(staleness, pa.list_(pa.int64())))
