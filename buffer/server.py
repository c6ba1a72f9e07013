"""The buffer process: a ZeroMQ ROUTER that wraps :class:`buffer.store.GroupStore`.

Requests (docs/protocol.md) arrive as ``[identity, header, body?]`` from DEALER clients
(:class:`buffer.client.BufferClient`); REQ peers, whose messages carry an empty delimiter frame, are
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
A CREDIT that names its ``actor_id`` is also answered ``acked_groups``: the groups of that actor id the
buffer has accepted (rebuilt from the segment log on resume), where a restarted actor resumes its
prompt stream.

Progress guard: once ``--max_filtered_groups`` groups in a row were dropped by ``--filter_zero_variance``
(:meth:`GroupStore.check_progress`) no batch may ever form. The buffer logs it once, answers GETs with
ERROR ``no_progress`` (the client raises :class:`distrl.core.errors.NoProgress`) and credits with ``stop``,
for ``NO_PROGRESS_GRACE_S`` seconds so that learners and actors hear it; then, unless a SHUTDOWN came
meanwhile, :meth:`BufferServer.serve` raises NoProgress.

Group commit: PUT ACKs are sent only once their groups are in the segment log, as durable as
``--fsync`` makes them, so an ACK is never sent for a group the log could lose. The loop validates a
PUT and admits its groups to memory; one commit at a time runs in a thread (the only user of the
segment log while serving), writing every group accepted before it started (flushed to the OS;
fsynced after each PUT under ``always``) and then, under ``batch``, one fsync, while the loop goes
on handling requests; when it ends, its groups may be handed out (``GroupStore.logged_below``), its
ACKs are sent and the next commit starts. A write or fsync error ends the server (nothing unwritten
is acknowledged or handed out). Other replies are sent at once.
Consumption records are written and flushed before their BATCH is sent (a killed buffer keeps
them); under ``fsync=batch`` they reach the disk at the next tick (within a second), under
``always`` before the BATCH.

The server is given its parts (:func:`buffer.assemble.build_buffer` makes them) and closes them all.
Modes: a fresh buffer (the run directory must hold no segments), ``resume`` (memory rebuilt from the
run directory's logs, :mod:`buffer.recovery`) and ``replay_from`` (offline replay: the log of another
run is loaded, PUTs are refused, credits say stop, and a GET that cannot be served is an ERROR
``exhausted`` since nothing more will arrive).

Actors come and go (``distrl rollout --join``; docs/multinode.md): the credits granted to a sender and not
yet PUT are its ``_owed``; they return to the pool (``GroupStore.refund_credits``) when it asks again, when it
says LEAVE, or when it has been silent for ``credit_timeout_s`` (killed, node lost; logged). Over the
changing set the store counts groups accepted beyond AReaL's rule (``credit_violations``).

Metrics (TensorBoard, stepped by learner version), about once a second: buffer/rows, bytes, groups,
ingest_rows_per_s, ingest_mb_per_s, ingest_groups_per_s, duplicates, evicted_<reason>, credits_granted,
credits_refunded, credit_violations, credits_owed, refused_full, bad_requests, learner_version,
get_latency_ms (histogram, p50, p99);
and at each selection the histogram buffer/staleness and buffer/staleness_mean.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, ClassVar, NamedTuple

import numpy as np
import pyarrow as pa
import zmq

from buffer.endpoint import Endpoint
from buffer.segments import ConsumptionLog, SegmentLog
from buffer.store import GroupStore
from distrl.core import wire
from distrl.core.errors import NoProgress
from distrl.core.metrics import Metrics
from distrl.core.wire import ErrorCode, Header, MsgType

log = logging.getLogger(__name__)

MAX_BATCH = 64  # requests handled between two polls (their non-PUT replies are sent together)
SENDER = "buffer"
MAX_CLIENTS_TRACKED = 4096  # senders remembered for liveness (a bound against made-up names)
CREDIT_TIMEOUT_S = 60.0  # an actor silent this long with unused credits is lost: they return (--credit_timeout_s)
NO_PROGRESS_GRACE_S = 10.0  # a buffer that cannot progress keeps telling clients so this long, then raises
GIL_SWITCH_S = 0.0005  # the GIL switch interval while serving (see BufferServer.serve)
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)  # plain ints: flag enum arithmetic costs microseconds
WAIT_LOG_S = 30.0  # a kind of "GET waits" line is logged at most this often, with a count


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


class Unsupported(ValueError):
    """A well-formed request of a type this server does not answer (ERROR code ``unsupported``)."""

    code: ClassVar[ErrorCode] = ErrorCode.UNSUPPORTED


class Exhausted(RuntimeError):
    """Replay: no batch can be made and none ever will (ERROR code ``exhausted``)."""

    code: ClassVar[ErrorCode] = ErrorCode.EXHAUSTED


class BufferServer:
    """Replay buffer server: answers requests on ``endpoint`` around ``store`` (``.address``: the bound endpoint).

    Args:
        store: the groups, selection and credits (:class:`GroupStore`), already rebuilt on resume or replay.
        endpoint: the bound ROUTER socket (:class:`buffer.endpoint.Endpoint`).
        consumed: the consumption log; every selection is recorded there before its BATCH is sent.
        segments: the segment log PUT groups are committed to before their ACK; None for an offline
            replay buffer (PUTs refused, credits say stop, an unservable GET is ERROR ``exhausted``).
        metrics: the TensorBoard writer (``Metrics(None)`` writes nothing).
        poll_ms: loop poll timeout in milliseconds (how fast ``stop`` is noticed).
        credit_timeout_s: seconds a sender holding unused credits may be silent before they return.
    :meth:`close` closes all of them. :meth:`serve` raises NoProgress when the run cannot advance (see
    the module docstring). Build one with :func:`buffer.assemble.build_buffer`.
    """

    def __init__(self, store: GroupStore, endpoint: Endpoint, consumed: ConsumptionLog,
                 segments: SegmentLog | None, metrics: Metrics, poll_ms: int = 50,
                 credit_timeout_s: float = CREDIT_TIMEOUT_S) -> None:
        self.store, self.endpoint, self.consumed, self.segments, self.metrics = (store, endpoint, consumed, segments,
                                                                                 metrics)
        self.replay, self.poll_ms = segments is None, poll_ms
        self.address: str = endpoint.address
        self._sock = endpoint.socket  # requests queue until serve() runs
        self._commit_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer-commit")
        # The commit thread's first Arrow allocation, made now: at the first segment rotation (the schema message
        # of the next segment) it raised the RSS by ~2 MB once, in Arrow's mimalloc arena (BENCHMARKS.md, Soak).
        self._commit_pool.submit(wire.COMPLETION_SCHEMA.serialize).result()
        self._committing: tuple[Future, list, int] | None = None  # a commit in flight, its ACKs, the seq it ends at
        self._unwritten: list[tuple] = []  # (groups, first seq, IPC message) accepted since it started
        self._unacked: list[list] = []  # the ACKs waiting for the next commit
        self._retention: Future | None = None  # segment retention, run in the commit thread
        self.store.logged_below = self.store.groups_put  # only groups in the log are handed out
        self._wake_r, self._wake_w = os.pipe()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._handlers: dict[MsgType, Callable[[Header], list[bytes]]] = {
            MsgType.GET: self._on_get, MsgType.CREDIT: self._on_credit,
            MsgType.STATS: self._on_stats, MsgType.STOP: self._on_stop, MsgType.SHUTDOWN: self._on_shutdown,
            MsgType.JOIN: self._on_join, MsgType.LEAVE: self._on_leave,
        }
        self._running = self._closed = self._shutdown_requested = False
        self._stopping = self.replay  # STOP received (or replay): credit replies say stop
        self.bad_requests = 0
        self.last_seen: dict[str, float] = {}  # sender -> time.monotonic() of its last request
        self._owed: dict[str, int] = {}  # sender -> credits granted to it and not yet PUT
        self._parked: list[tuple[float, float, _Request]] = []  # CREDITs and GETs held (wait_s): (until, since, it)
        self._parked_logged: tuple | None = None  # (logged_below, selections) when held GETs were last tried
        self._hold_until = self._held_since = 0.0  # of the GET being answered (_try): hold it if no batch before
        self.credit_timeout_s = credit_timeout_s
        self._joined: dict[str, int] = {}  # sender name -> actor id handed out by JOIN
        self._lost: set[str] = set()  # senders whose credits returned after silence (a PUT from one is logged)
        self.departures = {"left": 0, "lost": 0, "credits_returned_on_leave": 0, "credits_returned_on_timeout": 0}
        self._last_tick, self._ingest = time.monotonic(), [0, 0, 0]  # rows, bytes, groups since the tick
        self._get_ms: list[float] = []
        self._waits: dict[str, tuple[float, int]] = {}  # kind of WAIT reason -> (last logged, GETs since)
        self._no_progress: tuple[NoProgress, float] | None = None  # the error and when it was first seen

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
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            if self._sock in ready:
                self._handle_queued()
            self._advance_commit()
            if self._parked:
                self._release_parked()
            if time.monotonic() - self._last_tick >= 1.0:
                self._tick()
            if self._stalled() is not None and time.monotonic() - self._no_progress[1] >= NO_PROGRESS_GRACE_S:
                break
        while self._committing is not None or self._unacked:  # acknowledge what was handled
            if self._committing is not None:
                self._committing[0].result()
            self._advance_commit()
        self._release_parked(everyone=True)
        self._tick()
        self.metrics.flush()
        if self._no_progress is not None and not self._shutdown_requested and not (stop is not None and stop.is_set()):
            raise NoProgress(str(self._no_progress[0]))

    def _stalled(self) -> NoProgress | None:
        """The store's NoProgress error once it cannot advance (logged once, when first seen), else None."""
        if self._no_progress is None:
            try:
                self.store.check_progress()
            except NoProgress as exc:
                self._no_progress = (exc, time.monotonic())
                log.error("buffer: %s. GETs are refused and credits say stop; the buffer stops in %.0f s",
                          exc, NO_PROGRESS_GRACE_S)
        return None if self._no_progress is None else self._no_progress[0]

    def _handle_queued(self) -> None:
        """Handle what is queued (up to MAX_BATCH requests), in order: send the replies that acknowledge
        nothing written as they are made; keep PUT ACKs until their groups are in the log
        (:meth:`_advance_commit`). Consecutive PUTs are decoded one by one and admitted together
        (:meth:`_admit_puts`), before the next other request is handled, or as soon as the commit in
        flight ends (its ACKs go out and the next commit starts then, not after the whole queue)."""
        now: list[list] = []
        puts: list[_Put] = []
        for _ in range(MAX_BATCH):
            if self._committing is not None and self._committing[0].done():
                if puts:
                    self._admit_puts(puts, now)  # and, with them, the next commit
                    puts = []
                else:
                    self._advance_commit()
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
                now.append([*put.envelope, *self._error(result, put.envelope, put.header.seq)])
            else:
                self._unacked.append([*put.envelope, *self._acknowledge(put, result)])
        self._advance_commit()

    def _advance_commit(self) -> None:
        """Group commit: send the ACKs covered by a finished commit; when none is running, start one (in
        a thread) covering every group accepted so far, so handling goes on while the disk works."""
        if self._committing is not None and self._committing[0].done():
            (future, replies, end), self._committing = self._committing, None
            future.result()  # a write or fsync error ends the server: nothing is acknowledged that is not in the log
            self.store.logged_below = end  # its groups may now be handed out
            self._send(replies)
        if self._committing is None and self._unacked:
            appends, replies = self._unwritten, self._unacked
            self._unwritten, self._unacked = [], []
            future = self._commit_pool.submit(self._commit, appends)
            self._committing = (future, replies, self.store.groups_put)
            future.add_done_callback(lambda _: os.write(self._wake_w, b"."))  # wakes the poll

    def _commit(self, appends: list[tuple]) -> None:
        """In the commit thread: append the groups to the segment log (written and flushed; fsynced per
        PUT under ``always``), then fsync once under ``batch``. Raises OSError on disk errors."""
        if self.segments is None:  # replay: no PUT is accepted, so nothing to write
            return
        self.segments.append_many(appends)  # one write system call: each one waits for the GIL again
        self.segments.commit()

    def _poll_timeout_ms(self) -> int:
        """``poll_ms``, or less when a held request's ``wait_s`` runs out sooner."""
        if not self._parked:
            return self.poll_ms
        until = min(until for until, _, _ in self._parked)
        return max(0, min(self.poll_ms, int((until - time.monotonic()) * 1000) + 1))

    def _answer_or_hold(self, request: _Request) -> list | None:
        """:meth:`_answer`, or None when the request may wait (``wait_s`` > 0) and would get nothing now, and
        is held: a CREDIT while nothing would be granted (the rule, memory full; one that would refund its
        sender's unused credits is answered at once), a GET while no batch can be made (:meth:`_on_get`)."""
        header, now = request.header, time.monotonic()
        if header.type is MsgType.GET and header.wait_s:
            reply = self._try(request, now + header.wait_s, 0.0)
        elif (header.type is MsgType.CREDIT and header.wait_s and not self._credits_open()
              and not self._owed.get(header.sender) and self._stalled() is None):
            reply = None
        else:
            return self._answer(request)
        if reply is None:
            self._parked.append((now + header.wait_s, now, request))
        return reply

    def _try(self, request: _Request, until: float, since: float) -> list | None:
        """:meth:`_answer`, or None for a GET with no batch yet before ``until`` (held since ``since``)."""
        self._hold_until, self._held_since = until, since
        try:
            return self._answer(request)
        finally:
            self._hold_until = self._held_since = 0.0

    def _release_parked(self, everyone: bool = False) -> None:
        """Answer the held requests, oldest first: CREDITs once credits are open (or training is over, or the
        run stalled), GETs once a commit made groups eligible and a batch can be made, and any whose
        ``wait_s`` ran out (a GET is tried again after a commit or a selection); ``everyone``: all of them now."""
        now, logged = time.monotonic(), (self.store.logged_below, self.store.selections)
        moved, credits = logged != self._parked_logged, self._credits_open()
        if not (everyone or moved or credits or now >= min(until for until, _, _ in self._parked)):
            return
        self._parked_logged = logged
        replies, kept = [], []
        for until, since, request in self._parked:
            reply = None
            if request.header.type is MsgType.GET:
                if everyone or moved or now >= until:
                    reply = self._try(request, 0.0 if everyone else until, since)
            elif everyone or credits or now >= until:
                reply = self._answer(request)
                credits = self._credits_open()
            if reply is None:
                kept.append((until, since, request))
            else:
                replies.append(reply)
        self._parked = kept
        self._send(replies)

    def _credits_open(self) -> bool:
        """A held CREDIT would get an answer other than 0 granted now (credits, stop, or the run stalled)."""
        return self._stopping or self._no_progress is not None or self.store.open_credits() > 0

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
            self._seen_client(header.sender)
            if header.type is MsgType.PUT:
                return self._decode_put(envelope, header, body)
            if header.type not in self._handlers:
                raise Unsupported(f"the buffer does not answer {header.type.value} messages")
            if body is not None:
                raise ValueError(f"{header.type.value} takes no body")
            return _Request(envelope, header)
        except Exception as exc:  # noqa: BLE001 - every request is answered; unknown failures are logged
            return [*envelope, *self._error(exc, envelope, seq)]

    def _answer(self, request: _Request) -> list | None:
        """The reply frames (with the envelope) to a request other than PUT; bad fields get ERROR; None for
        a GET held (:meth:`_try`)."""
        try:
            frames = self._handlers[request.header.type](request.header)
            return None if frames is None else [*request.envelope, *frames]
        except Exception as exc:  # noqa: BLE001 - every request is answered; unknown failures are logged
            return [*request.envelope, *self._error(exc, request.envelope, request.header.seq)]

    def _error(self, exc: Exception, envelope: list[bytes], seq: int) -> list[bytes]:
        """The ERROR reply to ``exc`` (its :func:`wire.error_code`); a wire version mismatch names both versions."""
        self.bad_requests += 1
        code = wire.error_code(exc)
        if code is ErrorCode.INTERNAL:
            log.exception("buffer: internal error on a request from %r", envelope[0])
        elif code is not ErrorCode.FULL:
            log.debug("bad request from %r: %s", envelope[0], exc)
        if isinstance(exc, wire.VersionError):
            return wire.error(f"client speaks wire version {exc.theirs!r}, this buffer speaks {exc.ours}", SENDER,
                              seq, code)
        return wire.error(f"{type(exc).__name__}: {exc}", SENDER, seq, code)

    # ---- handlers ----------------------------------------------------------------------------

    def _decode_put(self, envelope: list, header: Header, body: memoryview | None) -> _Put:
        if self.segments is None:
            raise Unsupported("this is an offline replay buffer: it takes no PUTs")
        if body is None:
            raise ValueError("PUT needs a body: one group as an Arrow IPC stream")
        batch, message = wire.decode_group(body)  # the received bytes go to the segment log as they are
        # the new groups are written by the commit thread (:meth:`_commit`)
        persist = lambda b, seq: self._unwritten.append((b, seq, message if b is batch else None))  # noqa: E731
        return _Put(envelope, header, batch, persist, len(body))

    def _acknowledge(self, put: _Put, results: list[tuple[int, bool]]) -> list[bytes]:
        """The ACK of an admitted PUT (``results``: ``(seq, duplicate)`` per group); counts its ingest."""
        new = sum(not dup for _, dup in results)
        sender = put.header.sender
        if sender in self._owed:  # these groups used the sender's credits
            self._owed[sender] = max(0, self._owed[sender] - len(results))
        self._ingest[0] += new * self.store.group_size
        self._ingest[1] += put.nbytes * new // len(results)
        self._ingest[2] += new
        fields = {"seq_no": results[0][0], "duplicate": new == 0}
        if len(results) > 1:
            fields.update(seq_nos=[seq for seq, _ in results], duplicates=len(results) - new)
        return wire.encode(MsgType.ACK, SENDER, put.header.seq, **fields)

    def _on_get(self, header: wire.Get) -> list[bytes] | None:
        t0 = time.perf_counter()
        version, rank, world_size = header.learner_version, header.rank, header.world_size
        stalled = self._stalled()
        if stalled is not None:
            raise NoProgress(str(stalled))  # a new one each time: a re-raised exception keeps its traceback
        before = self.store.selections
        shard = self.store.select(version, rank, world_size)
        if shard is None:
            if self.replay:
                raise Exhausted(f"the replayed log cannot feed version {version}: {self.store.fresh_groups(version)} "
                                f"of {self.store.batch_size} groups left are eligible (the others were used "
                                f"replay_ratio={self.store.replay_ratio} times or are too stale)")
            if time.monotonic() < self._hold_until:
                return None  # held (wait_s): tried again after each commit, answered WAIT when it runs out
            reason = self.store.wait_reason(version)
            self._log_wait(reason)
            return wire.encode(MsgType.WAIT, SENDER, header.seq, fresh_groups=self.store.fresh_groups(version),
                               batch_size=self.store.batch_size, learner_version=self.store.learner_version,
                               reason=reason)
        if self.store.selections != before:  # a new selection: record every shard before any is sent
            for r, s in enumerate(self.store.selection(version)):
                self.consumed.append(version, r, s, world_size)
            self._log_selection(version)
        held = {"held_ms": round((time.monotonic() - self._held_since) * 1e3, 3)} if self._held_since else {}
        reply = wire.encode(MsgType.BATCH, SENDER, header.seq, body=shard, learner_version=version,
                            rank=rank, world_size=world_size, rows=shard.num_rows, **held)
        self._get_ms.append((time.perf_counter() - t0) * 1e3)
        return reply

    def _on_credit(self, header: wire.Credit) -> list[bytes]:
        want = header.want
        unused = self._owed.pop(header.sender, 0)
        if unused:  # a client asks again only after PUTting its grant: it restarted, or our reply was lost
            self.store.refund_credits(unused)
            log.info("buffer: %s asks for credits again with %d unused: returned", header.sender, unused)
        stalled = self._stalled()
        granted = 0 if self._stopping or stalled is not None else self.store.grant_credits(want)
        if granted and len(self._owed) < MAX_CLIENTS_TRACKED:
            self._owed[header.sender] = granted
        fields = dict(granted=granted, learner_version=self.store.learner_version,
                      min_policy_version=self.store.min_policy_version, stop=self._stopping or stalled is not None,
                      full=self.store.full)
        if stalled is not None:
            fields["reason"] = str(stalled)
        elif self.store.full:
            fields["reason"] = "buffer full: no credits until the learners consume"
        if header.actor_id is not wire.UNSET:
            fields["acked_groups"] = self.store.acked_groups(header.actor_id)
        return wire.encode(MsgType.GRANT, SENDER, header.seq, **fields)

    def _on_join(self, header: wire.Join) -> list[bytes]:
        """A fresh actor id: above ``first_id``, every id whose groups the buffer holds in its log, every sender
        ``actor<N>`` seen and every id handed out before."""
        seen = [int(m.group(1)) for name in self.last_seen if (m := re.fullmatch(r"actor(\d+)", name))]
        actor_id = max([header.first_id - 1, *seen, *self.store.actor_ids(), *self._joined.values()]) + 1
        self._joined[f"actor{actor_id}"] = actor_id
        log.info("buffer: an actor joins (%s asked): actor id %d, at learner version %d", header.sender or "?",
                 actor_id, self.store.learner_version)
        return wire.encode(MsgType.ACK, SENDER, header.seq, actor_id=actor_id)

    def _on_leave(self, header: Header) -> list[bytes]:
        """The sender stops: its unused credits return now (counted, logged)."""
        returned = self.store.refund_credits(self._owed.pop(header.sender, 0))
        self.departures["left"] += 1
        self.departures["credits_returned_on_leave"] += returned
        self._joined.pop(header.sender, None)
        log.info("buffer: %s leaves at learner version %d: %d unused credits returned", header.sender,
                 self.store.learner_version, returned)
        return wire.encode(MsgType.ACK, SENDER, header.seq, returned=returned)

    def _expire_silent(self) -> None:
        """Liveness: the unused credits of a sender silent for ``credit_timeout_s`` return (it is lost)."""
        now = time.monotonic()
        for sender in [s for s in self._owed if now - self.last_seen.get(s, now) > self.credit_timeout_s]:
            if not self._owed[sender]:  # it PUT all it was granted: nothing to return, no one to call lost
                del self._owed[sender]
                continue
            returned = self.store.refund_credits(self._owed.pop(sender))
            self._lost.add(sender)
            self.departures["lost"] += 1
            self.departures["credits_returned_on_timeout"] += returned
            log.warning("buffer: %s sent nothing for %.0f s (--credit_timeout_s) with unused credits: counted lost, "
                        "%d credits returned", sender, now - self.last_seen[sender], returned)

    def _on_stop(self, header: Header) -> list[bytes]:
        self._stopping = True
        log.info("training is over (STOP from %s): credits now answer stop", header.sender)
        return wire.encode(MsgType.ACK, SENDER, header.seq)

    def _on_stats(self, header: Header) -> list[bytes]:
        return wire.encode(MsgType.STATS, SENDER, header.seq, counters=self.stats())

    def _on_shutdown(self, header: Header) -> list[bytes]:
        self._running = False
        self._shutdown_requested = True
        return wire.encode(MsgType.ACK, SENDER, header.seq)

    def _seen_client(self, sender: str) -> None:
        """Liveness: remember when each client (by header sender) last sent a request."""
        if sender in self.last_seen or len(self.last_seen) < MAX_CLIENTS_TRACKED:
            self.last_seen[sender] = time.monotonic()
        if self._lost and sender in self._lost:
            self._lost.discard(sender)
            log.warning("buffer: %s speaks again after its credits were returned for silence: what it PUTs "
                        "now may exceed AReaL's rule (credit_violations); raise --credit_timeout_s", sender)

    def stats(self) -> dict:
        """The store's counters plus the server's (bad_requests, segments_deleted, replay, and
        ``last_seen_s``: seconds since each client's last request, by sender name; the driver's watchdog
        reads it), and the actors' comings and goings: ``owed`` (unused credits by sender), ``credits_owed``
        (their sum), ``joined_actors`` (JOINed senders heard within credit_timeout_s), ``left``, ``lost``,
        ``credits_returned_on_leave``, ``credits_returned_on_timeout``."""
        deleted = 0 if self.segments is None else self.segments.deleted
        now = time.monotonic()
        joined = [s for s in self._joined if now - self.last_seen.get(s, -1e18) <= self.credit_timeout_s]
        return {**self.store.stats(), "bad_requests": self.bad_requests, "segments_deleted": deleted,
                "replay": self.replay, "last_seen_s": {s: round(now - t, 3) for s, t in self.last_seen.items()},
                "credits_owed": sum(self._owed.values()), "owed": dict(self._owed), "joined_actors": joined,
                **self.departures}

    # ---- metrics and housekeeping --------------------------------------------------------------

    def _log_wait(self, reason: str) -> None:
        """Log why a GET waits: each kind of reason (its words, whatever the numbers) at most every
        ``WAIT_LOG_S`` seconds, with the number of GETs that waited for it since its last line."""
        kind, now = re.sub(r"\d+", "#", reason), time.monotonic()
        at, count = self._waits.get(kind, (-WAIT_LOG_S, 0))
        if now - at < WAIT_LOG_S:
            self._waits[kind] = (at, count + 1)
            return
        self._waits[kind] = (now, 0)
        since = f" ({count} more GETs waited so since the last such line)" if count else ""
        (log.warning if "filter_zero_variance" in reason else log.info)("buffer: GET waits: %s%s", reason, since)

    def _tick(self) -> None:
        self._expire_silent()
        now = time.monotonic()
        dt = max(now - self._last_tick, 1e-6)
        stats = self.stats()
        names = ("rows", "bytes", "groups", "duplicates", "credits_granted", "credits_refunded", "refused_full",
                 "bad_requests", "learner_version", "credit_violations", "credits_owed",
                 *(k for k in stats if k.startswith("evicted_")))
        values = {f"buffer/{name}": stats[name] for name in names}
        rows, nbytes, groups = self._ingest
        values.update({"buffer/ingest_rows_per_s": rows / dt, "buffer/ingest_mb_per_s": nbytes / dt / 1e6,
                       "buffer/ingest_groups_per_s": groups / dt})
        step = stats["learner_version"]
        if self._get_ms:
            values["buffer/get_latency_ms_p50"] = float(np.percentile(self._get_ms, 50))
            values["buffer/get_latency_ms_p99"] = float(np.percentile(self._get_ms, 99))
            self.metrics.histogram("buffer/get_latency_ms", self._get_ms, step=step)
        self.metrics.scalars(values, step=step)
        self._last_tick, self._ingest, self._get_ms = now, [0, 0, 0], []
        self.consumed.commit()
        if self.segments is not None and (self._retention is None or self._retention.done()):
            if self._retention is not None:
                self._retention.result()  # re-raises a disk error of the last one
            self._retention = self._commit_pool.submit(self._apply_retention, self.store.oldest_held_seq())

    def _apply_retention(self, oldest_held_seq: int) -> None:
        """In the commit thread (the segment log's only user while serving): :meth:`SegmentLog.apply_retention`."""
        for path in self.segments.apply_retention(oldest_held_seq):
            log.info("buffer: retention deleted %s", path.name)

    def _log_selection(self, version: int) -> None:
        staleness = self.store.last_staleness
        self.metrics.histogram("buffer/staleness", staleness, step=version)
        self.metrics.scalar("buffer/staleness_mean", sum(staleness) / max(len(staleness), 1), step=version)

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the endpoint (linger 0; 500 ms after a SHUTDOWN so its ACK leaves), logs and metrics
        (idempotent). Re-raises a disk error of the segment log once the rest is closed."""
        if self._closed:
            return
        self._closed = True
        self.endpoint.close(linger_ms=500 if self._shutdown_requested else 0)
        self._commit_pool.shutdown()  # waits for a commit or retention in flight
        try:
            if self.segments is not None:
                self.segments.close()  # raises again after a disk error: the rest is closed all the same
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)
            try:
                self.consumed.close()
            finally:
                self.metrics.close()
        if self._retention is not None:
            self._retention.result()  # re-raises its disk error

    def __enter__(self) -> "BufferServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
