"""ZMQ weight transport: actors download a version's payload from the learner's own weight endpoint.

No shared filesystem is needed. The learner's :class:`~distrl.weights.base.WeightPublisher` answers,
on the same ROUTER socket as ``LATEST``:

- ``FETCH {version}`` -> ``MANIFEST {version, digest, files: [[name, size], ...]}``
- ``FETCH {version, file, offset, length}`` -> ``CHUNK {version, file, offset}`` + raw bytes

The actor side, :class:`ZmqFetcher`, keeps up to ``window`` chunk requests in flight (credit-based
flow control, as in the ZeroMQ guide's file-transfer pattern), writes the files into its own cache
directory, checks the directory digest against the announcement, and only then renames it into
place. Versions the learner has pruned answer ERROR.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq

from distrl.core import wire
from distrl.core.security import connect_run_keys
from distrl.core.tcp import allow_ipv6
from distrl.weights.base import CHUNK_BYTES, Announcement, DirectoryLoader, WeightError
from distrl.weights.fs import directory_digest, prune_versions

WINDOW = 8


class ZmqFetcher(DirectoryLoader):
    """Downloads announced payloads from `endpoint` (the publisher's LATEST address) into `cache_dir`."""

    def __init__(self, endpoint: str, cache_dir: str | Path, timeout_s: float = 60.0, keep: int = 2,
                 chunk_bytes: int = CHUNK_BYTES, window: int = WINDOW):
        self.endpoint, self.cache_dir = endpoint, Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.timeout_ms, self.keep = int(timeout_s * 1000), keep
        self.chunk_bytes, self.window = chunk_bytes, window
        self.bytes_fetched = 0

    def fetch(self, ann: Announcement) -> Path:
        """Download, verify and return the local payload directory of `ann`. Raises WeightError."""
        final = self.cache_dir / f"v{ann.version:06d}"
        if final.is_dir() and directory_digest(final) == ann.digest:
            return final
        tmp = self.cache_dir / f".v{ann.version:06d}.part"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        connect_run_keys(sock, "weights")  # a CURVE client of the publisher when the process has run keys
        try:
            allow_ipv6(sock, self.endpoint).connect(self.endpoint)
            manifest = self._request(sock, version=ann.version)
            if manifest["digest"] != ann.digest:
                raise WeightError(f"version {ann.version}: endpoint serves digest {manifest['digest'][:12]}, "
                                  f"announced {ann.digest[:12]}")
            self._download(sock, ann.version, manifest["files"], tmp)
        finally:
            sock.close()
        digest = directory_digest(tmp)
        if digest != ann.digest:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WeightError(f"digest mismatch for version {ann.version} fetched from {self.endpoint}")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        prune_versions(self.cache_dir, ann.version, self.keep)
        return final

    def _request(self, sock: zmq.Socket, **fields) -> dict:
        sock.send_multipart(wire.encode_raw(wire.MsgType.FETCH, "actor", 0, **fields))
        header, _ = self._recv(sock)
        return header.fields

    def _recv(self, sock: zmq.Socket) -> tuple[wire.Header, bytes | None]:
        if not sock.poll(self.timeout_ms):
            raise WeightError(f"weight endpoint {self.endpoint} did not answer in {self.timeout_ms / 1000:.0f}s")
        header, body = wire.decode_raw(sock.recv_multipart())
        if header.type == wire.MsgType.ERROR:
            raise WeightError(f"weight endpoint {self.endpoint}: {header.fields.get('error')}")
        return header, body

    def _download(self, sock: zmq.Socket, version: int, files: list, dest: Path) -> None:
        """Fetch every file's chunks, keeping up to `window` requests in flight."""
        requests = [(name, off, min(self.chunk_bytes, size - off)) for name, size in files
                    for off in range(0, size, self.chunk_bytes)]
        handles = {}
        for name, size in files:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            handles[name] = open(dest / name, "wb")
            handles[name].truncate(size)
        try:
            sent = received = 0
            while received < len(requests):
                while sent < len(requests) and sent - received < self.window:
                    name, off, length = requests[sent]
                    sock.send_multipart(wire.encode_raw(wire.MsgType.FETCH, "actor", sent, version=version,
                                                        file=name, offset=off, length=length))
                    sent += 1
                header, body = self._recv(sock)
                f = handles[header.fields["file"]]
                f.seek(header.fields["offset"])
                f.write(body or b"")
                self.bytes_fetched += len(body or b"")
                received += 1
        finally:
            for f in handles.values():
                f.close()

