"""Collective weight transport: learner rank 0 broadcasts full weights to the actors' devices.

For full fine-tuning on GPUs, where a 1 GB (0.5B bf16) payload through a filesystem costs seconds:
the learner and the A actors form their own process group of 1 + A ranks (NCCL on GPUs, gloo on CPU:
the same code path runs in CPU tests), rendezvous through a TCPStore that the learner hosts. It is
not the learners' gradient group, so it needs no `init_process_group` and works beside it.

    learner: BroadcastPublisher.publish(version, model) -> snapshot into one flat buffer per dtype (on device),
             checksum, announce (format "full", transport "nccl", manifest); a sender thread then runs
             one *round*: broadcast [version], then each flat buffer.
    actor:   BroadcastReceiver.load(announcement, engine): when it sees an announcement newer than the
             version it serves, it joins the next round (between generate calls), receives the version
             number and the buffers, checks the checksum, and loads the tensors into its engine
             (``engine.load_tensors``).

A round is a collective: it starts when every actor has joined (an actor busy generating delays the
others' update, as in any collective broadcast), and the learner's training loop never waits (the
sender is a thread and always sends the newest snapshot): an actor may receive another version than
the announcement it reacted to, always newer than the one it serves. The checksum (``sum64``: the sum of
the payload's 16-bit words, computed on the device) detects corrupted or mismatched buffers.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist

from distrl.weights.base import Announcement, Loader, Publisher, WeightError, announcement
from distrl.weights.flat import Layout, checksum

TIMEOUT = datetime.timedelta(minutes=30)


def _group(host: str, port: int, rank: int, world_size: int, device: torch.device):
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)


class BroadcastSender:
    """Learner rank 0: snapshots weights per version and broadcasts the newest to every actor."""

    def __init__(self, host: str, port: int, actors: int, device: torch.device | str = "cpu"):
        self.device, self.address = torch.device(device), f"{host}:{port}"
        self._rendezvous = (host, port, 1 + actors)  # the group is made by the sender thread: the
        self._group = None  # learner never blocks waiting for actors to join
        self._cv = threading.Condition()
        self._pending: tuple[int, list[torch.Tensor]] | None = None
        self._closed = False
        self.rounds = 0
        self.published = self.sent = 0  # newest version snapshotted / broadcast
        self._thread = threading.Thread(target=self._send_loop, name="weights-broadcast", daemon=True)
        self._thread.start()

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]]) -> Announcement:
        """Snapshot `named` tensors as `version` (format ``full``); return its announcement."""
        layout = Layout.of(named)
        with torch.no_grad():
            buffers = [torch.cat([t.detach().reshape(-1) for _, t in named
                                  if str(t.dtype).removeprefix("torch.") == dt]).to(self.device)
                       for dt, _ in layout.sizes()]
        ann = announcement(version, "full", checksum(buffers), f"nccl://{self.address}", time.time(),
                           sum(b.numel() * b.element_size() for b in buffers), layout.entries)
        with self._cv:
            self._pending = (version, buffers)
            self.published = version
            self._cv.notify_all()
        return ann

    def flush(self, timeout_s: float) -> bool:
        """Wait until the newest snapshot has been broadcast (the actors joined its round); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.sent < self.published and not self._closed:
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    return self.sent >= self.published
        return True

    def _send_loop(self) -> None:
        host, port, world_size = self._rendezvous
        self._group = _group(host, port, 0, world_size, self.device)
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                version, buffers = self._pending
                self._pending = None
            header = torch.tensor([version], dtype=torch.int64, device=self.device)
            works = [self._group.broadcast(header, 0)]  # runs when every actor has joined the round
            works += [self._group.broadcast(b, 0) for b in buffers]
            # Poll for the round's end instead of wait()/synchronize: NCCL's wait() only orders streams
            # (rounds nobody joined would queue up), and a blocking device sync here, behind a round
            # that the actors join only once this process goes on (its final checkpoint, its STOP),
            # stalled the learner on a GPU. Polling holds neither the GIL nor the device.
            while not all(w.is_completed() for w in works):
                if self._closed:
                    return
                time.sleep(0.002)
            with self._cv:
                self.rounds += 1
                self.sent = version
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the sender; a round no actor joined is aborted, so the process can exit."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            unjoined = self.sent < self.published
            self._cv.notify_all()
        if unjoined and self._group is not None and hasattr(self._group, "abort"):
            self._group.abort()


