"""Shared-directory weight transport: atomic publish (write, then rename) and digest-checked fetch.

Layout: ``<run_dir>/weights/v000001/`` holds one version's payload (a PEFT adapter directory for the
``lora`` format). The digest is an XXH3-128 checksum over the payload's files (relative path and bytes, in
sorted order), so a subscriber detects a corrupted or half-copied payload and refuses it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

import xxhash

from distrl.weights.base import Announcement, DirectoryLoader, Publisher, WeightError, announcement, payload_format

CHUNK = 16 * 2**20


def directory_digest(path: str | Path) -> str:
    """``xxh3_128:<hex>`` over every file under `path`: relative name, then contents, in sorted order.

    XXH3-128 detects a corrupted or half-copied payload as surely as a cryptographic hash does and
    runs at memory speed (a 1 GB full-weight payload costs tens of milliseconds, not seconds);
    authenticity of the sender is the job of the transport (CURVE), not of this digest.
    """
    root = Path(path)
    h = xxhash.xxh3_128()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    return f"xxh3_128:{h.hexdigest()}"


def prune_versions(root: Path, newest: int, keep: int) -> None:
    """Keep the payloads of versions (newest - keep, newest] under `root`; delete every other vNNNNNN."""
    for path in root.glob("v[0-9]*"):
        version = int(path.name[1:])
        if not newest - keep < version <= newest:
            shutil.rmtree(path, ignore_errors=True)


class PayloadDirectory:
    """The directory of weight payloads by version: writes each into `root/vNNNNNN` (atomically: a temporary
    directory renamed) and keeps the newest `keep` on disk. Not a transport: the ``fs`` and ``zmq`` transports
    announce and serve what it writes."""

    def __init__(self, root: str | Path, keep: int = 4):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._last = 0

    def publish(self, version: int, fmt: str, write: Callable[[Path], None]) -> Announcement:
        """Call `write(tmp_dir)` to fill the payload, rename it into place, return its announcement."""
        final = self.root / f"v{version:06d}"
        tmp = self.root / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        digest = directory_digest(tmp)
        nbytes = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        shutil.rmtree(final, ignore_errors=True)  # a stale payload of an earlier run with this version
        tmp.rename(final)
        self._last = version
        self._prune()
        return announcement(version=version, format=fmt, digest=digest, location=str(final),
                            published_at=time.time(), nbytes=nbytes)

    def _prune(self) -> None:
        prune_versions(self.root, self._last, self.keep)


class DirectoryPublisher(Publisher):
    """Learner rank 0 of the ``fs`` and ``zmq`` transports: each version's payload is written once into
    ``weights_dir/vNNNNNN`` (the newest `keep` are retained), then announced; the weight endpoint
    (`latest_address`) serves it to ``zmq`` actors (``FETCH``)."""

    def __init__(self, weights_dir: str | Path, keep: int = 4, pub_address: str = "tcp://127.0.0.1:0",
                 latest_address: str = "tcp://127.0.0.1:0"):
        super().__init__(pub_address, latest_address)
        self.directory = PayloadDirectory(weights_dir, keep)

    def publish(self, version: int, model) -> Announcement:
        """Write `model` with ``save_pretrained`` (a PEFT model: its adapter) as `version`, announce it."""
        ann = self.directory.publish(version, payload_format(model), lambda d: save_payload(model, d))
        self.announce(ann)
        return ann


def save_payload(model, directory: str | Path) -> None:
    """``model.save_pretrained(directory)`` with byte-stable JSON: PEFT writes ``adapter_config.json``'s
    ``target_modules`` (and ``exclude_modules``) set in the set's iteration order, which string hashing randomizes
    per process. The same weights published by two processes (a run and its ``--resume``) then had two digests,
    and the resumed learner's attestation quarantined the groups its actors had made with that version before the
    resume (distrl.weights.attest). The lists are written sorted."""
    model.save_pretrained(str(directory))
    path = Path(directory) / "adapter_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    sets = [k for k in ("target_modules", "exclude_modules") if isinstance(config.get(k), list)]
    if sets:
        config.update({k: sorted(config[k]) for k in sets})
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


class FsFetcher(DirectoryLoader):
    """Actor side of the shared-directory transport: the payload is read where it was published."""

    def fetch(self, ann: Announcement) -> Path:
        return fetch(ann)


def fetch(ann: Announcement) -> Path:
    """Return the local payload path of `ann` after checking its digest. Raises WeightError."""
    path = Path(ann.location)
    if not path.is_dir():
        raise WeightError(f"weights of version {ann.version} not found at {path}")
    digest = directory_digest(path)
    if digest != ann.digest:
        raise WeightError(f"digest mismatch for version {ann.version} at {path}: "
                          f"announced {ann.digest[:12]}, found {digest[:12]}")
    return path
