"""Child processes that score completions: JSON lines over pipes (nothing pickled), a time limit per request.

:class:`WorkerPool` keeps ``size`` such children (:class:`JsonWorker`) and answers a list of requests in
parallel, each child one request at a time: ``distrl.rollout.rewards`` scores a hand-back's completions with it
(math_verify for gsm8k/math500, a user's ``--reward``), so that scoring, which runs on the actor's host
between the engine's decode steps, takes about 1/size of its serial time (scored one by one, a call's
completions took nearly as long as the generate call itself on a GPU).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_WORKERS = max(1, min(8, (os.cpu_count() or 1) // 2))  # --reward_workers unset: half the cores, 1 to 8


def child_code(module: str, call: str) -> str:
    """``python -c`` text that imports ``module`` (as ``r``, from this checkout) and runs ``call``."""
    root = str(Path(__file__).resolve().parents[2])
    return f"import sys; sys.path.insert(0, {root!r}); import {module} as r; {call}"


class JsonWorker:
    """A child process that answers JSON lines (nothing pickled), started on first use; :class:`WorkerPool`
    sends it requests and reads its replies.

    Args:
        code: ``python -c`` text of the child: it prints ``ready``, then one JSON line per line it reads
            (see :func:`serve_lines`).
        what: the worker's name in error messages, e.g. ``math_verify worker``.
        start_hint: what to check when the child does not start.
    """

    START_TIMEOUT_S = 120.0

    def __init__(self, code: str, what: str, start_hint: str):
        self.code, self.what, self.start_hint = code, what, start_hint
        self._proc: subprocess.Popen | None = None

    def send(self, request) -> None:
        """Write one request (starting the child first if none runs)."""
        if self._proc is None or self._proc.poll() is not None:
            self.start()
        self._proc.stdin.write(json.dumps(request, default=str) + "\n")
        self._proc.stdin.flush()

    def receive(self) -> Any:
        """Read one reply (blocks). Raises RuntimeError if the child exited instead."""
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            self.close()
            raise RuntimeError(f"{self.what} exited with code {code} (its stderr is above)")
        return json.loads(line)

    def start(self, wait: bool = True) -> None:
        """Start the child; ``wait``: until it says ``ready`` (else call :meth:`wait_ready`)."""
        self._proc = subprocess.Popen([sys.executable, "-c", self.code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Raises RuntimeError (child killed) unless it says ``ready`` within START_TIMEOUT_S."""
        if not self.readable(self.START_TIMEOUT_S) or self._proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"{self.what} did not start within {self.START_TIMEOUT_S:.0f} s ({self.start_hint})")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def fileno(self) -> int:
        return self._proc.stdout.fileno()

    def readable(self, timeout_s: float) -> bool:
        return bool(readable_fds([self.fileno()], timeout_s))

    def close(self) -> None:
        """Kill the child, if any (by our own Popen handle)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for stream in (self._proc.stdin, self._proc.stdout):
                stream.close()
            self._proc = None

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.close()


class WorkerPool:
    """``size`` :class:`JsonWorker` children of the same ``code``, started together on first use.

    :meth:`map` answers requests in parallel, one at a time per child; safe to call from any thread (calls are
    serialized). Raises ValueError for ``size`` < 1.
    """

    def __init__(self, code: str, what: str, start_hint: str, size: int = 1):
        if size < 1:
            raise ValueError(f"a worker pool needs at least 1 worker, got {size}")
        self.workers = [JsonWorker(code, what, start_hint) for _ in range(size)]
        self._lock = threading.Lock()

    def map(self, requests: list, timeout_s: float) -> list:
        """The reply to each request, in order; None for one not answered within ``timeout_s`` (its child is
        killed and restarted for the next). Raises RuntimeError if a child exits or does not start."""
        with self._lock:
            self._start_all(min(len(requests), len(self.workers)))
            replies: list = [None] * len(requests)
            todo, busy = list(enumerate(requests))[::-1], {}  # busy: worker -> (request index, deadline)
            try:
                while todo or busy:
                    for w in self.workers:
                        if w not in busy and todo:
                            i, request = todo.pop()
                            w.send(request)  # restarts a child killed at a timeout: not charged to this request
                            busy[w] = (i, time.monotonic() + timeout_s)
                    wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
                    fds = set(readable_fds([w.fileno() for w in busy], wait))
                    for w in [w for w in busy if w.fileno() in fds]:
                        replies[busy[w][0]] = w.receive()
                        del busy[w]
                    for w, (_, deadline) in list(busy.items()):
                        if deadline <= time.monotonic():  # over its limit: killed; the reply stays None
                            w.close()
                            del busy[w]
            except BaseException:  # a child exited (or we were interrupted): no reply may outlive this call
                for w in busy:
                    w.close()
                raise
            return replies

    def _start_all(self, n: int) -> None:
        """The first ``n`` children running, the missing ones started together (each takes seconds)."""
        starting = [w for w in self.workers[:n] if not w.running]
        for w in starting:
            w.start(wait=False)
        for w in starting:
            w.wait_ready()

    def close(self) -> None:
        with self._lock:
            for w in self.workers:
                w.close()


def serve_lines(handle: Callable) -> None:
    """Child-process loop: JSON lines in, ``handle(request)`` as JSON lines out, after a ``ready`` line.

    Exits when stdin closes or the parent process is gone (checked every second).
    """
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the protocol
    out.write("ready\n")
    for line in sys.stdin:
        out.write(json.dumps(handle(json.loads(line))) + "\n")


def readable_fds(fds: list[int], timeout_s: float) -> list[int]:
    """The ``fds`` with data to read (or closed) within ``timeout_s`` seconds. ``select.poll``, not
    ``select.select``: ``select`` refuses descriptors numbered past 1024 (FD_SETSIZE), which a process with a few
    hundred children on pipes reaches (``--env`` runs one child per live episode, e.g. ``--eval_every`` with
    ``--eval_size 512``)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1000)]
