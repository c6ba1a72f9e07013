"""The buffer client: the requests the actor and learner make (:class:`BufferApi`), and their ZeroMQ transport.

:class:`BufferApi` is the one interface the roles see: ``put``, ``put_many``, ``get``, ``credits``,
``acked_groups``, ``join``, ``leave``, ``stop``, ``stats``, ``shutdown``, ``close``. It encodes each request with
:mod:`distrl.core.wire`, decodes the reply and turns an ERROR into its exception; a transport supplies only
``_request`` (frames out, frames back). :class:`BufferClient` is the ZeroMQ transport;
``distrl.buffer.inprocess.InProcessClient`` hands the same frames to the buffer's handlers in this process
(no sockets: tests of the actor and learner loops).

:class:`BufferClient`: request/reply over a DEALER socket with Lazy-Pirate retries.

Each request is sent as plain frames ``[header, body?]`` (the ROUTER server adds the identity). If
no reply arrives within ``timeout_s``, the socket is closed and reopened (a late reply to the old
socket is dropped with it) and the *same* request is sent again, up to ``retries`` more times.
A GET is re-sent sooner, every ``get_resend_s`` (2 s) within the same overall limit of
``timeout_s * (1 + retries)`` seconds: a buffer killed and restarted on its address loses the GET
it had received, and the learner hears from it again within ``get_resend_s`` of its restart
(logged once: "buffer at ADDR answered again after N s") instead of after ``timeout_s``.
That is safe: PUT is idempotent (the buffer drops duplicates by sample id and answers with the
original sequence number), GET of a version returns the same selection, and CREDIT at worst
grants credits that the rule still bounds. Not thread-safe: one client per thread.

An ERROR reply raises :class:`BufferRefused` (a RuntimeError) whose ``code`` is the reply's code
(docs/protocol.md); ``full`` raises its subclass :class:`BufferFullError`, which :meth:`BufferClient.put`
first waits out (backpressure), ``exhausted`` (offline replay) raises :class:`ReplayExhausted`, and
``no_progress`` (the run cannot advance) raises :class:`BufferStalled`, a :class:`distrl.core.errors.NoProgress`
whose text is the buffer's one line. A buffer that speaks another wire version (``distrl.core.wire.SCHEMA_VERSION``)
raises :class:`WireVersionMismatch`, naming both versions, at once (no re-send). Replies are decoded by
:func:`distrl.core.wire.decode`, whose structs check their fields.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import pyarrow as pa
import zmq

from distrl.core import wire
from distrl.core.errors import NoProgress
from distrl.core.rows import COMPLETION_SCHEMA
from distrl.core.security import apply_client_keys, connect_run_keys
from distrl.core.tcp import allow_ipv6
from distrl.core.wire import ErrorCode, Header, MsgType

log = logging.getLogger(__name__)


class BufferRefused(RuntimeError):
    """The buffer answered ERROR; ``code`` says why (malformed, version, unsupported, invalid, full, ...)."""

    def __init__(self, text: str, code: str) -> None:
        super().__init__(text)
        self.code = code

    def __reduce__(self):  # pickled whole (Ray hands a role's error to the driver so)
        return type(self), (str(self), self.code)


class BufferFullError(BufferRefused):
    """The buffer holds its --max_rows/--max_bytes and refused a PUT: nothing was stored; retry later."""


class ReplayExhausted(BufferRefused):
    """An offline replay buffer cannot make the requested batch, and never will."""


class BufferStalled(BufferRefused, NoProgress):
    """The buffer says the run cannot advance (e.g. ``--max_filtered_groups``); ``str()`` is its one line."""


class WireVersionMismatch(BufferRefused):
    """The buffer speaks another wire version than this client (the text names both): upgrade one side."""


_ERRORS = {ErrorCode.FULL: BufferFullError, ErrorCode.EXHAUSTED: ReplayExhausted,
           ErrorCode.VERSION: WireVersionMismatch}  # and no_progress: BufferStalled
GET_RESEND_S = 2.0  # a GET with no reply is re-sent this often (a restarted buffer lost it)
GET_HOLD_S = 0.5  # longest a GET asks the buffer to hold it while no batch can be made (below GET_RESEND_S)


class BufferApi:
    """The requests a role makes to the buffer, whatever carries them (see the module docstring).

    A transport sets ``address`` (named in errors) and ``sender`` (this client's name in headers, e.g. ``actor3``)
    and implements :meth:`_request`. Every method raises BufferRefused (a RuntimeError) on an ERROR reply, and
    what the transport raises (TimeoutError when the buffer does not answer).
    """

    address: str
    sender: str
    get_resend_s: float = GET_RESEND_S  # GET holds stay below half of it
    last_get_held_s: float = 0.0  # how long the buffer held the GET that got the last batch
    # the last BATCH's sampling-bias view (generated, trained, cells) for --bias_correction; None: none sent
    last_bias: tuple[list[int], list[int], dict[str, int]] | None = None

    def _request(self, msg_type: MsgType, body: pa.Table | None = None, retries: int | None = None,
                 resend_s: float | None = None, limit_s: float | None = None,
                 **fields: Any) -> tuple[Header, pa.Table | None]:
        """Send one request and return the reply's header and body; raises BufferRefused on an ERROR reply.
        ``retries``, ``resend_s``, ``limit_s``: the transport's re-send policy for this request (a transport
        that cannot lose a request ignores them)."""
        raise NotImplementedError

    def _decode_reply(self, frames: list) -> tuple[Header, pa.Table | None]:
        """The reply ``frames`` decoded (:func:`distrl.core.wire.decode`); a reply of another wire version raises
        WireVersionMismatch naming both."""
        try:
            return wire.decode(frames)
        except wire.VersionError as exc:
            raise WireVersionMismatch(f"buffer at {self.address} speaks wire version {exc.theirs!r}, this client "
                                      f"speaks {exc.ours}: run the same distrl version on both",
                                      ErrorCode.VERSION.value) from None

    def _reply(self, msg_type: MsgType, header: Header, body: pa.Table | None) -> tuple[Header, pa.Table | None]:
        """The reply as it is, or the error an ERROR reply stands for."""
        if header.type is MsgType.ERROR:
            code, text = header.code, header.error
            if code is ErrorCode.NO_PROGRESS:  # the buffer's one line, as launchers print it
                raise BufferStalled(text.removeprefix(f"{NoProgress.__name__}: "), code.value)
            raise _ERRORS.get(code, BufferRefused)(f"buffer at {self.address} refused {msg_type.value} "
                                                   f"({code.value}): {text}", code.value)
        return header, body

    @staticmethod
    def _expect(header: Header, *types: MsgType) -> None:
        if header.type not in types:
            raise RuntimeError(f"unexpected {header.type.value} reply, wanted {'/'.join(t.value for t in types)}")

    def put(self, table: pa.Table, full_wait_s: float = 600.0) -> int:
        """PUT one whole group; returns its sequence number (the original one for a duplicate).

        While the buffer answers ``full`` the PUT is re-sent (every 0.05 s, doubling to 2 s) for up to
        ``full_wait_s`` seconds, then BufferFullError is raised.
        """
        return self._put(table.combine_chunks(), full_wait_s).seq_no

    def _put(self, table: pa.Table, full_wait_s: float) -> Header:
        """PUT ``table`` (whole groups, one record batch) and return the ACK, re-sending while ``full``."""
        deadline, pause = time.monotonic() + full_wait_s, 0.05
        while True:
            try:
                header, _ = self._request(MsgType.PUT, body=table)
                break
            except BufferFullError:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("buffer at %s is full; %s waits %.2fs before re-sending its PUT",
                            self.address, self.sender, pause)
                time.sleep(pause)
                pause = min(2 * pause, 2.0)
        self._expect(header, MsgType.ACK)
        return header

    def put_many(self, groups: list[pa.Table], full_wait_s: float = 600.0) -> list[int]:
        """PUT several whole groups in one message (cheaper per group than one PUT each); returns each
        group's sequence number, in order (the original one for a duplicate). Waits out ``full`` as
        :meth:`put` does; the groups are accepted or refused together.
        """
        if len(groups) == 1:
            return [self.put(groups[0], full_wait_s)]
        header = self._put(pa.concat_tables(groups).combine_chunks(), full_wait_s)
        return list(header.seq_nos)

    def get(self, learner_version: int, rank: int = 0, world_size: int = 1, poll_s: float = 0.02,
            timeout_s: float | None = None, on_wait=None, max_staleness: int | None = None) -> pa.Table:
        """This rank's shard of the selection for ``learner_version``, asking again every ``poll_s`` s
        while the buffer answers WAIT.

        ``timeout_s`` None waits without limit (warning each minute); otherwise TimeoutError after it.
        ``on_wait``: called (no arguments) after each WAIT reply instead of the sleep; when it returns
        a true value (it did work, e.g. generated a group) the GET is asked again at once, else the
        sleep follows. Without ``on_wait`` the GET asks the buffer to hold it (``wait_s``, up to
        GET_HOLD_S) and answer as soon as the batch can be made, instead of a WAIT now and a poll
        later; the sleep is then what is left of ``poll_s`` (none after a held GET; a buffer that does
        not hold answers at once and the client sleeps as before). ``last_get_held_s``: how long the
        buffer held the request that got the batch. ``max_staleness``: announce the staleness bound in force
        from this version on (``--max_staleness auto``; None: the buffer keeps its own).
        """
        start = time.monotonic()
        next_warning = start + 60.0
        while True:
            hold = 0.0 if on_wait is not None else min(GET_HOLD_S, self.get_resend_s / 2, math.inf if timeout_s is None
                                                        else timeout_s - (time.monotonic() - start))
            fields = {"wait_s": round(hold, 3)} if hold >= 0.001 else {}
            if max_staleness is not None:
                fields["max_staleness"] = max_staleness
            sent = time.monotonic()
            header, body = self._request(MsgType.GET, resend_s=self.get_resend_s, learner_version=learner_version,
                                         rank=rank, world_size=world_size, **fields)
            self._expect(header, MsgType.BATCH, MsgType.WAIT)
            if header.type is MsgType.BATCH:
                self.last_get_held_s = header.held_ms / 1e3
                self.last_bias = (None if header.bias_cells is wire.UNSET else  # an older buffer sends none
                                  (header.bias_generated, header.bias_trained, header.bias_cells))
                return body if body is not None else COMPLETION_SCHEMA.empty_table()
            now = time.monotonic()
            have = header.reason or f"{header.fresh_groups} of {header.batch_size} fresh groups"
            if timeout_s is not None and now - start >= timeout_s:
                raise TimeoutError(f"no batch for version {learner_version} after {timeout_s:.0f}s: are actors "
                                   f"running? (buffer at {self.address}: {have})")
            if now >= next_warning:
                log.warning("still waiting for a batch for version %d after %.0fs (%s)",
                            learner_version, now - start, have)
                next_warning = now + 60.0
            if on_wait is None:
                time.sleep(max(0.0, poll_s - (time.monotonic() - sent)))
            elif not on_wait():
                time.sleep(poll_s)

    def credits(self, want: int, wait_s: float = 0.0) -> dict[str, int]:
        """Ask for ``want`` groups of generation: ``{granted, learner_version, min_policy_version, stop, full}``.

        ``stop`` is 1 once a learner has sent STOP (training is over): generate no more. ``full`` is 1
        while the buffer holds its memory bound (then ``granted`` is 0). ``wait_s`` > 0: while nothing can
        be granted the buffer may hold the request up to that many seconds and answer as soon as credits
        free up (the learner took a batch), instead of a grant of 0 now (a buffer older than that
        answers at once).
        """
        fields = {"wait_s": wait_s} if wait_s > 0 else {}
        header, _ = self._request(MsgType.CREDIT, want=want, **fields)
        self._expect(header, MsgType.GRANT)
        return {"granted": header.granted, "learner_version": header.learner_version,
                "min_policy_version": header.min_policy_version, "stop": int(header.stop), "full": int(header.full)}

    def acked_groups(self, actor_id: int) -> int:
        """Groups of ``actor_id`` the buffer has accepted (those in its segment log after a resume): where a
        restarted or resumed actor continues its prompt stream. Asks for no credit (a CREDIT of 0)."""
        header, _ = self._request(MsgType.CREDIT, want=0, actor_id=actor_id)
        self._expect(header, MsgType.GRANT)
        return header.acked_groups

    def join(self, first_id: int = 0) -> int:
        """A fresh actor id for a joining actor (>= ``first_id``, used by no actor of the run so far)."""
        header, _ = self._request(MsgType.JOIN, first_id=first_id)
        self._expect(header, MsgType.ACK)
        return header.actor_id

    def leave(self, timeout_s: float = 3.0) -> int:
        """Tell the buffer this client stops generating; returns the unused credits it gave back. Waits at
        most ``timeout_s`` (the buffer may be gone already): TimeoutError then."""
        header, _ = self._request(MsgType.LEAVE, resend_s=timeout_s, limit_s=timeout_s)
        self._expect(header, MsgType.ACK)
        return header.returned

    def stop(self) -> None:
        """Tell the buffer that training is over: from now on credit replies say stop."""
        header, _ = self._request(MsgType.STOP)
        self._expect(header, MsgType.ACK)

    def stats(self) -> dict[str, Any]:
        """The server's counters (see GroupStore.stats)."""
        header, _ = self._request(MsgType.STATS)
        self._expect(header, MsgType.STATS)
        return dict(header.counters)

    def shutdown(self) -> None:
        """Ask the server to stop (one attempt, no re-send: the server may already be gone)."""
        header, _ = self._request(MsgType.SHUTDOWN, retries=0)
        self._expect(header, MsgType.ACK)

    def close(self) -> None:
        """Release the transport (idempotent)."""

    def __enter__(self) -> "BufferApi":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