def default_device() -> torch.device:
    """The current CUDA device when there is one (the learner's model is there), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class BroadcastPublisher(Publisher):
    """Learner rank 0 of the ``nccl`` transport: announces each version and broadcasts its full weights.

    The group of 1 + `actors` ranks meets at `host`:`port`; snapshots live on `device` (None:
    :func:`default_device`). `pub_address`/`latest_address` are the announcer's (:class:`WeightPublisher`).
    """

    def __init__(self, host: str, port: int, actors: int, device: torch.device | str | None = None,
                 pub_address: str = "tcp://127.0.0.1:0", latest_address: str = "tcp://127.0.0.1:0"):
        super().__init__(pub_address, latest_address)
        self.sender = BroadcastSender(host, port, actors, default_device() if device is None else device)

    def publish(self, version: int, model) -> Announcement:
        """Snapshot `model`'s parameters (format ``full``) as `version`, announce it; the broadcast follows."""
        ann = self.sender.publish(version, list(model.named_parameters()))
        self.announce(ann)
        return ann

    def flush(self, timeout_s: float) -> bool:
        """Wait until every actor joined the newest version's round; on timeout abort it (so the process
        can exit) and return False."""
        if self.sender.flush(timeout_s):
            return True
        self.sender.close()
        return False

    def close(self) -> None:
        self.sender.close()
        super().close()


class BroadcastReceiver(Loader):
    """Actor side: `load(ann, engine)` joins one round and loads the tensors it receives into `engine`.

    `address` is ``[nccl://]host:port``, `rank` this actor's rank in the group (1 + actor id), `device`
    where tensors are received (the engine's); `announcement_of(version)` returns an announced version's
    :class:`Announcement` (the actor's :meth:`WeightSubscriber.announcement`), whose checksum a round of
    another version than the one the actor reacted to must match.
    """

    retains_versions = False  # a round carries the newest snapshot only

    def __init__(self, address: str, rank: int, actors: int, device: torch.device | str = "cpu",
                 announcement_of=None):
        host, port = address.removeprefix("nccl://").rsplit(":", 1)
        self.device = torch.device(device)
        self._group = _group(host, int(port), rank, 1 + actors, self.device)
        self.announcement_of = announcement_of
        self.bytes_fetched = 0

    def load(self, ann: Announcement, engine) -> Announcement:
        """Join one round, load its tensors with ``engine.load_tensors``; return the served announcement."""
        version, named = self.receive(ann, self.announcement_of)
        engine.load_tensors(version, named)
        return ann if version == ann.version else self.announcement_of(version)

    def receive(self, ann: Announcement, announcement_of) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Join one round; return its version and the named tensors on `device`.

        `ann` is the announcement that made the actor join (its manifest gives the layout); the round
        carries the newest snapshot the learner had when every actor had joined, which may be older or
        newer than `ann`. `announcement_of(version)` returns that version's announcement, whose
        checksum the received buffers must match. Raises WeightError on a mismatch.
        """
        layout = Layout(tuple(tuple(e) for e in ann.manifest))
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._group.broadcast(header, 0).wait()
        buffers = [torch.empty(n, dtype=getattr(torch, dt), device=self.device) for dt, n in layout.sizes()]
        for b in buffers:
            self._group.broadcast(b, 0).wait()
        version = int(header.item())
        self.bytes_fetched += sum(b.numel() * b.element_size() for b in buffers)
        expected = ann if version == ann.version else announcement_of(version)
        if checksum(buffers) != expected.digest:
            raise WeightError(f"checksum mismatch for broadcast version {version}")
        return version, list(layout.views(buffers))
