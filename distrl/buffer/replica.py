"""The replica of the buffer's log: a second copy, on another node, of ``segments/`` and ``consumed.jsonl``.

A group is acknowledged only once its segment record is in the buffer's own log *and* the replica's,
so losing the buffer's node (its disk with it) loses no acknowledged group, no consumption
record and no actor's place in its prompt stream (which the segment log's groups per actor give).

The replica is a byte mirror of the buffer's log files: :class:`ReplicaServer` (a ZeroMQ ROUTER, a thread of
`distrl train`'s driver writing into the driver's run directory, or ``python -m distrl.buffer.replica`` on a
standby host) writes each record at the offset the buffer wrote it, so its directory has the layout of the
buffer's (``segments/segment-NNNNN.arrow``, ``consumed.jsonl``, ``consumed.rolled_back.jsonl``): a buffer,
`distrl replay` or ``lineage`` read it as they read the buffer's. :class:`Mirror` is the buffer's side, and
:mod:`distrl.buffer.mirrored` the logs that use it.

Wire (no pickle): a request is ``[header JSON, body frames...]`` with ``op`` one of ``write`` (``path``,
``offset``, ``sync``: the body frames written there, the file cut after them, fdatasync'ed before the reply
when ``sync``), ``sync`` (fdatasync every file written since the last), ``sizes`` (every file's size),
``read`` (``path``, ``offset``, ``length``: the bytes, as a second frame) and ``delete`` (``path``: a segment
that retention deleted). The reply is one JSON frame, ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``;
a path outside the log's names is refused. The server binds with the run's CURVE keys when it has them
(:mod:`distrl.core.security`, the buffer's pair) and holds its directory's lock (:mod:`distrl.buffer.lock`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path

import zmq

from distrl.buffer.endpoint import bindable
from distrl.buffer.lock import RunDirLock
from distrl.core.errors import BindError
from distrl.core.security import connect_run_keys, serve_run_keys
from distrl.core.tcp import allow_ipv6

log = logging.getLogger(__name__)

LOG_PATHS = re.compile(r"segments/segment-\d{5}\.arrow|consumed\.jsonl|consumed\.rolled_back\.jsonl")
REPLY_TIMEOUT_S = 60.0  # a replica silent this long ends the buffer: nothing is acknowledged without it
_sync = getattr(os, "fdatasync", os.fsync)
_FADVISE = hasattr(os, "posix_fadvise")
RELEASE_BYTES = 1 << 20  # the files' pages are released (written back, then dropped) each time this much was written


class ReplicaServer:
    """Serve a replica of a buffer's log into ``directory`` from a thread (:meth:`start`, :meth:`close`).

    Args:
        directory: where the log's files are written (a run directory's layout).
        address: where to bind (``tcp://host:0`` picks a free port); :attr:`address` is the bound one.
        role: who holds ``directory``'s lock, as a refused buffer on it names it.
    Raises RunDirLocked when a buffer or another replica holds ``directory``, BindError when the address
    cannot be bound.
    """

    def __init__(self, directory: str | os.PathLike, address: str, role: str = "a replica of a buffer's log"):
        self.dir = Path(directory)
        self.lock = RunDirLock(self.dir, role)
        self._fds: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._curve = serve_run_keys(self._ctx, "buffer")
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        allow_ipv6(self._sock, address)
        if self._curve is not None:
            self._curve.apply(self._sock)
        try:
            self._sock.bind(bindable(address))
        except zmq.ZMQError as exc:
            self.close()
            raise BindError(f"replica cannot bind {address}: {exc} (pick another port, or 0)") from None
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.error: BaseException | None = None  # what ended the serving thread, if anything did
        self.records = 0  # write requests served
        self._unreleased = 0  # bytes written since the page cache was last released

    def start(self) -> "ReplicaServer":
        self._thread = threading.Thread(target=self._serve, name="buffer-replica", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(100):
                    continue
                frames = self._sock.recv_multipart(copy=False)
                envelope, header, body = frames[0], frames[1], frames[2:]
                try:
                    reply, data = self.handle(json.loads(header.bytes), [f.buffer for f in body])
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    reply, data = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
                    log.warning("replica: refused a request: %s", reply["error"])
                self._sock.send_multipart([envelope, json.dumps(reply).encode(), *([data] if data else [])])
        except BaseException as exc:  # noqa: BLE001 - kept for close(); the buffer times out and says so
            self.error = exc
            log.error("replica stopped serving: %s", exc)

    def handle(self, header: dict, body: list) -> tuple[dict, bytes | None]:
        """One request (see the module docstring): ``(reply, data frame or None)``. Raises ValueError for a
        path outside the log, OSError for a disk error."""
        op = header["op"]
        if op == "sizes":
            files = [p for p in self.dir.rglob("*") if p.is_file()]
            sizes = {str(p.relative_to(self.dir)): p.stat().st_size for p in files}
            return {"ok": True, "sizes": {k: v for k, v in sizes.items() if LOG_PATHS.fullmatch(k)}}, None
        if op == "sync":
            for rel in self._dirty:
                _sync(self._fds[rel])
            self._dirty.clear()
            return {"ok": True}, None
        rel = header["path"]
        if not LOG_PATHS.fullmatch(rel):
            raise ValueError(f"{rel!r} is not a file of a buffer's log")
        if op == "write":
            return {"ok": True, "size": self._write(rel, int(header["offset"]), body, bool(header["sync"]))}, None
        if op == "read":
            with open(self.dir / rel, "rb") as f:
                return {"ok": True}, os.pread(f.fileno(), int(header["length"]), int(header["offset"]))
        if op == "delete":
            if rel in self._fds:
                os.close(self._fds.pop(rel))
                self._dirty.discard(rel)
            (self.dir / rel).unlink(missing_ok=True)
            return {"ok": True}, None
        raise ValueError(f"unknown op {op!r}")

    def _write(self, rel: str, offset: int, body: list, sync: bool) -> int:
        """Write ``body`` at ``offset`` of ``rel``, cut the file there, fdatasync under ``sync``; its new size."""
        if rel not in self._fds:
            (self.dir / rel).parent.mkdir(parents=True, exist_ok=True)
            self._fds[rel] = os.open(self.dir / rel, os.O_WRONLY | os.O_CREAT, 0o644)
        fd = self._fds[rel]
        size = os.fstat(fd).st_size
        if offset > size:
            raise ValueError(f"{rel}: a write at {offset} would leave a gap after its {size} bytes")
        end = offset
        for view in body:
            view = memoryview(view).cast("B")
            while view:
                written = os.pwrite(fd, view, end)
                end, view = end + written, view[written:]
        if end < size:
            os.ftruncate(fd, end)  # a rewritten file (consumed.jsonl after a roll-back) ends here
        self.records += 1
        if sync:
            _sync(fd)
        else:
            self._dirty.add(rel)
        self._unreleased += end - offset
        if _FADVISE and self._unreleased >= RELEASE_BYTES:  # as the buffer's own log (segments._SyncedFile)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self._unreleased = 0
        return end

    def close(self) -> None:
        """Stop serving, fdatasync and close the files, release the lock (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sock.close(linger=0)
        if self._curve is not None:
            self._curve.stop()
        self._ctx.term()
        for rel, fd in self._fds.items():
            if rel in self._dirty:
                _sync(fd)
            os.close(fd)
        self._fds, self._dirty = {}, set()
        self.lock.release()


class Mirror:
    """The buffer's side of a replica: a DEALER socket to ``address`` (one thread uses one Mirror).

    :meth:`write` sends without waiting (the replica writes while the buffer writes its own copy); :meth:`wait`
    returns once the replica answered every request sent. Errors and silence beyond ``timeout_s`` raise OSError:
    the buffer then ends rather than acknowledge what the replica may not hold.
    """

    def __init__(self, address: str, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        connect_run_keys(self._sock, "buffer")
        allow_ipv6(self._sock, address).connect(address)
        self._pending = 0
        self.bytes_sent = 0

    def write(self, rel: str, offset: int, views: list, sync: bool = False) -> None:
        """Send the bytes ``views`` to be written at ``offset`` of ``rel`` (the file cut after them)."""
        header = json.dumps({"op": "write", "path": rel, "offset": offset, "sync": sync}).encode()
        self._sock.send_multipart([header, *views], copy=False)
        self._pending += 1
        self.bytes_sent += sum(len(v) for v in views)

    def send(self, op: str, **fields) -> None:
        """Send a request of ``op`` (``sync``, ``sizes``, ``read``, ``delete``) without waiting."""
        self._sock.send(json.dumps({"op": op, **fields}).encode())
        self._pending += 1

    def wait(self) -> tuple[dict, bytes | None]:
        """Wait for every request sent; returns the last reply and its data frame. Raises OSError."""
        reply, data = {"ok": True}, None
        while self._pending:
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise OSError(f"the replica at {self.address} did not answer within {self.timeout_s:.0f} s")
            frames = self._sock.recv_multipart()
            self._pending -= 1
            reply, data = json.loads(frames[0]), (frames[1] if len(frames) > 1 else None)
            if not reply.get("ok"):
                raise OSError(f"the replica at {self.address} refused a write: {reply.get('error')}")
        return reply, data

    def request(self, op: str, **fields) -> tuple[dict, bytes | None]:
        """:meth:`send` then :meth:`wait`."""
        self.send(op, **fields)
        return self.wait()

    def close(self) -> None:
        self._sock.close(linger=0)


def main(argv: list[str] | None = None) -> None:
    """``python -m distrl.buffer.replica DIR [--address tcp://127.0.0.1:0]``: a standby replica for `distrl buffer
    --replica ADDRESS` (plain TCP: give it a loopback or trusted address). Serves until SIGTERM or SIGINT."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m distrl.buffer.replica", description=main.__doc__)
    parser.add_argument("directory", help="where the replica of the buffer's log is written")
    parser.add_argument("--address", default="tcp://127.0.0.1:0", help="where to bind (port 0: a free one)")
    parser.add_argument("--prefault_bytes", type=int, default=256 * 2**20,
                        help="heap written once at start so received messages reuse memory (distrl.buffer.memory)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from distrl.buffer.memory import prefault_heap, single_arena

    single_arena()  # before ZeroMQ's I/O thread: its messages come from the one prefaulted heap
    prefault_heap(args.prefault_bytes)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ReplicaServer(args.directory, args.address).start()
    print(f"replica: serving at {server.address} (directory {server.dir})", flush=True)
    while not stop.wait(1.0):
        pass
    server.close()


if __name__ == "__main__":
    main()
