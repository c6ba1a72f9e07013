"""Same-host weight transport: full weights through host shared memory, no file format and no socket.

For full fine-tuning with the actors on the learner's host (one GPU shared by both, or several GPUs of one
machine), where ``fs`` spends most of a version writing and reading a ``save_pretrained`` directory for
what is a memory copy.

    learner: SharedMemoryPublisher.publish(version, model) copies the parameters into one of two *slots*,
             files under /dev/shm mapped by both processes (the one not holding the newest version), computes
             the checksum on the parameters' device, stamps the slot with the version and announces
             (format "full", location ``shm://<slot path>``, the layout as manifest).
    actor:   SharedMemoryLoader.load(announcement, engine) maps the slot, copies it into its own flat
             buffers on the engine's device, checks that the slot still holds that version and that the
             checksum matches, and loads the tensors into the engine (``engine.load_tensors``).

A slot file is a 64-byte header (int64 words: :data:`MAGIC`, the version it holds, -1 while being written)
followed by one flat buffer per dtype (:class:`~distrl.weights.flat.Layout`), each at a 64-byte aligned
offset. The learner never writes the slot of the newest version, so an actor loading the newest one is
never overwritten; an actor that is a whole version late may be, which the version stamp (read before and
after its copy) and the checksum detect: it then takes the newer version (:class:`WeightError`). On a GPU
both processes pin their mapping of the slots (``cudaHostRegister``), so each copy runs at host-link speed.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import torch
import xxhash

from distrl.weights.base import Announcement, Loader, Publisher, WeightError, announcement, payload_format
from distrl.weights.flat import Layout, checksum

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # distrl.weights.ShmTransport.directory (checked for room there, without torch)
SLOTS = 2
MAGIC = 0x64697374726C5731  # "distrlW1"
HEADER = 64
ALIGN = 64


def offsets(layout: Layout) -> list[int]:
    """Byte offset of each flat buffer in a slot file (after the header, 64-byte aligned)."""
    out, at = [], HEADER
    for dt, n in layout.sizes():
        out.append(at)
        at += -(-n * getattr(torch, dt).itemsize // ALIGN) * ALIGN
    return out + [at]


def slot_buffers(slot: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The flat buffers of `layout` as typed views into `slot` (a uint8 tensor over a slot file)."""
    at = offsets(layout)
    return [slot[at[i]:at[i] + n * getattr(torch, dt).itemsize].view(getattr(torch, dt))
            for i, (dt, n) in enumerate(layout.sizes())]


def _header(slot: torch.Tensor) -> torch.Tensor:
    return slot[:HEADER].view(torch.int64)


def stamped_version(slot: torch.Tensor) -> int:
    """The version a slot holds (-1 while being written, or a file that is not a slot)."""
    header = _header(slot)
    return int(header[1]) if int(header[0]) == MAGIC else -1


def _pin(slot: torch.Tensor) -> bool:
    """Page-lock this process's mapping of `slot` for fast device copies; False where that is not possible
    (no CUDA, or the driver refused: copies then go through pageable memory, slower but the same)."""
    if not torch.cuda.is_available():
        return False
    try:
        ok = int(torch.cuda.cudart().cudaHostRegister(slot.data_ptr(), slot.numel(), 0)) == 0
    except (AttributeError, RuntimeError, TypeError):
        return False
    if not ok:
        log.warning("could not pin the shared-memory weight slot (%d MiB): copies use pageable memory",
                    slot.numel() >> 20)
    return ok


def map_slot(path: str | Path, nbytes: int, create: bool = False) -> torch.Tensor:
    """Map the slot file at `path` (`nbytes` long) as a shared uint8 tensor; `create` makes and sizes it.

    Raises WeightError for a missing or short file (an actor on another host than the learner), and for a
    shared-memory filesystem without room for it (sizing reserves the space, so a full /dev/shm fails here
    rather than as a bus error later).
    """
    path = str(path)
    if create:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise WeightError(f"--weights_transport shm: no room for {SLOTS} x {nbytes / 2**20:.0f} MiB of weights "
                              f"in {Path(path).parent} ({exc.strerror}): enlarge it (docker run --shm-size) or use "
                              "--weights_transport fs") from None
        os.close(fd)
    elif not os.path.isfile(path) or os.path.getsize(path) < nbytes:
        raise WeightError(f"no shared-memory weight slot {path} of {nbytes} bytes on this host: --weights_transport "
                          "shm needs every actor on the learner's host (use zmq or nccl across hosts)")
    slot = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    _pin(slot)
    return slot


