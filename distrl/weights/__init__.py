"""Weights by policy version: the announcement protocol (:mod:`.base`) and its transports (fs, zmq, nccl, shm).

One interface whatever the transport: learner rank 0 holds a :class:`~distrl.weights.base.Publisher`
(``publish(version, model)``, ``flush``, ``linger``, ``close``), an actor a
:class:`~distrl.weights.base.Loader` (``load(announcement, engine)``). :data:`TRANSPORTS` maps each
``--weights_transport`` to its :class:`Transport`, which says what the transport needs (the config checks
ask it instead of comparing names) and builds its two ends::

    publisher = transport(cfg.weights_transport).publisher(PublishOptions(run_dir / "weights", ...))
    loader = transport(cfg.weights_transport).loader(LoadOptions(endpoint, cache_dir, ...), subscriber)

Importing this package is light (no zmq, Arrow or torch: config checks use it before a role starts);
the other names below load their module on first use, and only the ``nccl`` and ``shm`` backends import torch.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from distrl.weights.base import Loader, Publisher, WeightSubscriber


@dataclass(frozen=True)
class PublishOptions:
    """Where learner rank 0 publishes. Addresses are ``tcp://host:port`` (port 0: a free one)."""

    weights_dir: str | Path  # fs, zmq: each version's payload goes to <weights_dir>/vNNNNNN
    keep: int = 4  # fs, zmq: versions retained on disk (a run keeps its staleness ceiling + 4)
    pub_address: str = "tcp://127.0.0.1:0"  # announcements (ZMQ PUB)
    latest_address: str = "tcp://127.0.0.1:0"  # the weight endpoint: LATEST and FETCH (ZMQ ROUTER)
    broadcast_host: str = "127.0.0.1"  # nccl: this host, where the broadcast group's TCPStore listens
    broadcast_port: int = 5558  # nccl: its port (--weights_broadcast_port)
    actors: int = 1  # nccl: actors in the group (--number_of_actors)
    device: str | None = None  # nccl: where snapshots live (None: the current CUDA device, else the CPU)


@dataclass(frozen=True)
class LoadOptions:
    """Where an actor gets weights from."""

    endpoint: str  # the learner's weight endpoint (LATEST/FETCH), tcp://host:port; nccl meets on its host
    cache_dir: str | Path  # zmq: this actor's download cache
    rank: int = 1  # nccl: this actor's rank in the broadcast group (1 + actor id)
    actors: int = 1  # nccl: actors in the group (--number_of_actors)
    broadcast_port: int = 5558  # nccl: the group's port (--weights_broadcast_port)
    device: str | None = None  # nccl: where tensors are received (the engine's device; None: the CPU)


class Transport(ABC):
    """One ``--weights_transport``: what it needs (class attributes) and its two ends."""

    name: ClassVar[str]
    needs_shared_filesystem: ClassVar[bool] = False  # actors read the learner's weight directory
    full_weights_only: ClassVar[bool] = False  # carries full weights only (needs --finetune full)
    needs_actors: ClassVar[bool] = False  # a collective of the learner and a fixed set of >= 1 actors
    needs_broadcast_port: ClassVar[bool] = False  # its group meets on --weights_broadcast_port
    same_host_only: ClassVar[bool] = False  # every actor must run on the learner's host

    @classmethod
    def publisher(cls, options: PublishOptions) -> Publisher:
        """Learner rank 0's end: the payload is written into a directory (fs, zmq)."""
        from distrl.weights.fs import DirectoryPublisher

        return DirectoryPublisher(options.weights_dir, options.keep, options.pub_address, options.latest_address)

    @classmethod
    @abstractmethod
    def loader(cls, options: LoadOptions, subscriber: WeightSubscriber) -> Loader:
        """An actor's end; `subscriber` is the actor's (announcements of versions it may be handed)."""


