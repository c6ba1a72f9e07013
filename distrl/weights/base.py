"""Weights by policy version: the announcement, its publisher and its subscriber.

Learner rank 0 owns a :class:`WeightPublisher`. After each optimizer step it publishes the new
weights through a transport (today: a shared directory, :mod:`distrl.weights.fs`) and announces
``(version, format, digest, location)`` on a ZMQ PUB socket. PUB/SUB drops what was sent before a
subscriber connected, so the publisher also answers ``LATEST`` requests on a ROUTER socket (late
joiners, restarted actors). Actors own a :class:`WeightSubscriber`: between generate calls they take
the newest announcement, never an older one than they serve, and verify its digest before loading.
An announcement is the wire message itself (:class:`distrl.core.wire.Announce`, made by :func:`announcement`):
the struct the publisher sends is the one subscribers decode, validate and hand to loaders.

Formats: ``base`` (version 0: the initial weights, nothing to load), ``lora`` (a PEFT adapter
directory that vLLM loads as a new ``LoRARequest`` per version) and ``full`` (a `save_pretrained`
model directory, loaded in place).

One interface, whatever the transport (``--weights_transport``, :mod:`distrl.weights` lists them):

- learner rank 0 holds a :class:`Publisher` (a :class:`WeightPublisher` that also makes the payload):
  ``publish(version, model)``, ``flush(timeout_s)``, ``linger(actors)``, ``close()``;
- an actor holds a :class:`Loader`: ``load(announcement, engine)`` gets the payload, verifies it and loads
  it into the engine, returning the announcement of the version the engine now serves.

``fs`` and ``zmq`` write each version once into the learner's weight directory (:mod:`.fs`); ``fs``
actors read it from a shared filesystem, ``zmq`` actors download it from the publisher's endpoint
(:mod:`.zmq`), which answers ``FETCH`` as well as ``LATEST``; both check the directory digest before the
engine loads anything. ``nccl`` (:mod:`.nccl`) broadcasts full weights from the learner's device and
checks a checksum of the received tensors.

With the process's run keys set (``distrl.core.security.use_run_keys``: `distrl train` across nodes), the PUB and
ROUTER sockets are CURVE servers that admit only the run's client key, and every subscriber and fetcher
socket a CURVE client of them.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

import msgspec
import zmq

from distrl.core import wire
from distrl.core.errors import BindError
from distrl.core.security import connect_run_keys, run_keys, serve_run_keys
from distrl.core.tcp import allow_ipv6

TOPIC = b"weights"
MAX_REQUEST_BYTES = 64 * 1024  # LATEST and FETCH requests are one small header


class WeightError(RuntimeError):
    """A weight payload that cannot be used (missing, or its digest does not match)."""


Announcement = wire.Announce  # the one announcement type: the ANNOUNCE message, as sent and as received


def announcement(version: int, format: str, digest: str, location: str, published_at: float = 0.0, nbytes: int = 0,
                 manifest: tuple = ()) -> Announcement:
    """One published policy version (:class:`distrl.core.wire.Announce`). ``location`` is transport-specific (a
    directory for `fs`); ``published_at``: unix seconds when the payload was in place (for lag metrics);
    ``nbytes``: payload size in bytes; ``manifest``: nccl and shm transports' (name, dtype, shape, buffer, offset)
    of each tensor. Sent as it is (sender ``learner0``, seq = version)."""
    return wire.message(wire.MsgType.ANNOUNCE, "learner0", version, version=version, format=format, digest=digest,
                        location=location, published_at=published_at, nbytes=nbytes, manifest=manifest)


def announced(header: wire.Header) -> Announcement:
    """The announcement a decoded PUB message or LATEST reply is, as :func:`announcement` made it (a reply's seq,
    which echoes its request's, back to the version); WireError if it is another message type."""
    if header.type is not wire.MsgType.ANNOUNCE:
        raise wire.WireError(f"expected a weight announcement, got {header.type.value}")
    return header if header.seq == header.version else msgspec.structs.replace(header, seq=header.version)


BASE = announcement(version=0, format="base", digest="", location="")


def endpoint_host(address: str) -> str:
    """The host part of a ``tcp://host:port`` endpoint."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


def _bind(sock: zmq.Socket, address: str) -> str:
    """Bind to `address`; port 0 picks a free port. Returns the bound address.

    Raises BindError (naming the address) if it cannot be bound."""
    try:
        if address.endswith(":0"):
            port = sock.bind_to_random_port(address.rsplit(":", 1)[0])
            return f"{address.rsplit(':', 1)[0]}:{port}"
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise BindError(f"weight endpoint cannot bind {address}: {exc} (pick another port, or 0)") from None
    return address


CHUNK_BYTES = 4 * 2**20  # the largest FETCH chunk a fetcher asks for by default (a request may ask 4x)


def serve_fetch(header: wire.Header, payloads: dict[int, Announcement]) -> list[bytes]:
    """Answer one FETCH request from the payload directories of retained versions.

    Raises WireError for a request that names an unknown version, file or range.
    """
    version = header.fields.get("version")
    ann = payloads.get(version) if isinstance(version, int) else None
    if ann is None or not Path(ann.location).is_dir():
        raise wire.WireError(f"version {version!r} is not retained by this learner (have {sorted(payloads)})")
    root = Path(ann.location)
    if "file" not in header.fields:
        files = [[str(p.relative_to(root)), p.stat().st_size] for p in sorted(root.rglob("*")) if p.is_file()]
        return wire.encode_raw(wire.MsgType.MANIFEST, "learner0", header.seq, version=version, digest=ann.digest,
                               files=files)
    name, offset, length = header.fields["file"], header.fields.get("offset"), header.fields.get("length")
    path = (root / str(name)).resolve()
    if root.resolve() not in path.parents or not path.is_file():
        raise wire.WireError(f"no file {name!r} in version {version}")
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and 0 < length <= CHUNK_BYTES * 4):
        raise wire.WireError(f"bad range offset={offset!r} length={length!r}")
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    return wire.encode_raw(wire.MsgType.CHUNK, "learner0", header.seq, body=data, version=version, file=name,
                           offset=offset)


class WeightPublisher:
    """Announces versions (PUB) and answers LATEST requests (ROUTER, served by a daemon thread); both CURVE
    servers when the process has run keys (their own context then, with its ZAP authenticator)."""

    def __init__(self, pub_address: str = "tcp://127.0.0.1:0", latest_address: str = "tcp://127.0.0.1:0"):
        self._ctx, self._curve = zmq.Context.instance(), None
        if run_keys() is not None:
            self._ctx = zmq.Context()
            self._curve = serve_run_keys(self._ctx, "weights")
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.linger = 0
        if self._curve is not None:
            self._curve.apply(self._pub)
        self.pub_address = _bind(allow_ipv6(self._pub, pub_address), pub_address)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        if self._curve is not None:
            self._curve.apply(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # requests are small: drop larger peers
        self.latest_address = _bind(allow_ipv6(self._router, latest_address), latest_address)
        self._latest = BASE
        self._payloads: dict[int, Announcement] = {}  # retained versions, served to FETCH
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_request = time.monotonic()
        self._asked_latest: set[str] = set()  # senders of LATEST since the newest announcement
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
            self._payloads = {v: a for v, a in self._payloads.items() if Path(a.location).is_dir()}
            self._payloads[ann.version] = ann
            self._asked_latest = set()
        self._pub.send_multipart([TOPIC, ann.encode()])

    def _serve_latest(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._router.recv_multipart()
            reply = self._answer(frames)
            self._last_request = time.monotonic()

            self._router.send_multipart([ident, *reply])

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """Reply to one request on the weight endpoint: LATEST or FETCH; anything else is an ERROR."""
        try:
            header, _ = wire.decode_raw(frames)
            with self._lock:
                latest, payloads = self._latest, dict(self._payloads)
            if header.type == wire.MsgType.LATEST:
                self._asked_latest.add(header.sender)
                return [msgspec.structs.replace(latest, seq=header.seq).encode()]
            if header.type == wire.MsgType.FETCH:
                return serve_fetch(header, payloads)
            raise wire.WireError(f"weight endpoint answers LATEST and FETCH, got {header.type.value}")
        except (wire.WireError, OSError, ValueError, TypeError, KeyError) as exc:  # bad input never kills the thread
            return wire.error(str(exc), code="malformed" if isinstance(exc, wire.WireError) else "invalid")

    def linger(self, actors: int, idle_s: float = 3.0, max_s: float = 300.0) -> bool:
        """Keep serving after the final version until `actors` distinct actors asked LATEST since it was
        announced (an actor told to stop does, then fetches it) and no request came for `idle_s`
        seconds, or `max_s` passed. Returns False on the time limit."""
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            if len(self._asked_latest) >= actors and time.monotonic() - self._last_request >= idle_s:
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pub.close()
        self._router.close()
        if self._curve is not None:
            self._curve.stop()
            self._ctx.term()


def payload_format(model) -> str:
    """``lora`` for a PEFT-wrapped model (its adapter is the payload), ``full`` for any other."""
    return "lora" if hasattr(model, "peft_config") else "full"


class Publisher(WeightPublisher, ABC):
    """Learner rank 0's end of a weight transport: an announcer that also puts each version's payload
    where the actors get it (a directory, or a broadcast)."""

    @abstractmethod
    def publish(self, version: int, model) -> Announcement:
        """Publish `model`'s weights as `version`, announce them and return the announcement.

        `model`: a transformers model (``save_pretrained``, ``named_parameters``); a PEFT-wrapped one
        publishes its adapter (format ``lora``), any other its whole weights (``full``). Raises
        ValueError when `version` is not newer than the last one announced.
        """

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds until the newest version has reached the actors, where the
        transport knows that (a broadcast); on timeout give up on it and return False. Directories: True."""
        return True


class Loader(ABC):
    """An actor's end of a weight transport: `load(ann, engine)` gets an announced version into `engine`.

    `engine` is a rollout engine: ``load_weights(version, format, path)`` for a payload directory,
    ``load_tensors(version, named_tensors)`` for full weights received as tensors.
    """

    bytes_fetched = 0  # payload bytes this loader received (the ``actor/weight_mb_fetched`` metric)
    retains_versions = True  # any retained announced version can be loaded, not only the newest

    @abstractmethod
    def load(self, ann: Announcement, engine) -> Announcement:
        """Get `ann`'s payload, verify it and load it into `engine`; return the announcement of the version
        the engine now serves (a broadcast may carry a newer one). Raises WeightError for a missing or
        corrupted payload (the engine then still serves what it served)."""

    def close(self) -> None:  # noqa: B027 (nothing to release by default)
        """Release what the loader holds (sockets, a process group)."""


class DirectoryLoader(Loader):
    """A loader whose payload is a directory: `fetch(ann)` returns its verified local path."""

    @abstractmethod
    def fetch(self, ann: Announcement) -> Path:
        """The local payload directory of `ann`, digest-checked. Raises WeightError."""

    def load(self, ann: Announcement, engine) -> Announcement:
        path = self.fetch(ann)
        try:
            engine.load_weights(ann.version, ann.format, path)
        except FileNotFoundError as exc:  # pruned meanwhile: the publisher keeps the staleness ceiling + 4 versions
            raise WeightError(f"weights of version {ann.version} were pruned while loading ({exc}): a slow actor "
                              f"takes a newer one") from exc
        return ann


class WeightSubscriber:
    """Actor side: tracks the newest announced version; `latest()` never goes backwards."""

    def __init__(self, pub_address: str, latest_address: str, sender: str = "actor"):
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.linger = 0
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        connect_run_keys(self._sub, "weights")
        allow_ipv6(self._sub, pub_address).connect(pub_address)
        self._latest_address = latest_address
        self._sender = sender
        self.newest = BASE
        self.seen: dict[int, Announcement] = {0: BASE}  # the last few announcements, by version

    def _offer(self, ann: Announcement) -> None:
        self.seen[ann.version] = ann
        for old in sorted(self.seen)[:-16]:
            del self.seen[old]
        if ann.version > self.newest.version:
            self.newest = ann

    def announcement(self, version: int, timeout_s: float = 60.0) -> Announcement:
        """The announcement of `version` (waiting for it if not seen yet). Raises TimeoutError."""
        if version not in self.seen:
            self.wait_for(version, timeout_s)
        if version not in self.seen:
            raise TimeoutError(f"no announcement of version {version} (newest {self.newest.version})")
        return self.seen[version]

    def poll(self) -> Announcement:
        """Drain pending announcements without blocking; return the newest known."""
        while self._sub.poll(0):
            _topic, *frames = self._sub.recv_multipart()
            header, _ = wire.decode(frames)
            self._offer(announced(header))
        return self.newest

    def request_latest(self, timeout_s: float = 10.0) -> Announcement:
        """Ask the publisher for its latest version (for late joiners). Raises TimeoutError."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        connect_run_keys(sock, "weights")
        try:
            allow_ipv6(sock, self._latest_address).connect(self._latest_address)
            sock.send_multipart(wire.encode(wire.MsgType.LATEST, self._sender))
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no answer from weight endpoint {self._latest_address} in {timeout_s}s")
            header, _ = wire.decode(sock.recv_multipart())
        finally:
            sock.close()
        if header.type == wire.MsgType.ERROR:
            raise RuntimeError(header.fields.get("error"))
        self._offer(announced(header))
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
                try:  # a learner that is restarting does not answer: keep asking until the deadline
                    self.request_latest(timeout_s=min(10.0, max(deadline - time.monotonic(), 0.1)))
                except TimeoutError:
                    pass
        return self.newest

    def close(self) -> None:
        self._sub.close()
