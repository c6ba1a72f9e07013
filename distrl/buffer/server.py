"""The buffer process: a ZeroMQ ROUTER that wraps :class:`distrl.buffer.store.GroupStore`.

Requests (docs/protocol.md) arrive as ``[identity, header, body?]`` from DEALER clients
(:class:`distrl.core.buffer_client.BufferClient`); REQ peers, whose messages carry an empty delimiter frame, are
answered too. Every request gets exactly one reply, echoing its ``seq``:

    PUT {body: one or more whole groups}      -> ACK {seq_no, duplicate[, seq_nos, duplicates]}
    GET {learner_version, rank, world_size}   -> BATCH {body: the rank's shard} | WAIT {fresh_groups, reason}
    CREDIT {want[, actor_id]}                 -> GRANT {granted, learner_version, min_policy_version, stop, full
                                                        [, reason][, acked_groups]}
    STATS                                     -> STATS {counters}
    JOIN {first_id}                           -> ACK {actor_id}: an id no actor of the run has used
    LEAVE                                     -> ACK {returned}: the sender's unused credits return at once
    STOP                                      -> ACK; credit replies say stop from now on
    SHUTDOWN                                  -> ACK, then the loop ends
    anything else                             -> ERROR {error, code}; the server keeps serving

The header structs, their field types and ranges, and the error codes are :mod:`distrl.core.wire`'s.
:class:`distrl.buffer.handlers.Handlers` makes the replies; this loop receives and decodes the requests, admits
PUTs, holds the requests that may wait (``wait_s``) and sends. PUT ACKs are sent only once their groups are
in the segment log (:mod:`distrl.buffer.commit`); other replies are sent at once. Consumption records are written
and flushed before their BATCH is sent (a killed buffer keeps them); under ``fsync=batch`` they reach the
disk at the next tick (within a second), under ``always`` before the BATCH.

The server is given its parts (:func:`distrl.buffer.assemble.build_buffer` makes them) and closes them all.
Modes: a fresh buffer (the run directory must hold no segments), ``resume`` (memory rebuilt from the
run directory's logs, :mod:`distrl.buffer.recovery`) and ``replay_from`` (offline replay: the log of another
run is loaded, PUTs are refused, credits say stop, and a GET that cannot be served is an ERROR
``exhausted`` since nothing more will arrive).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, NamedTuple

import pyarrow as pa
import zmq

from distrl.buffer.client_ledger import CREDIT_TIMEOUT_S, ClientLedger
from distrl.buffer.commit import GroupCommit
from distrl.buffer.endpoint import Endpoint
from distrl.buffer.handlers import SENDER, Handlers
from distrl.buffer.segments import ConsumptionLog, SegmentLog
from distrl.buffer.store import GroupStore
from distrl.core import wire
from distrl.core.errors import NoProgress
from distrl.core.metrics import Metrics
from distrl.core.rows import decode_group
from distrl.core.wire import Header, MsgType

log = logging.getLogger(__name__)

MAX_BATCH = 64  # requests handled between two polls (their non-PUT replies are sent together)
GIL_SWITCH_S = 0.0005  # the GIL switch interval while serving (see BufferServer.serve)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)  # plain ints: flag enum arithmetic costs microseconds


class _Put(NamedTuple):
    """A decoded PUT waiting to be admitted: its envelope, header, groups, ``persist`` for
    ``GroupStore.put_messages`` and the received body's size."""

    envelope: list
    header: Header
    batch: pa.RecordBatch
    persist: Callable[[pa.RecordBatch, int], None]
    nbytes: int


class _Request(NamedTuple):
    """A decoded request other than PUT, waiting for the PUTs queued before it."""

    envelope: list
    header: Header


