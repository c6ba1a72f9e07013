"""The buffer in this process: the real store and request handlers behind the client interface, no sockets.

:class:`InProcessBuffer` answers request frames as :class:`distrl.buffer.server.BufferServer` does -- the same
:mod:`distrl.core.wire` decoding and validation, :meth:`Handlers.check`, the same :class:`GroupStore` and
:class:`Handlers` replies, the same segment and consumption logs -- but synchronously, in the caller's thread:
a PUT's groups are written to the segment log before its ACK is made (no commit thread), and a request that
asks to be held (``wait_s``) is answered at once (nothing else runs meanwhile). :class:`InProcessClient` is a
:class:`distrl.core.buffer_client.BufferApi` whose transport is a call: every request is encoded to wire
frames, answered by the buffer, and the reply frames decoded, so a role sees exactly what the ZeroMQ client
gives it (tests run the actor and learner loops on it; tests/unit/test_buffer_contract.py holds both clients to
the same answers). Not thread-safe.
"""

from __future__ import annotations

import os
from pathlib import Path

from distrl.buffer.assemble import make_store
from distrl.buffer.client_ledger import CREDIT_TIMEOUT_S, ClientLedger
from distrl.buffer.config import SelectionOptions, StorageOptions, TopkOptions
from distrl.buffer.handlers import SENDER, Handlers
from distrl.buffer.segments import ConsumptionLog, SegmentLog
from distrl.buffer.store import GroupStore
from distrl.core import wire
from distrl.core.buffer_client import BufferApi
from distrl.core.metrics import Metrics
from distrl.core.rows import decode_group
from distrl.core.run_options import BatchOptions, StalenessOptions
from distrl.core.wire import Header, MsgType

ADDRESS = "in-process"  # what errors name as the buffer's address


class InProcessBuffer:
    """A buffer answering request frames in this process (see the module docstring).

    Args:
        store: the groups, selection and credits.
        segments: the segment log every accepted group is written to before its ACK.
        consumed: the consumption log; every selection is recorded there before its BATCH is made.
        metrics: the TensorBoard writer (default: none written).
        credit_timeout_s: seconds a sender holding unused credits may be silent before they return.
    Build one with :func:`open_buffer`; :meth:`close` closes the logs and the metrics.
    """

    def __init__(self, store: GroupStore, segments: SegmentLog, consumed: ConsumptionLog,
                 metrics: Metrics | None = None, credit_timeout_s: float = CREDIT_TIMEOUT_S) -> None:
        self.store, self.segments, self.consumed = store, segments, consumed
        self.closed = False
        self.metrics = metrics or Metrics(None)
        self.clients = ClientLedger(store, credit_timeout_s)
        self.handlers = Handlers(store, consumed, segments, self.metrics, self.clients)
        self._answers = {MsgType.GET: self.handlers.on_get, MsgType.CREDIT: self.handlers.on_credit,
                         MsgType.STATS: self.handlers.on_stats, MsgType.STOP: self.handlers.on_stop,
                         MsgType.JOIN: self.handlers.on_join, MsgType.LEAVE: self.handlers.on_leave,
                         MsgType.SHUTDOWN: lambda header: wire.encode(MsgType.ACK, SENDER, header.seq)}

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """The reply frames to one request's frames (``[header, body?]``, no envelope); never raises for bad
        input: it gets an ERROR reply, as from the server."""
        seq, envelope = 0, [b"in-process"]
        try:
            header, body = wire.decode_raw(frames)
            seq, envelope = header.seq, [header.sender.encode()]
            self.clients.seen(header.sender)
            self.handlers.check(header, body)
            if header.type is MsgType.PUT:
                return self._put(header, body)
            return self._answers[header.type](header)  # a GET's wait_s is not held: nothing runs meanwhile
        except Exception as exc:  # noqa: BLE001 - every request is answered, as by the server
            return self.handlers.error(exc, envelope, seq)

    def _put(self, header: Header, body: bytes) -> list[bytes]:
        """Admit a PUT's groups, write the new ones to the segment log, then make the ACK."""
        batch, message = decode_group(body)
        persist = lambda b, seq: self.segments.append(b, seq, message if b is batch else None)  # noqa: E731
        [result] = self.store.put_messages([(batch, persist, len(body))])
        if isinstance(result, Exception):
            raise result
        self.segments.commit()
        return self.handlers.acknowledge(header, len(body), result)

    def client(self, sender: str) -> InProcessClient:
        """A client of this buffer named ``sender`` (``actor0``, ``learner0``, ...)."""
        return InProcessClient(self, sender)

    def close(self) -> None:
        """Write the last metrics, commit and close the logs (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.handlers.tick()
        self.segments.close()
        self.consumed.close()
        self.metrics.close()

    def __enter__(self) -> InProcessBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcessClient(BufferApi):
    """:class:`distrl.core.buffer_client.BufferApi` over an :class:`InProcessBuffer`: each request encoded, handed
    to :meth:`InProcessBuffer.handle` and its reply decoded (a buffer in this process cannot lose a request: no
    re-sends, no timeouts)."""

    def __init__(self, buffer: InProcessBuffer, sender: str) -> None:
        self.buffer, self.address, self.sender = buffer, ADDRESS, sender
        self._seq = 0

    def _request(self, msg_type: MsgType, body=None, retries=None, resend_s=None, limit_s=None, **fields):
        self._seq += 1
        reply = self.buffer.handle(wire.encode(msg_type, self.sender, self._seq, body, **fields))
        return self._reply(msg_type, *self._decode_reply(reply))


def open_buffer(batch: BatchOptions, staleness: StalenessOptions, keep: TopkOptions, selection: SelectionOptions,
                storage: StorageOptions, run_dir: str | os.PathLike,
                tb_dir: str | os.PathLike | None = None) -> InProcessBuffer:
    """A fresh in-process buffer of the buffer's sections (as :func:`distrl.buffer.assemble.build_buffer` takes
    them: the foundation's batch shape and staleness, then its own top-k, selection and storage options) writing
    its segment and consumption logs under ``run_dir`` (and TensorBoard events to ``tb_dir``, if given)."""
    store = make_store(batch, staleness, keep, selection, storage)
    segments = SegmentLog(run_dir, storage.fsync, storage.segment_max_bytes, store.groups_put,
                          storage.retention_bytes, storage.retention_s, batch.group_size)
    consumed = ConsumptionLog(run_dir, storage.fsync)
    metrics = Metrics(None if tb_dir is None else Path(tb_dir))
    return InProcessBuffer(store, segments, consumed, metrics, selection.credit_timeout_s)
