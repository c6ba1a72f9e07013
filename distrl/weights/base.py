"""Weights by policy version: the announcement, its publisher and its subscriber.

Learner rank 0 owns a :class:`WeightPublisher`. After each optimizer step it publishes the new
weights through a transport (today: a shared directory, :mod:`distrl.weights.fs`) and announces
``(version, format, digest, location)`` on a ZMQ PUB socket. PUB/SUB drops what was sent before a
subscriber connected, so the publisher also answers ``LATEST`` requests on a ROUTER socket (late
joiners, restarted actors). Actors own a :class:`WeightSubscriber`: between generate calls they take
the newest announcement, never an older one than they serve, and verify its digest before loading.

Formats: ``base`` (version 0: the initial weights, nothing to load) and ``lora`` (a PEFT adapter
directory that vLLM loads as a new ``LoRARequest`` per version).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import zmq

from distrl import wire

TOPIC = b"weights"


class WeightError(RuntimeError):
    """A weight payload that cannot be used (missing, or its digest does not match)."""


@dataclass(frozen=True)
class Announcement:
    """One published policy version. ``location`` is transport-specific (a directory for `fs`)."""

    version: int
    format: str
    digest: str
    location: str

    @classmethod
    def from_fields(cls, fields: dict) -> "Announcement":
        try:
            return cls(int(fields["version"]), str(fields["format"]), str(fields["digest"]),
                       str(fields["location"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise wire.WireError(f"bad weight announcement {fields!r}: {exc}") from None


BASE = Announcement(version=0, format="base", digest="", location="")


def _bind(sock: zmq.Socket, address: str) -> str:
    """Bind to `address`; port 0 picks a free port. Returns the bound address."""
    if address.endswith(":0"):
        port = sock.bind_to_random_port(address.rsplit(":", 1)[0])
        return f"{address.rsplit(':', 1)[0]}:{port}"
    sock.bind(address)
    return address


class WeightPublisher:
    """Announces versions (PUB) and answers LATEST requests (ROUTER, served by a daemon thread)."""

    def __init__(self, pub_address: str = "tcp://127.0.0.1:0", latest_address: str = "tcp://127.0.0.1:0"):
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.linger = 0
        self.pub_address = _bind(self._pub, pub_address)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self.latest_address = _bind(self._router, latest_address)
        self._latest = BASE
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_latest, name="weights-latest", daemon=True)
        self._thread.start()

    @property
    def addresses(self) -> tuple[str, str]:
        return self.pub_address, self.latest_address

    def announce(self, ann: Announcement) -> None:
        """Make `ann` the latest version and broadcast it. Versions must increase."""
        with self._lock:
            if ann.version <= self._latest.version and ann.version != 0:
                raise ValueError(f"version {ann.version} is not newer than {self._latest.version}")
            self._latest = ann
        self._pub.send_multipart([TOPIC, *wire.encode(wire.MsgType.ANNOUNCE, "learner0", ann.version, **asdict(ann))])

    def _serve_latest(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._router.recv_multipart()
            try:
                header, _ = wire.decode(frames)
                if header.type != wire.MsgType.LATEST:
                    raise wire.WireError(f"weight endpoint answers LATEST only, got {header.type.value}")
                with self._lock:
                    reply = wire.encode(wire.MsgType.ANNOUNCE, "learner0", header.seq, **asdict(self._latest))
            except wire.WireError as exc:
                reply = wire.error(str(exc))
            self._router.send_multipart([ident, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pub.close()
        self._router.close()


class WeightSubscriber:
    """Actor side: tracks the newest announced version; `latest()` never goes backwards."""

    def __init__(self, pub_address: str, latest_address: str, sender: str = "actor"):
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.linger = 0
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(pub_address)
        self._latest_address = latest_address
        self._sender = sender
        self.newest = BASE

    def _offer(self, ann: Announcement) -> None:
        if ann.version > self.newest.version:
            self.newest = ann

    def poll(self) -> Announcement:
        """Drain pending announcements without blocking; return the newest known."""
        while self._sub.poll(0):
            _topic, *frames = self._sub.recv_multipart()
            header, _ = wire.decode(frames)
            self._offer(Announcement.from_fields(header.fields))
        return self.newest

    def request_latest(self, timeout_s: float = 10.0) -> Announcement:
        """Ask the publisher for its latest version (for late joiners). Raises TimeoutError."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        try:
            sock.connect(self._latest_address)
            sock.send_multipart(wire.encode(wire.MsgType.LATEST, self._sender))
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no answer from weight endpoint {self._latest_address} in {timeout_s}s")
            header, _ = wire.decode(sock.recv_multipart())
        finally:
            sock.close()
        if header.type == wire.MsgType.ERROR:
            raise RuntimeError(header.fields.get("error"))
        self._offer(Announcement.from_fields(header.fields))
        return self.newest

    def wait_for(self, min_version: int, timeout_s: float, should_stop=lambda: False) -> Announcement:
        """Block until a version >= min_version is announced. Raises TimeoutError naming it."""
        deadline = time.monotonic() + timeout_s
        while self.poll().version < min_version:
            if should_stop():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"policy version {min_version} was not announced within {timeout_s}s "
                                   f"(newest {self.newest.version}): is the learner running?")
            if self._sub.poll(200) == 0:
                self.request_latest()
        return self.newest

    def close(self) -> None:
        self._sub.close()