class FsTransport(Transport):
    """``fs``: actors read each version where the learner wrote it (a shared filesystem)."""

    name = "fs"
    needs_shared_filesystem = True

    @classmethod
    def loader(cls, options: LoadOptions, subscriber: WeightSubscriber) -> Loader:
        from distrl.weights.fs import FsFetcher

        return FsFetcher()


class ZmqTransport(Transport):
    """``zmq``: actors download each version from the learner's weight endpoint into their cache."""

    name = "zmq"

    @classmethod
    def loader(cls, options: LoadOptions, subscriber: WeightSubscriber) -> Loader:
        from distrl.weights.zmq import ZmqFetcher

        return ZmqFetcher(options.endpoint, options.cache_dir)


class NcclTransport(Transport):
    """``nccl``: learner rank 0 broadcasts full weights to every actor's device (gloo on CPU)."""

    name = "nccl"
    full_weights_only = needs_actors = needs_broadcast_port = True

    @classmethod
    def publisher(cls, options: PublishOptions) -> Publisher:
        from distrl.weights.nccl import BroadcastPublisher

        return BroadcastPublisher(options.broadcast_host, options.broadcast_port, options.actors, options.device,
                                  options.pub_address, options.latest_address)

    @classmethod
    def loader(cls, options: LoadOptions, subscriber: WeightSubscriber) -> Loader:
        from distrl.weights.base import endpoint_host
        from distrl.weights.nccl import BroadcastReceiver

        address = f"{endpoint_host(options.endpoint)}:{options.broadcast_port}"
        return BroadcastReceiver(address, options.rank, options.actors, options.device or "cpu",
                                 subscriber.announcement)


class ShmTransport(Transport):
    """``shm``: full weights through host shared memory (/dev/shm), for actors on the learner's host."""

    name = "shm"
    full_weights_only = same_host_only = True
    directory: ClassVar[str] = "/dev/shm"  # where the slots live (distrl.weights.shm.SHM_DIR)

    @classmethod
    def has_room(cls, weight_file_bytes: int) -> bool:
        """Whether this host's /dev/shm can hold the two slots of a model whose weight files take
        `weight_file_bytes` (counted twice over: parameters may be fp32 where the files are bf16)."""
        try:
            st = os.statvfs(cls.directory)
        except OSError:
            return False
        return 0 < 4 * weight_file_bytes <= st.f_bavail * st.f_frsize

    @classmethod
    def publisher(cls, options: PublishOptions) -> Publisher:
        from distrl.weights.shm import SharedMemoryPublisher

        return SharedMemoryPublisher(run=str(Path(options.weights_dir).resolve()), pub_address=options.pub_address,
                                     latest_address=options.latest_address)

    @classmethod
    def loader(cls, options: LoadOptions, subscriber: WeightSubscriber) -> Loader:
        from distrl.weights.shm import SharedMemoryLoader

        return SharedMemoryLoader(options.device or "cpu")


TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (FsTransport, ZmqTransport, NcclTransport, ShmTransport)}


DEFAULT = "fs"  # an unset --weights_transport


def transport(name: str | None) -> type[Transport]:
    """The transport called `name` (``--weights_transport``; None: :data:`DEFAULT`). Raises ValueError for
    an unknown name."""
    name = DEFAULT if name is None else name
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weights transport {name!r}; expected one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


_LAZY = {  # name -> the module that defines it, imported on first use (PEP 562)
    **dict.fromkeys(["BASE", "Announcement", "announcement", "WeightError", "WeightPublisher", "WeightSubscriber",
                     "Publisher", "Loader", "DirectoryLoader"], "base"),
    **dict.fromkeys(["PayloadDirectory", "DirectoryPublisher", "FsFetcher", "directory_digest", "fetch"], "fs"),
    "ZmqFetcher": "zmq",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'distrl.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distrl.weights.{_LAZY[name]}"), name)


__all__ = ["DEFAULT", "TRANSPORTS", "LoadOptions", "PublishOptions", "Transport", "transport", *_LAZY]
