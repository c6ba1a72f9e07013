"""What the buffer answers: the reply to each request, from its header, around the store; no sockets.

:class:`distrl.buffer.server.BufferServer` receives, decodes, holds and sends; :class:`Handlers` makes the replies
(the table in :mod:`distrl.buffer.server`'s docstring) as wire frames without the envelope: one ``on_<type>`` method
per request type, the ACK of an admitted PUT, and the ERROR of a failed request. The senders' credits and
liveness are kept by :class:`distrl.buffer.client_ledger.ClientLedger`. A CREDIT that names its ``actor_id`` is
also answered ``acked_groups``: the groups of that actor id the buffer has accepted (rebuilt from the segment log
on resume), where a restarted actor resumes its prompt stream.

Progress guard: once ``--max_filtered_groups`` groups in a row were dropped by ``--filter_zero_variance``
(:meth:`GroupStore.check_progress`) no batch may ever form. The buffer logs it once, answers GETs with
ERROR ``no_progress`` (the client raises :class:`distrl.core.errors.NoProgress`) and credits with ``stop``,
for ``NO_PROGRESS_GRACE_S`` seconds so that learners and actors hear it; then, unless a SHUTDOWN came
meanwhile, :meth:`BufferServer.serve` raises NoProgress.

Metrics (TensorBoard, stepped by learner version), about once a second (:meth:`Handlers.tick`): buffer/rows,
bytes, groups, ingest_rows_per_s, ingest_mb_per_s, ingest_groups_per_s, duplicates, evicted_<reason>,
credits_granted, credits_refunded, credit_violations, credits_owed, slack_trained (``--bias_slack``), refused_full,
bad_requests, learner_version, get_latency_ms (histogram, p50, p99); and at each selection the histogram
buffer/staleness and buffer/staleness_mean. The sampling-bias monitor's ``bias/*`` scalars
(:meth:`distrl.buffer.bias.BiasMonitor.scalars`: len_gap, difficulty_gap, lag_mean, untrained_share, and each
stage's mean length and difficulty) are written with them; each BATCH carries the monitor's histograms and the
cells of its shard's groups (``bias_generated``, ``bias_trained``, ``bias_cells``) for ``--bias_correction``.
"""

from __future__ import annotations

import logging
import re
import time
from typing import ClassVar

import numpy as np

from distrl.buffer.client_ledger import ClientLedger
from distrl.buffer.segments import ConsumptionLog, SegmentLog
from distrl.buffer.store import GroupStore
from distrl.core import wire
from distrl.core.errors import NoProgress, error_code
from distrl.core.metrics import Metrics
from distrl.core.wire import ErrorCode, Header, MsgType

log = logging.getLogger(__name__)

SENDER = "buffer"
NO_PROGRESS_GRACE_S = 10.0  # a buffer that cannot progress keeps telling clients so this long, then raises
WAIT_LOG_S = 30.0  # a kind of "GET waits" line is logged at most this often, with a count


class Exhausted(RuntimeError):
    """Replay: no batch can be made and none ever will (ERROR code ``exhausted``)."""

    code: ClassVar[ErrorCode] = ErrorCode.EXHAUSTED


class Unsupported(ValueError):
    """A well-formed request of a type this buffer does not answer (ERROR code ``unsupported``)."""

    code: ClassVar[ErrorCode] = ErrorCode.UNSUPPORTED


ANSWERED = frozenset({MsgType.PUT, MsgType.GET, MsgType.CREDIT, MsgType.STATS, MsgType.STOP, MsgType.SHUTDOWN,
                      MsgType.JOIN, MsgType.LEAVE})  # the request types a buffer answers (docs/protocol.md)


