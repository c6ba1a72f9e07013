"""Group commit: a PUT's ACK is sent only once its groups are in the segment log.

ACKs are as durable as ``--fsync`` makes them, so an ACK is never sent for a group the log could lose.
The server's loop validates a PUT and admits its groups to memory; one commit at a time runs in a thread
(the only user of the segment log while serving), writing every group accepted before it started (flushed
to the OS; fsynced after each PUT under ``always``) and then, under ``batch``, one fsync, while the loop
goes on handling requests; when it ends, its groups may be handed out (``GroupStore.logged_below``), its
ACKs are sent and the next commit starts. A write or fsync error ends the server (nothing unwritten is
acknowledged or handed out). Segment retention runs in the same thread.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import pyarrow as pa

from distrl.buffer.segments import SegmentLog
from distrl.buffer.store import GroupStore
from distrl.core.rows import COMPLETION_SCHEMA

log = logging.getLogger(__name__)


class GroupCommit:
    """The commit thread of ``segments`` and the ACKs waiting for it.

    Args:
        store: its ``logged_below`` is moved past each commit's groups (only groups in the log are handed out).
        segments: the segment log; None for an offline replay buffer (no PUT is accepted: nothing to write).
        send: sends reply frames (with their envelopes); a commit's ACKs go out through it when it ends.
    :attr:`wake_fd` becomes readable when a commit ends: the loop polls it beside its socket.
    """

    def __init__(self, store: GroupStore, segments: SegmentLog | None, send: Callable[[list[list]], None]) -> None:
        self.store, self.segments, self._send = store, segments, send
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer-commit")
        # The commit thread's first Arrow allocation, made now: at the first segment rotation (the schema message
        # of the next segment) it raised the RSS once, in Arrow's mimalloc arena, which a soak run reads as growth.
        self._pool.submit(COMPLETION_SCHEMA.serialize).result()
        self._running: tuple[Future, list, int] | None = None  # a commit in flight, its ACKs, the seq it ends at
        self._unwritten: list[tuple] = []  # (groups, first seq, IPC message) accepted since it started
        self._unacked: list[list] = []  # the ACKs waiting for the next commit
        self._retention: Future | None = None  # segment retention, run in the commit thread
        store.logged_below = store.groups_put  # only groups in the log are handed out
        self.wake_fd, self._wake_w = os.pipe()

    def persist(self, batch: pa.RecordBatch, message: memoryview) -> Callable[[pa.RecordBatch, int], None]:
        """The ``persist`` of a PUT of ``batch`` (received as the IPC stream ``message``) for
        ``GroupStore.put_messages``: its new groups are written by the next commit (the received bytes as
        they are when all of the batch is new)."""
        return lambda b, seq: self._unwritten.append((b, seq, message if b is batch else None))

    def acknowledge(self, reply: list) -> None:
        """Send the ACK ``reply`` (frames with the envelope) once the groups accepted so far are in the log."""
        self._unacked.append(reply)

    @property
    def finished(self) -> bool:
        """A commit was running and has ended: :meth:`advance` sends its ACKs."""
        return self._running is not None and self._running[0].done()

    def advance(self) -> None:
        """Send the ACKs covered by a finished commit; when none is running, start one (in the thread)
        covering every group accepted so far, so handling goes on while the disk works. Raises the
        commit's OSError (a write or fsync error ends the server)."""
        if self.finished:
            (future, replies, end), self._running = self._running, None
            future.result()  # a write or fsync error ends the server: nothing is acknowledged that is not in the log
            self.store.logged_below = end  # its groups may now be handed out
            self._send(replies)
        if self._running is None and self._unacked:
            appends, replies = self._unwritten, self._unacked
            self._unwritten, self._unacked = [], []
            future = self._pool.submit(self._commit, appends)
            self._running = (future, replies, self.store.groups_put)
            future.add_done_callback(lambda _: os.write(self._wake_w, b"."))  # wakes the poll

    def drain(self) -> None:
        """Wait for the commits of every ACK still held, and send them."""
        while self._running is not None or self._unacked:
            if self._running is not None:
                self._running[0].result()
            self.advance()

    def _commit(self, appends: list[tuple]) -> None:
        """In the commit thread: append the groups to the segment log (written and flushed; fsynced per
        PUT under ``always``), then fsync once under ``batch``. Raises OSError on disk errors."""
        if self.segments is None:  # replay: no PUT is accepted, so nothing to write
            return
        self.segments.append_many(appends)  # one write system call: each one waits for the GIL again
        self.segments.commit()

    def retain(self) -> None:
        """Start segment retention in the commit thread (up to the oldest group held), unless the last one
        still runs; re-raises the last one's disk error."""
        if self.segments is not None and (self._retention is None or self._retention.done()):
            if self._retention is not None:
                self._retention.result()  # re-raises a disk error of the last one
            self._retention = self._pool.submit(self._apply_retention, self.store.oldest_held_seq())

    def _apply_retention(self, oldest_held_seq: int) -> None:
        """In the commit thread (the segment log's only user while serving): :meth:`SegmentLog.apply_retention`."""
        for path in self.segments.apply_retention(oldest_held_seq):
            log.info("buffer: retention deleted %s", path.name)

    def close(self) -> None:
        """Wait for a commit or retention in flight, close the segment log and the wake pipe. Re-raises a
        disk error of the log (closing the pipe all the same), else of the last retention."""
        self._pool.shutdown()
        try:
            if self.segments is not None:
                self.segments.close()  # raises again after a disk error
        finally:
            os.close(self.wake_fd)
            os.close(self._wake_w)
        if self._retention is not None:
            self._retention.result()  # re-raises its disk error
