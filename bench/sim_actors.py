"""Simulated rollout actors for bench/many_actors.py: real ZMQ clients of the buffer, many per process.

Each actor is a DEALER socket speaking the buffer's wire protocol (:mod:`distrl.core.wire`) as
``distrl.core.buffer_client.BufferClient`` does: CREDIT (with ``wait_s``), then one PUT of the granted groups, then
CREDIT again after the ACK. Its PUT bodies are Arrow IPC streams of the completion schema built ahead
of time (:class:`Body`); a send writes only new fixed-width ids and the policy version into them.
:func:`actor_host` drives many actors from one thread with a ``zmq.Poller``.
"""

from __future__ import annotations

import struct
import sys
import time

import numpy as np
import pyarrow as pa
import zmq

from distrl.core import wire
from distrl.core.rows import COMPLETION_SCHEMA, encode_table
from distrl.core.wire import MsgType

ID_WIDTH = 12  # digits of the per-actor group counter written into the ids
_SNDMORE = int(zmq.SNDMORE)  # a plain int: pyzmq's flag enums cost microseconds a message
_PV = 0x5A5A5A5A00000000  # policy_version sentinels: found in the template bytes, then overwritten


def _token(kind: str, g: int, i: int) -> str:
    """A unique ID_WIDTH-char placeholder for group ``g`` (row ``i``) in a template."""
    return f"{kind}{g:02d}{i:02d}".rjust(ID_WIDTH, "~")


def group_template(actor: int, count: int, n: int, completion_len: int, prompt_len: int) -> pa.Table:
    """``count`` groups of ``n`` completions of actor ``actor`` with placeholder ids and policy versions."""
    rng = np.random.default_rng(actor * 10 + count)
    rows = count * n

    def lists(length: int, values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * length), pa.array(values))

    gs, its = np.repeat(np.arange(count), n), np.tile(np.arange(n), count)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    rewards[::n] = 1.0 - rewards[1::n]  # never all equal within a group
    cols = {
        "sample_id": [f"a{actor:02d}-{_token('S', g, i)}-{i}" for g, i in zip(gs, its)],
        "group_id": [f"a{actor:02d}-{_token('G', g, 0)}" for g in gs],
        "prompt_id": [f"math/{actor}/{g}" for g in gs], "actor_id": np.full(rows, actor, np.int32),
        "policy_version": (_PV + gs * 256 + its).astype(np.int64),
        "last_policy_version": (_PV + 0x10000 + gs * 256 + its).astype(np.int64),
        "prompt_ids": lists(prompt_len, rng.integers(0, 151_000, rows * prompt_len, dtype=np.int32)),
        "completion_ids": lists(completion_len, rng.integers(0, 151_000, rows * completion_len, dtype=np.int32)),
        "behavior_logprobs": lists(completion_len, -rng.random(rows * completion_len, dtype=np.float32)),
        "temperature": np.ones(rows, np.float32), "reward": rewards,
        "reward_components": pa.array([[("correct", float(r))] for r in rewards], pa.map_(pa.string(), pa.float32())),
        "advantage": (rewards - rewards.mean()).astype(np.float32), "finish_reason": ["stop"] * rows,
        "prompt_text": ["Find the sum of all x such that x^2 = 49."] * rows,
        "completion_text": ["x = 7 or x = -7, so the sum is \\boxed{0}."] * rows,
        "gen_start_time": np.full(rows, time.time()), "gen_seconds": np.full(rows, 2.5),
    }
    if "served_versions" in COMPLETION_SCHEMA.names:  # the weight stamps (distrl.weights.attest): one version
        cols.update(served_versions=lists(1, (_PV + 0x20000 + gs * 256 + its).astype(np.int64)),
                    weights_digests=[["xxh3_128:" + "5e" * 16]] * rows, canary_logprobs=[[-3.912345]] * rows)
    return pa.Table.from_pydict({**dict.fromkeys(COMPLETION_SCHEMA.names, [None] * rows), **cols},
                              schema=COMPLETION_SCHEMA).combine_chunks()


class Body:
    """A pre-encoded PUT body (Arrow IPC stream) of ``count`` groups, with the byte offsets of its ids
    and policy versions: :meth:`fill` writes a new group counter and version into it."""

    def __init__(self, table: pa.Table, count: int, n: int) -> None:
        self.bytes = bytearray(encode_table(table))
        self.count, self.n = count, n
        find = self._find
        self.ids = [find(_token("G", g, 0).encode(), n) + [find(_token("S", g, i).encode())[0] for i in range(n)]
                    for g in range(count)]  # a group id is stored once per row
        self.versions = [find(struct.pack("<q", _PV + g * 256))[0] for g in range(count)]
        self.lasts = [find(struct.pack("<q", _PV + 0x10000 + g * 256))[0] for g in range(count)]
        if "served_versions" in COMPLETION_SCHEMA.names:
            self.lasts += [find(struct.pack("<q", _PV + 0x20000 + g * 256))[0] for g in range(count)]

    def _find(self, needle: bytes, times: int = 1) -> list[int]:
        """The offsets of ``needle`` in the body; RuntimeError unless it occurs exactly ``times`` times."""
        found, at = [], self.bytes.find(needle)
        while at >= 0:
            found.append(at)
            at = self.bytes.find(needle, at + 1)
        if len(found) != times:
            raise RuntimeError(f"template marker {needle!r} is {len(found)} times in the body, not {times}")
        return found

    def fill(self, first_counter: int, version: int) -> bytes:
        """The body with groups numbered ``first_counter``, ``first_counter + 1``, ... at ``version``."""
        out, vs = self.bytes, struct.pack("<q", version) * self.n
        for g in range(self.count):
            digits = f"{first_counter + g:0{ID_WIDTH}d}".encode()
            for at in self.ids[g]:
                out[at:at + ID_WIDTH] = digits
            out[self.versions[g]:self.versions[g] + 8 * self.n] = vs
        for at in self.lasts:  # last_policy_version, served_versions: runs of n int64
            out[at:at + 8 * self.n] = vs
        return bytes(out)


