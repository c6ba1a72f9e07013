"""On-disk logs of the buffer: accepted groups (Arrow IPC stream segments) and what was handed out.

Layout under a run directory::

    segments/segment-00000.arrow   one Arrow IPC *stream* per buffer process start (00001, ... after restarts)
    consumed.jsonl                 one JSON line per shard handed to a learner

The stream format is used because the file format's footer would be lost on a crash; each append is
flushed and fsync'ed before it returns, so a group the buffer acknowledged is on disk.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa

from distrl.wire import COMPLETION_SCHEMA

SEGMENT_DIR = "segments"
CONSUMED_FILE = "consumed.jsonl"


def segment_paths(directory: str | os.PathLike) -> list[Path]:
    """Segment files of a run directory, oldest first."""
    return sorted((Path(directory) / SEGMENT_DIR).glob("segment-*.arrow"))


class SegmentLog:
    """Appends accepted groups to ``<directory>/segments/segment-NNNNN.arrow``.

    A new process never rewrites an old segment: it opens the next free number (00000 on a fresh run).
    Not thread-safe: one writer, the buffer server's loop.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        seg_dir = Path(directory) / SEGMENT_DIR
        seg_dir.mkdir(parents=True, exist_ok=True)
        existing = segment_paths(directory)
        index = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self.path = seg_dir / f"segment-{index:05d}.arrow"
        self._file = open(self.path, "xb")
        self._writer = pa.ipc.new_stream(self._file, COMPLETION_SCHEMA)
        self._sync()
        self.groups = 0

    def append(self, table: pa.Table) -> None:
        """Write one group and fsync it. Raises ValueError on another schema, OSError on disk errors."""
        if not table.schema.equals(COMPLETION_SCHEMA):
            raise ValueError("segment log takes only tables of distrl.wire.COMPLETION_SCHEMA")
        self._writer.write_table(table)
        self._sync()
        self.groups += 1

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Write the end-of-stream marker and close the file (idempotent)."""
        if not self._file.closed:
            self._writer.close()
            self._sync()
            self._file.close()


def _read_stream(path: Path) -> list[pa.RecordBatch]:
    """Record batches of one stream file up to its first unreadable message (a crash mid-write)."""
    batches: list[pa.RecordBatch] = []
    with open(path, "rb") as f:
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowInvalid, OSError, EOFError):
            return batches  # crashed before the schema was complete
        if not reader.schema.equals(COMPLETION_SCHEMA):
            raise ValueError(f"{path} does not hold distrl.wire.COMPLETION_SCHEMA rows")
        while True:
            try:
                batches.append(reader.read_next_batch())
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError, EOFError):
                break  # truncated last message
    return batches


def read_segments(directory: str | os.PathLike) -> pa.Table:
    """All rows of all segment files of a run directory, in write order.

    A truncated last message in a file (a crash mid-write) is skipped: it was never acknowledged.
    Raises ValueError if a segment has another schema.
    """
    batches = [b for p in segment_paths(directory) for b in _read_stream(p)]
    return pa.Table.from_batches(batches, schema=COMPLETION_SCHEMA)


class ConsumptionLog:
    """Appends one JSON line per shard handed out to ``<directory>/consumed.jsonl``.

    Each line: ``{"learner_version", "rank", "group_ids", "sample_ids", "time"}`` (time in unix seconds).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / CONSUMED_FILE
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, learner_version: int, rank: int, shard: pa.Table) -> None:
        """Record the groups and samples of one shard (flushed, not fsync'ed)."""
        group_ids = list(dict.fromkeys(shard.column("group_id").to_pylist()))
        line = {"learner_version": learner_version, "rank": rank, "group_ids": group_ids,
                "sample_ids": shard.column("sample_id").to_pylist(), "time": time.time()}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
