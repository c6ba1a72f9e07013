"""The buffer process: a ZeroMQ ROUTER that wraps :class:`buffer.store.GroupStore`.

Requests (see :class:`distrl.wire.MsgType`) arrive as ``[identity, header, body?]`` from DEALER
clients (:class:`buffer.client.BufferClient`); REQ peers, whose messages carry an empty delimiter
frame, are answered too. Every request gets exactly one reply:

    PUT {body: one group}                     -> ACK {seq_no, duplicate}   (after the segment log fsync)
    GET {learner_version, rank, world_size}   -> BATCH {body: the rank's shard} | WAIT {fresh_groups, batch_size}
    CREDIT {want}                             -> CREDIT {granted, learner_version, min_policy_version}
    STATS                                     -> STATS {counters of GroupStore.stats()}
    SHUTDOWN                                  -> ACK, then the loop ends
    anything malformed                        -> ERROR {error}; the server keeps serving

Metrics (TensorBoard, stepped by learner version) are written about once a second and at each
selection: buffer/rows, groups, ingest_groups_per_s, evicted_stale, credits_granted, duplicates,
learner_version, and the histogram buffer/staleness of every selection.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Callable

import pyarrow as pa
import zmq

from buffer.segments import ConsumptionLog, SegmentLog
from buffer.store import GroupStore
from distrl import wire
from distrl.metrics import Metrics
from distrl.wire import Header, MsgType, WireError

log = logging.getLogger(__name__)

DEFAULT_MAX_MSG_BYTES = 256 * 2**20
SENDER = "buffer"


def bindable(address: str) -> str:
    """``tcp://host:0`` -> ``tcp://host:*`` (zmq's spelling of "any free port")."""
    return re.sub(r":0$", ":*", address)


def int_field(header: Header, name: str) -> int:
    """An integer field of a request header. Raises ValueError naming the field if missing or not int."""
    value = header.fields.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{header.type.value} needs an integer field {name!r}, got {value!r}")
    return value


