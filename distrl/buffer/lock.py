"""One buffer per run directory: an OS lock (``fcntl.flock``) on ``<run_dir>/buffer.lock``, held while a buffer
(or the replica of its log, :mod:`distrl.buffer.replica`) writes there.

Two buffers on one run directory would both hand out the same groups and interleave ``consumed.jsonl``.
The lock belongs to the open file, so the kernel releases it when the holding process ends,
however it ends (SIGKILL included): a lock file left behind by a crash never blocks a ``--resume``. The
holder writes ``{"pid", "host", "role", "started"}`` into the file, so a refused second buffer says who
holds it. ``flock`` is local to one host's kernel (and not reliable over NFS): a buffer on another node
that writes the same path on its own disk is another directory, and is not seen.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "buffer.lock"


class RunDirLocked(FileExistsError):
    """Another process holds the run directory's lock. ``holder``: what it wrote in the lock file ({} if
    nothing yet). ``str()`` is one line naming its pid and host. A FileExistsError (the directory is taken),
    so every launcher prints it as one line and exits 2 (``distrl.cmd.cli``)."""

    def __init__(self, run_dir: Path, holder: dict) -> None:
        self.run_dir, self.holder = run_dir, holder
        who = (f"{holder.get('role', 'a buffer')} (pid {holder.get('pid', '?')} on host {holder.get('host', '?')})"
               if holder else "another process (pid not written yet)")
        super().__init__(f"{run_dir} is held by {who}")


def holder(run_dir: str | os.PathLike) -> dict | None:
    """What the holder of ``run_dir``'s lock wrote ({} when it wrote nothing yet), or None when no process
    holds it (the lock is taken and released at once to find out). Creates nothing."""
    if not (Path(run_dir) / LOCK_FILE).is_file():
        return None
    try:
        lock = RunDirLock(run_dir, role="check", write=False)
    except RunDirLocked as exc:
        return exc.holder
    lock.release()
    return None


class RunDirLock:
    """Take ``<run_dir>/buffer.lock`` now (non-blocking) and hold it until :meth:`release` or the process ends.

    Args:
        run_dir: the run directory (created if missing).
        role: who holds it, written into the file with the pid, host and start time (``write`` True).
    Raises RunDirLocked when another process holds it.
    """

    def __init__(self, run_dir: str | os.PathLike, role: str = "distrl buffer", write: bool = True) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = _read(self._fd)
            os.close(self._fd)
            self._fd = None
            raise RunDirLocked(Path(run_dir), held) from None
        if write:
            info = {"pid": os.getpid(), "host": socket.gethostname(), "role": role, "started": time.time()}
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(info).encode(), 0)

    def release(self) -> None:
        """Release the lock (idempotent). The file stays: removing it would let a third process lock a new
        file while a second still waits on the old one."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor of the open file releases the flock
            self._fd = None


def _read(fd: int) -> dict:
    """The holder's record in the lock file ({} when empty or being written)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