class Handlers:
    """The buffer's replies around ``store``, and its counters (``stats``) and metrics (``tick``).

    Args:
        store: the groups, selection and credits (:class:`GroupStore`).
        consumed: the consumption log; every selection is recorded there before its BATCH is made.
        segments: the segment log (for its ``deleted`` count); None for an offline replay buffer (credits say
            stop, a GET that cannot be served is ERROR ``exhausted``: nothing more will arrive).
        metrics: the TensorBoard writer.
        clients: the senders' ledger: credits owed, liveness, JOIN and LEAVE.
    """

    def __init__(self, store: GroupStore, consumed: ConsumptionLog, segments: SegmentLog | None, metrics: Metrics,
                 clients: ClientLedger) -> None:
        self.store, self.consumed, self.segments, self.metrics, self.clients = (store, consumed, segments, metrics,
                                                                                clients)
        self.replay = segments is None
        self.stopping = self.replay  # STOP received (or replay): credit replies say stop
        self.bad_requests = 0
        self.no_progress: tuple[NoProgress, float] | None = None  # the error and when it was first seen
        self.last_tick, self._ingest = time.monotonic(), [0, 0, 0]  # rows, bytes, groups since the tick
        self._get_ms: list[float] = []
        self._waits: dict[str, tuple[float, int]] = {}  # kind of WAIT reason -> (last logged, GETs since)

    # ---- progress and credits ------------------------------------------------------------------

    def stalled(self) -> NoProgress | None:
        """The store's NoProgress error once it cannot advance (logged once, when first seen), else None."""
        if self.no_progress is None:
            try:
                self.store.check_progress()
            except NoProgress as exc:
                self.no_progress = (exc, time.monotonic())
                log.error("buffer: %s. GETs are refused and credits say stop; the buffer stops in %.0f s",
                          exc, NO_PROGRESS_GRACE_S)
        return None if self.no_progress is None else self.no_progress[0]

    def given_up(self) -> bool:
        """The run cannot advance and clients have been told so for NO_PROGRESS_GRACE_S: serving ends."""
        return self.stalled() is not None and time.monotonic() - self.no_progress[1] >= NO_PROGRESS_GRACE_S

    def credits_open(self) -> bool:
        """A held CREDIT would get an answer other than 0 granted now (credits, stop, or the run stalled)."""
        return self.stopping or self.no_progress is not None or self.store.open_credits() > 0

    # ---- replies -------------------------------------------------------------------------------

    def check(self, header: Header, body) -> None:
        """Refuse a decoded request the buffer cannot take: a type it does not answer, or a replay buffer's PUT
        (Unsupported); a PUT without a body, or a body on another request (ValueError)."""
        if header.type not in ANSWERED:
            raise Unsupported(f"the buffer does not answer {header.type.value} messages")
        if header.type is MsgType.PUT:
            if self.replay:
                raise Unsupported("this is an offline replay buffer: it takes no PUTs")
            if body is None:
                raise ValueError("PUT needs a body: one group as an Arrow IPC stream")
        elif body is not None:
            raise ValueError(f"{header.type.value} takes no body")

    def acknowledge(self, header: Header, nbytes: int, results: list[tuple[int, bool]]) -> list[bytes]:
        """The ACK of an admitted PUT of ``nbytes`` (``results``: ``(seq, duplicate)`` per group); counts its
        ingest."""
        new = sum(not dup for _, dup in results)
        self.clients.record_put(header.sender, len(results))  # these groups used the sender's credits
        self._ingest[0] += new * self.store.group_size
        self._ingest[1] += nbytes * new // len(results)
        self._ingest[2] += new
        fields = {"seq_no": results[0][0], "duplicate": new == 0}
        if len(results) > 1:
            fields.update(seq_nos=[seq for seq, _ in results], duplicates=len(results) - new)
        return wire.encode(MsgType.ACK, SENDER, header.seq, **fields)

    def on_get(self, header: wire.Get, hold_until: float = 0.0, held_since: float = 0.0) -> list[bytes] | None:
        """BATCH (the rank's shard of the version's selection) or WAIT; None while no batch can be made before
        ``hold_until`` (the server holds the GET, since ``held_since``). Raises NoProgress, Exhausted."""
        t0 = time.perf_counter()
        version, rank, world_size = header.learner_version, header.rank, header.world_size
        stalled = self.stalled()
        if stalled is not None:
            raise NoProgress(str(stalled))  # a new one each time: a re-raised exception keeps its traceback
        if header.max_staleness is not wire.UNSET:
            self.store.announce_bound(header.max_staleness)
        before = self.store.selections
        shard = self.store.select(version, rank, world_size)
        if shard is None:
            if self.replay:
                raise Exhausted(f"the replayed log cannot feed version {version}: {self.store.fresh_groups(version)} "
                                f"of {self.store.batch_size} groups left are eligible (the others were used "
                                f"replay_ratio={self.store.replay_ratio} times or are too stale)")
            if time.monotonic() < hold_until:
                return None  # held (wait_s): tried again after each commit, answered WAIT when it runs out
            reason = self.store.wait_reason(version)
            self._log_wait(reason)
            return wire.encode(MsgType.WAIT, SENDER, header.seq, fresh_groups=self.store.fresh_groups(version),
                               batch_size=self.store.batch_size, learner_version=self.store.learner_version,
                               reason=reason)
        if self.store.selections != before:  # a new selection: record every shard before any is sent
            for r, s in enumerate(self.store.selection(version)):
                self.consumed.append(version, r, s, world_size, self.store.max_staleness)
            self._log_selection(version)
        held = {"held_ms": round((time.monotonic() - held_since) * 1e3, 3)} if held_since else {}
        reply = wire.encode(MsgType.BATCH, SENDER, header.seq, body=shard, learner_version=version,
                            rank=rank, world_size=world_size, rows=shard.num_rows, **held,
                            **self.store.bias.batch_fields(version, shard))
        self._get_ms.append((time.perf_counter() - t0) * 1e3)
        return reply

    def on_credit(self, header: wire.Credit) -> list[bytes]:
        """GRANT: credits (none once stopping or stalled), the versions actors may generate with, and why not."""
        self.clients.reclaim(header.sender)
        stalled = self.stalled()
        granted = 0 if self.stopping or stalled is not None else self.store.grant_credits(header.want)
        self.clients.record_grant(header.sender, granted)
        fields = dict(granted=granted, learner_version=self.store.learner_version,
                      min_policy_version=self.store.min_policy_version, stop=self.stopping or stalled is not None,
                      full=self.store.full)
        if stalled is not None:
            fields["reason"] = str(stalled)
        elif self.store.full:
            fields["reason"] = "buffer full: no credits until the learners consume"
        if header.actor_id is not wire.UNSET:
            fields["acked_groups"] = self.store.acked_groups(header.actor_id)
        return wire.encode(MsgType.GRANT, SENDER, header.seq, **fields)

    def on_join(self, header: wire.Join) -> list[bytes]:
        """ACK with a fresh actor id (:meth:`ClientLedger.join`)."""
        return wire.encode(MsgType.ACK, SENDER, header.seq, actor_id=self.clients.join(header.sender,
                                                                                        header.first_id))

    def on_leave(self, header: Header) -> list[bytes]:
        """ACK with the number of the sender's unused credits, which return now (:meth:`ClientLedger.leave`)."""
        return wire.encode(MsgType.ACK, SENDER, header.seq, returned=self.clients.leave(header.sender))

    def on_stop(self, header: Header) -> list[bytes]:
        self.stopping = True
        log.info("training is over (STOP from %s): credits now answer stop", header.sender)
        return wire.encode(MsgType.ACK, SENDER, header.seq)

    def on_stats(self, header: Header) -> list[bytes]:
        return wire.encode(MsgType.STATS, SENDER, header.seq, counters=self.stats())

    def error(self, exc: Exception, envelope: list[bytes], seq: int) -> list[bytes]:
        """The ERROR reply to ``exc`` (its :func:`distrl.core.errors.error_code`); a wire version mismatch names
        both versions."""
        self.bad_requests += 1
        code = error_code(exc)
        if code is ErrorCode.INTERNAL:
            log.exception("buffer: internal error on a request from %r", envelope[0])
        elif code is not ErrorCode.FULL:
            log.debug("bad request from %r: %s", envelope[0], exc)
        if isinstance(exc, wire.VersionError):
            return wire.error(f"client speaks wire version {exc.theirs!r}, this buffer speaks {exc.ours}", SENDER,
                              seq, code)
        return wire.error(f"{type(exc).__name__}: {exc}", SENDER, seq, code)

    def stats(self) -> dict:
        """The store's counters plus the server's (bad_requests, segments_deleted, replay) and the senders'
        (:meth:`ClientLedger.stats`: ``last_seen_s``, ``owed``, ``credits_owed``, ``joined_actors``, departures)."""
        deleted = 0 if self.segments is None else self.segments.deleted
        return {**self.store.stats(), "bad_requests": self.bad_requests, "segments_deleted": deleted,
                "replay": self.replay, **self.clients.stats()}

    # ---- metrics -------------------------------------------------------------------------------

    def tick(self) -> None:
        """About once a second: silent senders' credits return, the metrics are written, the consumption log
        committed."""
        self.clients.expire_silent()
        now = time.monotonic()
        dt = max(now - self.last_tick, 1e-6)
        stats = self.stats()
        names = ("rows", "bytes", "groups", "duplicates", "credits_granted", "credits_refunded", "refused_full",
                 "bad_requests", "learner_version", "credit_violations", "credits_owed", "slack_trained",
                 *(k for k in stats if k.startswith("evicted_")))
        values = {f"buffer/{name}": stats[name] for name in names}
        rows, nbytes, groups = self._ingest
        values.update({"buffer/ingest_rows_per_s": rows / dt, "buffer/ingest_mb_per_s": nbytes / dt / 1e6,
                       "buffer/ingest_groups_per_s": groups / dt})
        values.update(self.store.bias.scalars())
        step = stats["learner_version"]
        if self._get_ms:
            values["buffer/get_latency_ms_p50"] = float(np.percentile(self._get_ms, 50))
            values["buffer/get_latency_ms_p99"] = float(np.percentile(self._get_ms, 99))
            self.metrics.histogram("buffer/get_latency_ms", self._get_ms, step=step)
        self.metrics.scalars(values, step=step)
        self.last_tick, self._ingest, self._get_ms = now, [0, 0, 0], []
        self.consumed.commit()

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

    def _log_selection(self, version: int) -> None:
        staleness = self.store.last_staleness
        self.metrics.histogram("buffer/staleness", staleness, step=version)
        self.metrics.scalar("buffer/staleness_mean", sum(staleness) / max(len(staleness), 1), step=version)