class BufferServer:
    """Replay buffer server bound to ``address`` (``.address`` holds the real endpoint).

    Args:
        address: zmq endpoint, e.g. ``tcp://127.0.0.1:5555``; port 0 or ``*`` picks a free port.
        run_dir: run directory; ``segments/`` and ``consumed.jsonl`` are written there.
        batch_size, max_staleness, topk, group_size, topk_by: see :class:`GroupStore`.
        tb_dir: TensorBoard directory (e.g. ``<run_dir>/tb/buffer0``); None writes no metrics.
        max_msg_bytes: largest accepted message (ZMQ_MAXMSGSIZE); a peer sending more is disconnected.
        poll_ms: loop poll timeout in milliseconds (how fast ``stop`` is noticed).
    Raises zmq.ZMQError if the address cannot be bound.
    """

    def __init__(self, address: str, run_dir: str | os.PathLike, batch_size: int, max_staleness: int,
                 topk: int, group_size: int, tb_dir: str | os.PathLike | None = None,
                 max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES, topk_by: str = "reward", poll_ms: int = 50) -> None:
        self.store = GroupStore(batch_size, max_staleness, topk, group_size, topk_by)
        self.poll_ms = poll_ms
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        try:
            self._sock.bind(bindable(address))
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise zmq.ZMQError(exc.errno, f"buffer cannot bind {address}: {exc} (pick another port, or 0)") from None
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.segments = SegmentLog(run_dir)
        self.consumed = ConsumptionLog(run_dir)
        self.metrics = Metrics(tb_dir)
        self._handlers: dict[MsgType, Callable[[Header, pa.Table | None], list[bytes]]] = {
            MsgType.PUT: self._on_put, MsgType.GET: self._on_get, MsgType.CREDIT: self._on_credit,
            MsgType.STATS: self._on_stats, MsgType.STOP: self._on_stop, MsgType.SHUTDOWN: self._on_shutdown,
        }
        self._running = False
        self._stopping = False  # set by STOP: training is over, actors are told to stop
        self._shutdown_requested = False
        self._last_tick, self._last_groups_put = time.monotonic(), 0
        self._closed = False

    # ---- loop --------------------------------------------------------------------------------

    def serve(self, stop: threading.Event | None = None) -> None:
        """Answer requests until a SHUTDOWN request or until ``stop`` is set. Does not close."""
        self._running = True
        log.info("buffer serving at %s", self.address)
        while self._running and not (stop is not None and stop.is_set()):
            if self._sock.poll(self.poll_ms):
                for _ in range(256):  # drain what is queued, then look at the clock again
                    try:
                        msg = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(msg)
                    if not self._running:
                        break
            if time.monotonic() - self._last_tick >= 1.0:
                self._log_metrics()
        self._log_metrics()
        self.metrics.flush()

    def _handle(self, msg: list[bytes]) -> None:
        """Answer one request; bad input gets an ERROR reply, never an exception."""
        envelope, frames = msg[:1], msg[1:]
        if len(frames) > 1 and frames[0] == b"":  # a REQ peer's delimiter
            envelope, frames = msg[:2], msg[2:]
        seq = 0
        try:
            header, body = wire.decode(frames)
            seq = header.seq
            handler = self._handlers.get(header.type)
            if handler is None:
                raise ValueError(f"the buffer does not answer {header.type.value} messages")
            reply = handler(header, body)
        except (WireError, ValueError, KeyError, TypeError) as exc:
            log.warning("bad request from %r: %s", envelope[0], exc)
            reply = wire.error(f"{type(exc).__name__}: {exc}", SENDER, seq)
        self._sock.send_multipart([*envelope, *reply])

    # ---- handlers ----------------------------------------------------------------------------

    def _on_put(self, header: Header, body: pa.Table | None) -> list[bytes]:
        if body is None:
            raise ValueError("PUT needs a body: one group as an Arrow IPC stream")
        seq_no, duplicate = self.store.put(body, persist=self.segments.append)
        return wire.encode(MsgType.ACK, SENDER, header.seq, seq_no=seq_no, duplicate=duplicate)

    def _on_get(self, header: Header, body: pa.Table | None) -> list[bytes]:
        version = int_field(header, "learner_version")
        rank, world_size = int_field(header, "rank"), int_field(header, "world_size")
        before = self.store.selections
        shard = self.store.select(version, rank, world_size)
        if shard is None:
            return wire.encode(MsgType.WAIT, SENDER, header.seq, fresh_groups=self.store.fresh_groups(version),
                               batch_size=self.store.batch_size, learner_version=self.store.learner_version)
        self.consumed.append(version, rank, shard)
        if self.store.selections != before:
            self._log_selection(version)
        return wire.encode(MsgType.BATCH, SENDER, header.seq, body=shard, learner_version=version,
                           rank=rank, world_size=world_size, rows=shard.num_rows)

    def _on_credit(self, header: Header, body: pa.Table | None) -> list[bytes]:
        want = int_field(header, "want")
        granted = 0 if self._stopping else self.store.grant_credits(want)
        return wire.encode(MsgType.CREDIT, SENDER, header.seq, granted=granted,
                           learner_version=self.store.learner_version,
                           min_policy_version=self.store.min_policy_version, stop=self._stopping)

    def _on_stop(self, header: Header, body: pa.Table | None) -> list[bytes]:
        self._stopping = True
        log.info("training is over (STOP from %s): credits now answer stop", header.sender)
        return wire.encode(MsgType.ACK, SENDER, header.seq)

    def _on_stats(self, header: Header, body: pa.Table | None) -> list[bytes]:
        return wire.encode(MsgType.STATS, SENDER, header.seq, **self.store.stats())

    def _on_shutdown(self, header: Header, body: pa.Table | None) -> list[bytes]:
        self._running = False
        self._shutdown_requested = True
        return wire.encode(MsgType.ACK, SENDER, header.seq)

    # ---- metrics -----------------------------------------------------------------------------

    def _log_metrics(self) -> None:
        now = time.monotonic()
        stats = self.store.stats()
        rate = (stats["groups_put"] - self._last_groups_put) / max(now - self._last_tick, 1e-6)
        self._last_tick, self._last_groups_put = now, stats["groups_put"]
        names = ("rows", "groups", "evicted_stale", "credits_granted", "duplicates", "learner_version")
        values = {f"buffer/{name}": stats[name] for name in names}
        values["buffer/ingest_groups_per_s"] = rate
        self.metrics.scalars(values, step=stats["learner_version"])

    def _log_selection(self, version: int) -> None:
        staleness = self.store.last_staleness
        self.metrics.histogram("buffer/staleness", staleness, step=version)
        self.metrics.scalar("buffer/staleness_mean", sum(staleness) / max(len(staleness), 1), step=version)
        self._log_metrics()

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the socket (linger 0; 500 ms after a SHUTDOWN so its ACK leaves), logs and metrics."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=500 if self._shutdown_requested else 0)
        self._ctx.term()
        self.segments.close()
        self.consumed.close()
        self.metrics.close()

    def __enter__(self) -> "BufferServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_buffer(address: str, run_dir: str | os.PathLike, batch_size: int, max_staleness: int, topk: int,
               group_size: int, tb_dir: str | os.PathLike | None = None,
               ready: Callable[[str], None] | None = None, **kwargs) -> None:
    """Build a :class:`BufferServer`, call ``ready(real_address)`` if given, serve until SHUTDOWN, close.

    ``kwargs`` go to BufferServer (max_msg_bytes, topk_by, poll_ms).
    """
    with BufferServer(address, run_dir, batch_size, max_staleness, topk, group_size, tb_dir, **kwargs) as server:
        if ready is not None:
            ready(server.address)
        server.serve()