class BufferClient(BufferApi):
    """Talks to a :class:`distrl.buffer.server.BufferServer` at ``address``.

    Args:
        address: the server's zmq endpoint (``BufferServer.address``).
        sender: this client's name in headers, e.g. ``actor3`` or ``learner0``.
        timeout_s: seconds to wait for one reply before re-sending.
        retries: re-sends after the first attempt before TimeoutError (after ``timeout_s * (1 + retries)``
            seconds without a reply).
        get_resend_s: seconds to wait for a GET's reply before re-sending it (at most ``timeout_s``).
        curve_server_key, curve_client_key: for a CURVE buffer, the server's public key file and this
            client's secret key file (:mod:`distrl.core.security`); None: the process's run keys
            (``distrl.core.security.use_run_keys``, `distrl train`), or plain TCP without them.
    Every method raises TimeoutError if the server does not answer, BufferRefused (a RuntimeError) on
    an ERROR reply. ``resends`` counts requests sent again after a timeout.
    """

    def __init__(self, address: str, sender: str, timeout_s: float = 30.0, retries: int = 5,
                 curve_server_key: str | None = None, curve_client_key: str | None = None,
                 get_resend_s: float = GET_RESEND_S) -> None:
        self.address, self.sender, self.timeout_s, self.retries = address, sender, timeout_s, retries
        self.get_resend_s = min(get_resend_s, timeout_s)
        self._curve = (curve_server_key, curve_client_key) if curve_server_key is not None else None
        self._sock: zmq.Socket | None = None
        self._seq = 0
        self.resends = 0
        self.last_get_held_s = 0.0
        self._open()

    def _open(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        # the process's shared context: a client's own one, left unclosed in a reference cycle, blocked the
        # garbage collector for good (its __del__ terms it while the cycle's socket, already untracked, is open)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            apply_client_keys(self._sock, *self._curve)
        else:
            connect_run_keys(self._sock, "buffer")
        allow_ipv6(self._sock, self.address).connect(self.address)

    def _request(self, msg_type: MsgType, body: pa.Table | None = None, retries: int | None = None,
                 resend_s: float | None = None, limit_s: float | None = None,
                 **fields: Any) -> tuple[Header, pa.Table | None]:
        """Send one request and return the reply's header and body (Lazy Pirate): re-sent on a reopened
        socket every ``resend_s`` (default ``timeout_s``) seconds without a reply; a warning every
        ``timeout_s`` of silence, and one line when the buffer answers again.

        Raises TimeoutError after ``timeout_s * (1 + retries)`` seconds (or ``limit_s``) without a reply,
        BufferRefused on an ERROR reply.
        """
        self._seq += 1
        frames = wire.encode(msg_type, self.sender, self._seq, body, **fields)
        interval = self.timeout_s if resend_s is None else resend_s
        limit = self.timeout_s * (1 + (self.retries if retries is None else retries)) if limit_s is None else limit_s
        start = time.monotonic()
        warn_at, sends = start + self.timeout_s, 0
        while True:
            self._sock.send_multipart(frames)
            sends += 1
            reply = self._wait_reply(min(interval, start + limit - time.monotonic()))
            if reply is not None:
                if sends > 1:
                    log.info("buffer at %s answered again after %.1f s (%s sent %d times)", self.address,
                             time.monotonic() - start, msg_type.value, sends)
                return self._reply(msg_type, *reply)
            now = time.monotonic()
            if now >= warn_at - 1e-3:
                log.warning("no reply from buffer at %s to %s in %.1fs (sent %d times; up to %.0fs)",
                            self.address, msg_type.value, now - start, sends, limit)
                warn_at = now + self.timeout_s
            self._open()
            if now >= start + limit - 1e-3:
                break
            self.resends += 1
        raise TimeoutError(f"buffer at {self.address} did not answer {msg_type.value} in {limit:.1f}s "
                           f"({sends} sends): is the buffer running at that address?")

    def _wait_reply(self, timeout_s: float) -> tuple[Header, pa.Table | None] | None:
        """The reply to request ``self._seq``, or None after ``timeout_s``; other replies are dropped."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000) + 1):
                return None
            header, body = self._decode_reply(self._sock.recv_multipart())
            if header.seq == self._seq or (header.type is MsgType.ERROR and header.seq == 0):
                return header, body
        return None

    def close(self) -> None:
        """Close the socket (linger 0; idempotent). The context is the process's shared one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
