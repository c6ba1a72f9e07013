"""Shared-directory weight transport: atomic publish (write, then rename) and digest-checked fetch.

Layout: ``<run_dir>/weights/v000001/`` holds one version's payload (a PEFT adapter directory for the
``lora`` format). The digest is the SHA-256 over the payload's files (relative path and bytes, in
sorted order), so a subscriber detects a corrupted or half-copied payload and refuses it.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Callable

from distrl.weights.base import Announcement, WeightError


def directory_digest(path: str | Path) -> str:
    """SHA-256 (hex) over every file under `path`: relative name, then contents, in sorted order."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


class DirectoryTransport:
    """Publishes each version into `root/vNNNNNN` and keeps the newest `keep` versions on disk."""

    def __init__(self, root: str | Path, keep: int = 4):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def publish(self, version: int, fmt: str, write: Callable[[Path], None]) -> Announcement:
        """Call `write(tmp_dir)` to fill the payload, rename it into place, return its announcement."""
        final = self.root / f"v{version:06d}"
        tmp = self.root / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        digest = directory_digest(tmp)
        tmp.rename(final)
        self._prune()
        return Announcement(version=version, format=fmt, digest=digest, location=str(final))

    def _prune(self) -> None:
        versions = sorted(self.root.glob("v[0-9]*"))
        for old in versions[: max(0, len(versions) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)


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
