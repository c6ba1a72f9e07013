"""The buffer's logs with a replica (:mod:`distrl.buffer.replica`): every byte written to its own files is sent to
the replica at the same offset, and nothing is acknowledged or handed out before the replica holds it.

- :class:`MirroredSegmentLog`: each write of the commit thread is sent to the replica *before* it is written
  locally (no wait: both copies are written at once); :meth:`MirroredSegmentLog.commit` (the end of a group
  commit, before its ACKs) fsyncs the local file, asks the replica to fsync under ``batch``, and waits for
  every answer. So an ACK means: in both logs, as durable as ``--fsync`` says.
- :class:`MirroredConsumptionLog`: each record is in the replica (written, fsynced under ``always``) before
  ``append`` returns, so before its BATCH is sent.
- :func:`catch_up`: at start, the replica gets what it lacks of the local log (a buffer whose node survived
  and resumes); :func:`fetch`: a buffer resuming on a node without its log (the node was lost) first copies
  the replica's files here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from distrl.buffer.replica import Mirror
from distrl.buffer.segments import (
    CONSUMED_FILE,
    END_OF_STREAM,
    SEGMENT_DIR,
    ConsumptionLog,
    SegmentLog,
    segment_paths,
)

log = logging.getLogger(__name__)
CHUNK_BYTES = 8 * 2**20  # catch-up and fetch move files in pieces of this size
ROLLED_BACK_FILE = "consumed.rolled_back.jsonl"


class MirroredSegmentLog(SegmentLog):
    """A :class:`distrl.buffer.segments.SegmentLog` whose every write also goes to ``mirror`` (same arguments
    after it). Used by the commit thread alone, like its parent."""

    def __init__(self, mirror: Mirror, directory: str | os.PathLike, *args, **kwargs) -> None:
        self.mirror, self._mirrored = mirror, 0  # set before the parent opens the first segment
        super().__init__(directory, *args, **kwargs)

    def _rel(self) -> str:
        return f"{SEGMENT_DIR}/{self.path.name}"

    def _open(self, first_seq: int) -> None:
        super()._open(first_seq)
        with open(self.path, "rb") as f:  # the schema message just written (the log's own file is write-only)
            head = f.read(self._size)
        self.mirror.write(self._rel(), 0, [head], sync=self.fsync == "always")
        self._mirrored = len(head)

    def _write(self, views: list[memoryview]) -> None:
        if views:  # sent first: the replica writes while this process writes its own copy
            self.mirror.write(self._rel(), self._mirrored, list(views), sync=self.fsync == "always")
            self._mirrored += sum(len(v) for v in views)
        super()._write(views)

    def _close_current(self) -> None:
        super()._close_current()
        self.mirror.write(self._rel(), self._mirrored, [END_OF_STREAM], sync=self.fsync != "never")
        self._mirrored += len(END_OF_STREAM)

    def commit(self) -> None:
        """fsync here (``batch``), then wait until the replica holds (and under ``batch`` fsynced) every write."""
        super().commit()
        if self.fsync == "batch":
            self.mirror.send("sync")
        self.mirror.wait()

    def apply_retention(self, oldest_held_seq: int, now: float | None = None) -> list[Path]:
        deleted = super().apply_retention(oldest_held_seq, now)
        for path in deleted:
            self.mirror.request("delete", path=f"{SEGMENT_DIR}/{path.name}")
        return deleted

    def close(self) -> None:
        try:
            super().close()
            self.mirror.wait()
        finally:
            self.mirror.close()


class MirroredConsumptionLog(ConsumptionLog):
    """A :class:`distrl.buffer.segments.ConsumptionLog` whose records are in ``mirror``'s replica before
    ``append`` returns. Used by the serving loop alone, like its parent."""

    def __init__(self, mirror: Mirror, directory: str | os.PathLike, fsync: str = "batch") -> None:
        super().__init__(directory, fsync)
        self.mirror = mirror
        self._mirrored = self._out.file.tell()  # append mode: the file's size
        self._reader = os.open(self.path, os.O_RDONLY)  # reads back each record (the log's file is write-only)

    def append(self, learner_version: int, rank: int, shard, world_size: int = 1,
               max_staleness: int | None = None) -> None:
        super().append(learner_version, rank, shard, world_size, max_staleness)
        end = self._out.file.tell()
        line = os.pread(self._reader, end - self._mirrored, self._mirrored)
        self.mirror.write(CONSUMED_FILE, self._mirrored, [line], sync=self.fsync == "always")
        self.mirror.wait()
        self._mirrored = end

    def commit(self) -> None:
        super().commit()
        if self.fsync == "batch":
            self.mirror.request("sync")

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._reader is not None:
                os.close(self._reader)
                self._reader = None
            self.mirror.close()


def _log_files(run_dir: Path) -> dict[str, Path]:
    """Relative path -> path of every file of the log under ``run_dir``."""
    files = {f"{SEGMENT_DIR}/{p.name}": p for p in segment_paths(run_dir)}
    for name in (CONSUMED_FILE, ROLLED_BACK_FILE):
        if (run_dir / name).is_file():
            files[name] = run_dir / name
    return files


def catch_up(mirror: Mirror, run_dir: str | os.PathLike, rewritten: bool = False) -> int:
    """Send the replica what it lacks of the log under ``run_dir``: each file's bytes past the replica's size
    (all of it when the replica's is longer, or for ``consumed.jsonl`` when ``rewritten``: a resume rolled
    selections back); files the replica holds and this log does not (retention) are deleted there. Returns
    the bytes sent. Raises OSError when the replica fails."""
    sizes, _ = mirror.request("sizes")
    have, sent = sizes["sizes"], 0
    for rel, path in _log_files(Path(run_dir)).items():
        size = path.stat().st_size
        start = have.get(rel, 0)
        if start > size or (rewritten and rel == CONSUMED_FILE):
            start = 0
        with open(path, "rb") as f:
            for offset in range(start, size, CHUNK_BYTES):
                mirror.write(rel, offset, [os.pread(f.fileno(), min(CHUNK_BYTES, size - offset), offset)])
                mirror.wait()
        if start == size and have.get(rel) != size:  # an empty file, or one cut shorter
            mirror.write(rel, size, [])
        sent += size - start
    for rel in set(have) - set(_log_files(Path(run_dir))):
        mirror.send("delete", path=rel)
    mirror.request("sync")
    return sent


def fetch(mirror: Mirror, run_dir: str | os.PathLike) -> int:
    """Copy every file of the replica's log into ``run_dir`` (a buffer resuming on a node that lost its own
    log), each written through a temporary file, fsynced and renamed. Returns the number of files. Raises
    OSError when the replica fails."""
    reply, _ = mirror.request("sizes")
    for rel, size in sorted(reply["sizes"].items()):
        target = Path(run_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.fetch")
        with open(temp, "wb") as f:
            for offset in range(0, size, CHUNK_BYTES):
                _, data = mirror.request("read", path=rel, offset=offset, length=min(CHUNK_BYTES, size - offset))
                f.write(data or b"")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    log.info("buffer: fetched the log's %d files from the replica at %s into %s", len(reply["sizes"]),
             mirror.address, run_dir)
    return len(reply["sizes"])