class SharedMemoryPublisher(Publisher):
    """Learner rank 0 of the ``shm`` transport: full weights into two slot files under `directory`.

    The slots are made at the first publish (their size is the model's) and removed by :meth:`close`; their
    names start with a hash of `run` (the run's weight directory), so a restarted learner of the run removes
    the slots its crashed predecessor left;
    `pub_address`/`latest_address` are the announcer's (:class:`~distrl.weights.base.WeightPublisher`).
    """

    def __init__(self, directory: str | Path = SHM_DIR, run: str = "", pub_address: str = "tcp://127.0.0.1:0",
                 latest_address: str = "tcp://127.0.0.1:0"):
        super().__init__(pub_address, latest_address)
        self.run_prefix = f"distrl-weights-{xxhash.xxh64_hexdigest(run.encode()) if run else uuid.uuid4().hex[:16]}"
        self.directory = Path(directory)
        self.prefix = self.directory / f"{self.run_prefix}-{uuid.uuid4().hex[:8]}"
        self.layout: Layout | None = None
        self.slots: list[tuple[Path, torch.Tensor]] = []
        self.newest = -1  # index of the slot holding the newest version

    def publish(self, version: int, model) -> Announcement:
        """Copy `model`'s parameters (format ``full``) into the free slot as `version` and announce it.

        Raises ValueError for a PEFT model (adapters go through fs or zmq) or a version not newer than the
        last; WeightError when /dev/shm has no room for the slots."""
        if payload_format(model) != "full":
            raise ValueError("--weights_transport shm carries full weights: use fs or zmq for LoRA adapters")
        named = [(name, p.detach()) for name, p in model.named_parameters()]
        layout = Layout.of(named)
        if layout != self.layout:
            self._make_slots(layout)
        index = (self.newest + 1) % SLOTS
        path, slot = self.slots[index]
        header = _header(slot)
        header[1] = -1  # being written: a late reader of this slot's older version sees it and refuses
        with torch.no_grad():
            for (_, view), (_, t) in zip(layout.views(slot_buffers(slot, layout)), named):
                view.copy_(t, non_blocking=True)  # device -> pinned host: asynchronous on the current stream
            digest = checksum([t for _, t in named])  # on the parameters' device; synchronizes it
        header[1] = version
        self.newest = index
        ann = announcement(version, "full", digest, f"shm://{path}", time.time(), layout.nbytes(), layout.entries)
        self.announce(ann)
        return ann

    def _make_slots(self, layout: Layout) -> None:
        self._remove_slots()
        for stale in self.directory.glob(f"{self.run_prefix}-*"):  # a crashed learner's of this run
            stale.unlink(missing_ok=True)
        size = offsets(layout)[-1]
        for i in range(SLOTS):
            path = Path(f"{self.prefix}-{i}")
            slot = map_slot(path, size, create=True)
            _header(slot)[0], _header(slot)[1] = MAGIC, -1
            self.slots.append((path, slot))
        self.layout, self.newest = layout, -1

    def _remove_slots(self) -> None:
        for path, _ in self.slots:
            path.unlink(missing_ok=True)
        self.slots = []

    def close(self) -> None:
        self._remove_slots()
        super().close()


class SharedMemoryLoader(Loader):
    """Actor side of the ``shm`` transport: `load(ann, engine)` copies the announced slot to `device`
    (the engine's), verifies it and loads it with ``engine.load_tensors``."""

    retains_versions = False  # the slots hold the newest two versions only

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.bytes_fetched = 0
        self._slots: dict[str, torch.Tensor] = {}  # mapped slot files by path
        self._buffers: tuple[Layout, list[torch.Tensor]] | None = None  # this actor's copy, reused

    def load(self, ann: Announcement, engine) -> Announcement:
        """Load `ann`'s weights into `engine`; return `ann`. Raises WeightError (the engine still serves
        what it served) for a slot that is missing, or was rewritten with a newer version meanwhile."""
        version, named = self.receive(ann)
        engine.load_tensors(version, named)
        return ann

    def receive(self, ann: Announcement) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """`ann`'s (version, named tensors on `device`), verified against its checksum. Raises WeightError."""
        layout = Layout(tuple(tuple(e) for e in ann.manifest))
        slot = self._slot(ann.location.removeprefix("shm://"), offsets(layout)[-1])
        if stamped_version(slot) != ann.version:
            raise WeightError(f"version {ann.version} is no longer in shared memory (slot holds "
                              f"{stamped_version(slot)}): a newer one replaced it")
        buffers = self._own_buffers(layout)
        for own, shared in zip(buffers, slot_buffers(slot, layout)):
            own.copy_(shared, non_blocking=True)
        digest = checksum(buffers)  # synchronizes the copies
        if stamped_version(slot) != ann.version or digest != ann.digest:
            raise WeightError(f"version {ann.version} was overwritten while loading (slot holds "
                              f"{stamped_version(slot)}, checksum {digest} against {ann.digest})")
        self.bytes_fetched += ann.nbytes
        return ann.version, list(layout.views(buffers))

    def _slot(self, path: str, nbytes: int) -> torch.Tensor:
        if path not in self._slots or self._slots[path].numel() != nbytes:
            if len(self._slots) >= 2 * SLOTS:  # a restarted learner made new slots: forget the old ones
                self._slots.clear()
            self._slots[path] = map_slot(path, nbytes)
        return self._slots[path]

    def _own_buffers(self, layout: Layout) -> list[torch.Tensor]:
        if self._buffers is None or self._buffers[0] != layout:
            self._buffers = (layout, [torch.empty(n, dtype=getattr(torch, dt), device=self.device)
                                      for dt, n in layout.sizes()])
        return self._buffers[1]

    def close(self) -> None:
        self._slots.clear()
        self._buffers = None
