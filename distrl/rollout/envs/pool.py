"""The actor's side of ``--env``: one child process (:mod:`distrl.rollout.envs.worker`) per live episode.

:class:`EnvPool` sends an episode's requests to its own process and never blocks on one: :meth:`EnvPool.poll`
returns the replies that arrived (waiting at most the time given), so the episode loop goes on generating for the
other episodes while one environment computes. Each request has ``--env_timeout_s``: past it the process is killed
and the episode gets an error reply; a process that exits gives one too. Either way only that episode ends; the
next episode starts a fresh process. Processes that finished an episode serve the next ones.
"""

from __future__ import annotations

import time
from typing import Hashable

from distrl.rollout.reward_workers import JsonWorker, child_code, readable_fds


class EnvPool:
    """Child processes of the ``--env`` class ``spec``, each playing one episode (see the module docstring).

    Args:
        spec: ``--env`` (a built-in name, ``module:Class`` or ``path/to/file.py:Class``).
        timeout_s: seconds one reset or step may take (``--env_timeout_s``).
    """

    def __init__(self, spec: str, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self._code = child_code("distrl.rollout.envs.worker", f"r.serve({spec!r})")
        self._idle: list[JsonWorker] = []
        self._held: dict[Hashable, JsonWorker] = {}  # episode -> its process
        self._waiting: dict[Hashable, float] = {}  # episode -> deadline of its request in flight
        self.errors = 0  # episodes ended by an error, a crash or a timeout of the environment

    def reset(self, keys: list[Hashable], problems: list[dict]) -> None:
        """Start an episode per key (a process each: idle ones first, the others started together)."""
        new = [JsonWorker(self._code, f"--env {self.spec} process", f"check that `{self.spec}` imports quickly")
               for _ in range(max(0, len(keys) - len(self._idle)))]
        for w in new:
            w.start(wait=False)
        for w in new:
            w.wait_ready()
        for key, problem in zip(keys, problems):
            self._held[key] = self._idle.pop() if self._idle else new.pop()
            self._send(key, {"op": "reset", "problem": problem})

    def step(self, key: Hashable, text: str) -> None:
        """Send the model's turn ``text`` to the episode's environment (the reply comes through :meth:`poll`)."""
        self._send(key, {"op": "step", "text": text})

    def _send(self, key: Hashable, request: dict) -> None:
        self._waiting[key] = time.monotonic() + self.timeout_s
        try:
            self._held[key].send(request)
        except OSError:  # the process is gone (a crash after its last reply): poll reports it
            pass

    @property
    def pending(self) -> int:
        """Requests in flight."""
        return len(self._waiting)

    def poll(self, timeout_s: float) -> list[tuple[Hashable, dict]]:
        """The replies that arrive within ``timeout_s`` (0: those already there), as (episode, reply); a crash or
        a timeout gives ``{"error": ...}`` and kills the process. Returns at the first reply or the timeout."""
        if not self._waiting:
            return []
        wait = max(0.0, min(min(self._waiting.values()) - time.monotonic(), timeout_s))
        by_fd = {self._held[k].fileno(): k for k in self._waiting if self._held[k].running}
        ready = readable_fds(list(by_fd), wait) if by_fd else []
        out = []
        for fd in ready:
            key = by_fd[fd]
            try:
                out.append((key, self._held[key].receive()))
            except (RuntimeError, ValueError) as exc:  # exited, or printed something that is not a reply
                out.append((key, self._fail(key, f"--env process failed: {exc}")))
                continue
            del self._waiting[key]
        now = time.monotonic()
        for key in [k for k in self._waiting if k not in {key for key, _ in out}]:
            if not self._held[key].running:
                out.append((key, self._fail(key, "--env process exited")))
            elif self._waiting[key] <= now:
                out.append((key, self._fail(key, f"--env call ran past --env_timeout_s {self.timeout_s}")))
        return out

    def _fail(self, key: Hashable, message: str) -> dict:
        """Kill the episode's process; its episode ends with ``message``."""
        self._waiting.pop(key, None)
        self._held.pop(key).close()
        return {"error": message}

    def end(self, key: Hashable) -> None:
        """The episode ended: its process serves the next one (a process with a request in flight is killed)."""
        worker = self._held.pop(key, None)
        if worker is None:
            return
        if self._waiting.pop(key, None) is not None or not worker.running:
            worker.close()
        else:
            self._idle.append(worker)

    def close(self) -> None:
        """Kill every process (by its own handle)."""
        for worker in [*self._idle, *self._held.values()]:
            worker.close()
        self._idle.clear()
        self._held.clear()
        self._waiting.clear()