class Actor:
    """One simulated actor: its DEALER socket, its bodies (1 and ``want`` groups) and its counters."""

    def __init__(self, ctx: zmq.Context, address: str, actor: int, want: int, wait_s: float, n: int,
                 completion_len: int, prompt_len: int) -> None:
        self.name, self.want = f"actor{actor:02d}", want
        self.wait = {"wait_s": wait_s} if wait_s > 0 else {}
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.bodies = {c: Body(group_template(actor, c, n, completion_len, prompt_len), c, n)
                       for c in range(1, want + 1)}
        self.seq = self.counter = 0
        self.granted = self.put = self.refused = self.credit_requests = 0
        self.pending: int | None = None  # groups of the PUT in flight (None: a CREDIT is in flight)
        self.ask_at = 0.0  # monotonic time of the next CREDIT (after a refusal)
        self.sent = 0.0  # monotonic time the request in flight was sent
        self.ack_ms: list[float] = []  # PUT -> ACK round trips (the group commit's latency with the sockets')

    def ask(self) -> None:
        self.seq += 1
        self.pending = None
        self.credit_requests += 1
        self.sent = time.monotonic()
        self.sock.send(wire.encode(MsgType.CREDIT, self.name, self.seq, want=self.want, **self.wait)[0], 0)

    def on_reply(self, frames: list[bytes], idle_s: float, stopping: bool) -> bool:
        """Handle one reply; returns True when a request was sent (False: the actor waits for ``ask_at``).
        Raises RuntimeError on an ERROR reply or a grant beyond ``want``."""
        header = wire.decode_header(frames[0])
        if header.type is MsgType.ERROR:
            raise RuntimeError(f"{self.name}: buffer refused: {header.error}")
        if self.pending is not None:  # the ACK of a PUT
            self.ack_ms.append((time.monotonic() - self.sent) * 1e3)
            self.put += self.pending
            self.pending = None
        elif header.granted > 0 and not header.stop:
            if header.granted > self.want:
                raise RuntimeError(f"{self.name}: granted {header.granted} > asked {self.want}")
            self.granted += header.granted
            self.seq += 1
            body = self.bodies[header.granted].fill(self.counter, header.learner_version)
            self.counter += header.granted
            self.pending = header.granted
            self.sent = time.monotonic()
            self.sock.send(wire.encode(MsgType.PUT, self.name, self.seq)[0], _SNDMORE)
            self.sock.send(body, 0, copy=False)
            return True
        else:
            self.refused += 1
            self.ask_at = time.monotonic() + idle_s
            return False
        if stopping:
            return False
        self.ask()
        return True


def actor_host(address: str, ids: list[int], want: int, wait_s: float, idle_s: float, n: int,
               completion_len: int, prompt_len: int) -> dict:
    """Drive the actors ``ids`` from this thread from the go line (:func:`go`) until its monotonic
    deadline, then let the requests in flight finish; returns their summed counters. Raises
    RuntimeError on an ERROR reply."""
    ctx = zmq.Context()
    actors = [Actor(ctx, address, i, want, wait_s, n, completion_len, prompt_len) for i in ids]
    by_sock = {a.sock: a for a in actors}
    poller = zmq.Poller()
    for a in actors:
        poller.register(a.sock, zmq.POLLIN)
    deadline = go()
    for a in actors:
        a.ask()
    busy = set(actors)  # actors with a request in flight
    while busy or time.monotonic() < deadline:
        now = time.monotonic()
        stopping = now >= deadline
        if not stopping:
            for a in actors:
                if a not in busy and a.ask_at <= now:
                    a.ask()
                    busy.add(a)
        waiting = [a.ask_at for a in actors if a not in busy]
        timeout = 0.05 if not waiting else max(0.0, min(waiting) - now)
        for sock, _ in poller.poll(int(timeout * 1000) + 1):
            a = by_sock[sock]
            if not a.on_reply([sock.recv(0)], idle_s, stopping):  # replies are one frame (no body)
                busy.discard(a)
        if stopping and time.monotonic() > deadline + 10:
            raise RuntimeError(f"{len(busy)} actors got no reply within 10 s of the end")
    for a in actors:
        a.sock.close()
    ctx.term()
    keys = ("granted", "put", "refused", "credit_requests")
    ack_ms = np.concatenate([a.ack_ms for a in actors]) if any(a.ack_ms for a in actors) else np.zeros(1)
    return {**{k: sum(getattr(a, k) for a in actors) for k in keys},
            "ack_ms_p50": float(np.percentile(ack_ms, 50)), "ack_ms_p99": float(np.percentile(ack_ms, 99))}


def go() -> float:
    """Say ready on stdout, then read the monotonic deadline from stdin (the bench starts everyone at once)."""
    print("ready", flush=True)
    return float(sys.stdin.readline())