class BufferServer:
    """Replay buffer server: answers requests on ``endpoint`` around ``store`` (``.address``: the bound endpoint).

    Args:
        store: the groups, selection and credits (:class:`GroupStore`), already rebuilt on resume or replay.
        endpoint: the bound ROUTER socket (:class:`distrl.buffer.endpoint.Endpoint`).
        consumed: the consumption log; every selection is recorded there before its BATCH is sent.
        segments: the segment log PUT groups are committed to before their ACK; None for an offline
            replay buffer (PUTs refused, credits say stop, an unservable GET is ERROR ``exhausted``).
        metrics: the TensorBoard writer (``Metrics(None)`` writes nothing).
        poll_ms: loop poll timeout in milliseconds (how fast ``stop`` is noticed).
        credit_timeout_s: seconds a sender holding unused credits may be silent before they return.
    Its parts: ``clients`` (:class:`distrl.buffer.client_ledger.ClientLedger`), ``handlers``
    (:class:`distrl.buffer.handlers.Handlers`: the replies, ``stats()``) and the group commit
    (:class:`distrl.buffer.commit.GroupCommit`). :meth:`close` closes them all. :meth:`serve` raises NoProgress
    when the run cannot advance (see :mod:`distrl.buffer.handlers`). Build one with
    :func:`distrl.buffer.assemble.build_buffer`.
    """

    def __init__(self, store: GroupStore, endpoint: Endpoint, consumed: ConsumptionLog,
                 segments: SegmentLog | None, metrics: Metrics, poll_ms: int = 50,
                 credit_timeout_s: float = CREDIT_TIMEOUT_S) -> None:
        self.store, self.endpoint, self.consumed, self.segments, self.metrics = (store, endpoint, consumed, segments,
                                                                                 metrics)
        self.poll_ms = poll_ms
        self.lock = None  # a distrl.buffer.lock.RunDirLock that close() releases (build_buffer sets it)
        self.address: str = endpoint.address
        self._sock = endpoint.socket  # requests queue until serve() runs
        self.clients = ClientLedger(store, credit_timeout_s)
        self.handlers = Handlers(store, consumed, segments, metrics, self.clients)
        self._commit = GroupCommit(store, segments, self._send)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._commit.wake_fd, zmq.POLLIN)
        h = self.handlers
        self._handlers: dict[MsgType, Callable[..., list[bytes] | None]] = {
            MsgType.GET: h.on_get, MsgType.CREDIT: h.on_credit, MsgType.STATS: h.on_stats, MsgType.STOP: h.on_stop,
            MsgType.SHUTDOWN: self._on_shutdown, MsgType.JOIN: h.on_join, MsgType.LEAVE: h.on_leave,
        }
        self._running = self._closed = self._shutdown_requested = False
        self._parked: list[tuple[float, float, _Request]] = []  # CREDITs and GETs held (wait_s): (until, since, it)
        self._parked_logged: tuple | None = None  # (logged_below, selections) when held GETs were last tried

    # ---- loop --------------------------------------------------------------------------------

    def serve(self, stop: threading.Event | None = None) -> None:
        """Answer requests until a SHUTDOWN request or until ``stop`` is set. Does not close. While it
        serves, the process's GIL switch interval is at most GIL_SWITCH_S: the commit thread waits for
        the GIL after each system call (write, fsync) while this loop runs, up to the interval (5 ms by
        default) each time, and its commit's ACKs wait with it."""
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, GIL_SWITCH_S))
        try:
            self._serve(stop)
        finally:
            sys.setswitchinterval(switch)

    def _serve(self, stop: threading.Event | None) -> None:
        self._running = True
        log.info("buffer serving at %s", self.address)
        while self._running and not (stop is not None and stop.is_set()):
            ready = dict(self._poller.poll(self._poll_timeout_ms()))  # requests, or a commit that finished
            if self._commit.wake_fd in ready:
                os.read(self._commit.wake_fd, 4096)
            if self._sock in ready:
                self._handle_queued()
            self._commit.advance()
            if self._parked:
                self._release_parked()
            if time.monotonic() - self.handlers.last_tick >= 1.0:
                self._tick()
            if self.handlers.given_up():
                break
        self._commit.drain()  # acknowledge what was handled
        self._release_parked(everyone=True)
        self._tick()
        self.metrics.flush()
        stalled = self.handlers.no_progress
        if stalled is not None and not self._shutdown_requested and not (stop is not None and stop.is_set()):
            raise NoProgress(str(stalled[0]))


    def _handle_queued(self) -> None:
        """Handle what is queued (up to MAX_BATCH requests), in order: send the replies that acknowledge
        nothing written as they are made; keep PUT ACKs until their groups are in the log
        (:class:`GroupCommit`). Consecutive PUTs are decoded one by one and admitted together
        (:meth:`_admit_puts`), before the next other request is handled, or as soon as the commit in
        flight ends (its ACKs go out and the next commit starts then, not after the whole queue)."""
        now: list[list] = []
        puts: list[_Put] = []
        for _ in range(MAX_BATCH):
            if self._commit.finished:
                if puts:
                    self._admit_puts(puts, now)  # and, with them, the next commit
                    puts = []
                else:
                    self._commit.advance()
            try:
                msg = [self._sock.recv(_NOBLOCK, copy=False)]  # zero-copy: bodies stay zmq frames
            except zmq.Again:
                break
            while msg[-1].more:  # recv_multipart's work without its flag enums (half its cost per request)
                msg.append(self._sock.recv(0, copy=False))
            request = self._decode(msg)
            if isinstance(request, _Put):
                puts.append(request)
                continue
            if isinstance(request, _Request):
                if puts:  # the PUTs before it first; outside any try: a failed commit ends the server
                    self._admit_puts(puts, now)
                    puts = []
                request = self._answer_or_hold(request)
                if request is None:
                    continue
            self._send([request])
            if not self._running:
                break
        if puts:
            self._admit_puts(puts, now)
        self._send(now)

    def _admit_puts(self, puts: list[_Put], now: list[list]) -> None:
        """Admit decoded PUTs (``GroupStore.put_messages``): their ACKs wait for the next commit, their
        errors go to ``now``; then start a commit if none runs, so the commit thread never idles while
        the loop works through a queue."""
        results = self.store.put_messages([(p.batch, p.persist, p.nbytes) for p in puts])
        for put, result in zip(puts, results):
            if isinstance(result, Exception):
                now.append([*put.envelope, *self.handlers.error(result, put.envelope, put.header.seq)])
            else:
                self._commit.acknowledge([*put.envelope, *self.handlers.acknowledge(put.header, put.nbytes, result)])
        self._commit.advance()

    def _poll_timeout_ms(self) -> int:
        """``poll_ms``, or less when a held request's ``wait_s`` runs out sooner."""
        if not self._parked:
            return self.poll_ms
        until = min(until for until, _, _ in self._parked)
        return max(0, min(self.poll_ms, int((until - time.monotonic()) * 1000) + 1))

    def _answer_or_hold(self, request: _Request) -> list | None:
        """:meth:`_answer`, or None when the request may wait (``wait_s`` > 0) and would get nothing now, and
        is held: a CREDIT while nothing would be granted (the rule, memory full; one that would refund its
        sender's unused credits is answered at once), a GET while no batch can be made (:meth:`Handlers.on_get`)."""
        header, now = request.header, time.monotonic()
        if header.type is MsgType.GET and header.wait_s:
            reply = self._answer(request, now + header.wait_s)
        elif (header.type is MsgType.CREDIT and header.wait_s and not self.handlers.credits_open()
              and not self.clients.owed.get(header.sender) and self.handlers.stalled() is None):
            reply = None
        else:
            return self._answer(request)
        if reply is None:
            self._parked.append((now + header.wait_s, now, request))
        return reply

    def _release_parked(self, everyone: bool = False) -> None:
        """Answer the held requests, oldest first: CREDITs once credits are open (or training is over, or the
        run stalled), GETs once a commit made groups eligible and a batch can be made, and any whose
        ``wait_s`` ran out (a GET is tried again after a commit or a selection); ``everyone``: all of them now."""
        now, logged = time.monotonic(), (self.store.logged_below, self.store.selections)
        moved, credits = logged != self._parked_logged, self.handlers.credits_open()
        if not (everyone or moved or credits or now >= min(until for until, _, _ in self._parked)):
            return
        self._parked_logged = logged
        replies, kept = [], []
        for until, since, request in self._parked:
            reply = None
            if request.header.type is MsgType.GET:
                if everyone or moved or now >= until:
                    reply = self._answer(request, 0.0 if everyone else until, since)
            elif everyone or credits or now >= until:
                reply = self._answer(request)
                credits = self.handlers.credits_open()
            if reply is None:
                kept.append((until, since, request))
            else:
                replies.append(reply)
        self._parked = kept
        self._send(replies)

    def _send(self, replies: list[list]) -> None:
        send = self._sock.send
        for frames in replies:  # send_multipart's work without its flag enums (a third of its cost per reply)
            for frame in frames[:-1]:
                send(frame, _SNDMORE)
            send(frames[-1], 0)

    def _decode(self, msg: list[zmq.Frame]) -> _Put | _Request | list:
        """One request decoded: a PUT's groups (admitted by :meth:`_admit_puts`), another request (answered
        by :meth:`_answer`), or the ERROR reply frames (with the envelope) of a bad one; never an exception."""
        envelope, frames = msg[:1], msg[1:]
        if len(frames) > 1 and len(frames[0]) == 0:  # a REQ peer's delimiter
            envelope, frames = msg[:2], msg[2:]
        seq = 0
        try:
            header, body = wire.decode_raw([f.bytes if i == 0 else f.buffer for i, f in enumerate(frames)])
            seq = header.seq
            self.clients.seen(header.sender)
            self.handlers.check(header, body)
            if header.type is MsgType.PUT:
                return self._decode_put(envelope, header, body)
            return _Request(envelope, header)
        except Exception as exc:  # noqa: BLE001 - every request is answered; unknown failures are logged
            return [*envelope, *self.handlers.error(exc, envelope, seq)]

    def _decode_put(self, envelope: list, header: Header, body: memoryview) -> _Put:
        batch, message = decode_group(body)  # the received bytes go to the segment log as they are
        return _Put(envelope, header, batch, self._commit.persist(batch, message), len(body))

    def _answer(self, request: _Request, hold_until: float = 0.0, held_since: float = 0.0) -> list | None:
        """The reply frames (with the envelope) to a request other than PUT; bad fields get ERROR; None for a
        GET held: no batch can be made before ``hold_until`` (held since ``held_since``; :meth:`Handlers.on_get`)."""
        header = request.header
        try:
            handler = self._handlers[header.type]
            frames = handler(header, hold_until, held_since) if header.type is MsgType.GET else handler(header)
            return None if frames is None else [*request.envelope, *frames]
        except Exception as exc:  # noqa: BLE001 - every request is answered; unknown failures are logged
            return [*request.envelope, *self.handlers.error(exc, request.envelope, header.seq)]

    def _on_shutdown(self, header: Header) -> list[bytes]:
        self._running = False
        self._shutdown_requested = True
        return wire.encode(MsgType.ACK, SENDER, header.seq)

    def _tick(self) -> None:
        """About once a second: :meth:`Handlers.tick` (metrics, silent senders, the consumption log), then
        segment retention in the commit thread."""
        self.handlers.tick()
        self._commit.retain()

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the endpoint (linger 0; 500 ms after a SHUTDOWN so its ACK leaves), the group commit and the
        segment log, the consumption log and metrics (idempotent). Re-raises a disk error of the segment log
        (or of its retention) once the rest is closed."""
        if self._closed:
            return
        self._closed = True
        self.endpoint.close(linger_ms=500 if self._shutdown_requested else 0)
        try:
            self._commit.close()  # waits for a commit or retention in flight
        finally:
            try:
                self.consumed.close()
            finally:
                self.metrics.close()
                if self.lock is not None:  # the run directory's lock (distrl.buffer.lock): last, logs closed
                    self.lock.release()

    def __enter__(self) -> "BufferServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
