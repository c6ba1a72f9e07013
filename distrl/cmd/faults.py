"""Fault handling shared by `distrl train` and the launchers: signals, role files, the liveness watchdog.

* **Signals.** :func:`raise_on_signals` turns the first SIGINT or SIGTERM into :class:`Interrupted`
  (further ones are ignored, so the cleanup that follows is not cut short); `distrl` then exits with
  ``128 + signal number`` (130 for SIGINT, 143 for SIGTERM).
* **Role files.** Each role writes ``<run_dir>/roles/<name>.json`` = ``{"name", "pid", "host",
  "started"}`` (``started``: unix seconds) when it starts, and again when it is restarted, so reports
  (and tests) can name and find the process.
* **Liveness.** Every actor and learner talks to the buffer all the time: an actor asks for credits
  before each generate call (every 50 ms while it has none), a learner asks for a batch after each
  step (every 20 ms while it waits). The buffer remembers each client's last request (STATS
  ``last_seen_s``), so a role that sent nothing for ``--heartbeat_timeout_s`` is stuck (a frozen
  process, a hung generate call or step, a deadlock); the buffer is stuck when it does not answer
  STATS within that time. A role the buffer has not heard from yet, or that (re)started after its
  last request, is still loading its model and is not judged.
* **The driver's side** (`distrl train`): :func:`watch_roles` acts on what the watchdog finds,
  :func:`end_early` flushes the buffer and writes ``summary.json`` when a run ends before its last
  version (a signal, a stuck or a failed role).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import time
from pathlib import Path

log = logging.getLogger("distrl.cmd.faults")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` is its number. A KeyboardInterrupt, so that library code
    catching ``Exception`` does not swallow it and Ray's blocking calls give it back (as a plain
    KeyboardInterrupt: :func:`as_interrupted` restores the signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_RECEIVED: list[int] = []  # signals the handler of raise_on_signals() got, in order (process-wide)


def as_interrupted(exc: KeyboardInterrupt) -> Interrupted:
    """``exc`` as an :class:`Interrupted` naming the signal that caused it (SIGINT if none was seen)."""
    return exc if isinstance(exc, Interrupted) else Interrupted(_RECEIVED[0] if _RECEIVED else signal.SIGINT)


class RoleFailed(RuntimeError):
    """A role of `distrl train` raised or died, which ends the run; the message names the role, gives its
    error and the last lines of its traceback, and its log file (:func:`role_failed`)."""


class RoleStuck(RoleFailed):
    """A learner or the buffer made no progress for --heartbeat_timeout_s; the message names it."""


def raise_on_signals() -> None:
    """Make the first SIGINT/SIGTERM raise :class:`Interrupted` in the main thread; ignore later ones."""

    def handler(signum, _frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        _RECEIVED.append(signum)
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def write_role_file(run_dir: str | os.PathLike, name: str) -> dict:
    """Write ``<run_dir>/roles/<name>.json`` for this process (via a temp file and a rename); returns it."""
    info = {"name": name, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    path = Path(run_dir) / "roles" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
    return info


def read_role_file(run_dir: str | os.PathLike, name: str) -> dict | None:
    """The role file of ``name`` (None if that role never started)."""
    path = Path(run_dir) / "roles" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def quiet_roles(last_seen_s: dict[str, float], watched: list[str], started: dict[str, float], now: float,
                timeout_s: float) -> list[tuple[str, float]]:
    """``(name, seconds quiet)`` of each role in ``watched`` whose last buffer request is more than
    ``timeout_s`` old. ``last_seen_s``: seconds since each client's last request (buffer STATS);
    ``started``: unix time each role (re)started; ``now``: unix time. Roles never seen, or (re)started
    after their last request, are skipped (still starting)."""
    quiet = []
    for name in watched:
        age = last_seen_s.get(name)
        if age is None or started.get(name, 0.0) > now - age:
            continue
        if age > timeout_s:
            quiet.append((name, age))
    return quiet


STATS_POLL_S = 5.0  # longest wait of one watchdog STATS request (the buffer is judged over --heartbeat_timeout_s)


class Watchdog:
    """Polls the buffer's STATS and reports roles quiet for more than ``timeout_s`` seconds.

    ``check(watched)`` returns ``[(name, message)]``: ``buffer0`` when STATS is not answered within
    ``timeout_s``, else the quiet roles among ``watched``; an empty list when all is well.
    ``restarted(name)`` starts that role's grace period (it is loading again).
    """

    def __init__(self, buffer_address: str, run_dir: str | os.PathLike, timeout_s: float,
                 curve_server_key: str | None = None, curve_client_key: str | None = None) -> None:
        from distrl.core.buffer_client import BufferClient

        self.run_dir, self.timeout_s = Path(run_dir), timeout_s
        # one STATS waits STATS_POLL_S at most: the driver's loop, which calls check(), then sees a dead buffer's
        # error from Ray within seconds instead of after a STATS that waited the whole --heartbeat_timeout_s
        self.client = BufferClient(buffer_address, "watchdog", timeout_s=min(timeout_s, STATS_POLL_S), retries=0,
                                   curve_server_key=curve_server_key, curve_client_key=curve_client_key)
        self._restarted: dict[str, float] = {}
        self._silent_since: float | None = None  # when STATS first went unanswered (None: it answers)

    def describe(self, name: str) -> str:
        """``name (pid P on host H)`` from its role file."""
        info = read_role_file(self.run_dir, name)
        return name if info is None else f"{name} (pid {info['pid']} on host {info['host']})"

    def restarted(self, name: str) -> None:
        self._restarted[name] = time.time()

    def check(self, watched: list[str]) -> list[tuple[str, str]]:
        try:
            last_seen = self.client.stats()["last_seen_s"]
        except TimeoutError:
            now = time.time()
            if self._silent_since is None:
                self._silent_since = now - self.client.timeout_s
            if now - self._silent_since < self.timeout_s:
                return []
            return [("buffer0", f"{self.describe('buffer0')}: no answer to STATS for {now - self._silent_since:.0f} s "
                                f"(--heartbeat_timeout_s {self.timeout_s:g})")]
        self._silent_since = None
        started = {}
        for name in watched:
            info = read_role_file(self.run_dir, name)
            started[name] = max(info["started"] if info else 0.0, self._restarted.get(name, 0.0))
        return [(name, f"{self.describe(name)}: no request to the buffer for {age:.0f} s "
                       f"(--heartbeat_timeout_s {self.timeout_s:g})")
                for name, age in quiet_roles(last_seen, watched, started, time.time(), self.timeout_s)]

    def close(self) -> None:
        self.client.close()


# ---- `distrl train`: what the driver does about a stuck role or an early end -------------------


def watch_roles(cfg, run_dir: Path, buffer_address: str, handles: dict, running):  # cfg: a TrainConfig
    """(Watchdog, watch) for `distrl.cmd.trainer._wait_all`, or (None, None) with --heartbeat_timeout_s 0.

    ``handles``: name -> Ray handle; ``running()``: the names of the roles whose run call is in flight.
    ``watch()`` logs every stuck role by name and kills it (:func:`kill_role`): Ray restarts a stuck actor
    (distrl.cmd.actor_runs); a stuck learner or buffer raises RoleStuck.
    """
    if not cfg.heartbeat_timeout_s:
        return None, None
    dog = Watchdog(buffer_address, run_dir, cfg.heartbeat_timeout_s)

    def watch() -> None:
        for name, message in dog.check(running()):
            actor = name.startswith("actor")
            log.error("%s: %s", message, f"restarting it (at most --max_actor_restarts {cfg.max_actor_restarts} "
                      "times)" if actor else "ending the run")
            kill_role(handles[name], read_role_file(run_dir, name))  # an actor: Ray starts it again
            if not actor:
                raise RoleStuck(message)
            dog.restarted(name)

    return dog, watch


def kill_role(handle, info: dict | None) -> None:
    """SIGKILL a role's process by pid when it runs on this host (a frozen process cannot exit by
    itself), else (or when that pid is gone: e.g. its node was lost and Ray cannot place it again) ask Ray
    to kill it; Ray restarts an actor that has restarts left."""
    import ray

    if info is not None and info["host"] == socket.gethostname():
        try:
            os.kill(info["pid"], signal.SIGKILL)
            return
        except ProcessLookupError:
            pass
    ray.kill(handle, no_restart=False)


# Failures that `distrl train --resume` cannot get past: the same config meets them again (a bad input, a
# missing file or module, a run that cannot advance). Signals, stuck or killed roles, lost connections can.
NOT_RESUMABLE = (ValueError, TypeError, LookupError, ImportError, FileNotFoundError, NotADirectoryError,
                 PermissionError)


def resumable(exc: BaseException) -> bool:
    """Whether `--resume` may get past ``exc``, the error as Ray raised it (a role's error is an instance
    of its cause's class): not for NOT_RESUMABLE, NoProgress or a role whose start (__init__) raised."""
    from distrl.core.errors import NoProgress

    if getattr(exc, "actor_init_failed", False):
        return False
    return not isinstance(exc, (*NOT_RESUMABLE, NoProgress))


def end_early(reason: BaseException, run_dir: Path, start: float, buffer_address: str | None, buffer_ref,
              can_resume: bool = True) -> None:
    """The run ends before its last version: ask the buffer to shut down (its logs are flushed and
    closed: every acknowledged group stays readable) and write summary.json saying why, with the command
    that continues it when ``can_resume`` (else what to do instead)."""
    import ray

    from distrl.core.buffer_client import BufferClient

    interrupted = reason.signum if isinstance(reason, Interrupted) else None
    named = str(reason) if isinstance(reason, RoleFailed) else f"{type(reason).__name__}: {reason}"  # names itself
    said = f"interrupted by {reason}" if interrupted else named.splitlines()[0]
    log.error("run ends early: %s", said)
    buffer_stats = None
    if buffer_address is not None:
        try:
            with BufferClient(buffer_address, "driver", timeout_s=10) as client:
                client.shutdown()
            buffer_stats = ray.get(buffer_ref, timeout=20)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck buffer: its acknowledged groups are on disk
            log.warning("buffer not shut down cleanly (%s: %s)", type(exc).__name__, exc)
    summary = {"run_dir": str(run_dir), "interrupted": interrupted is not None,
               "signal": str(reason) if interrupted else None,
               "error": None if interrupted else f"{type(reason).__name__}: {reason}",
               "wall_s": time.time() - start, "buffer": buffer_stats,
               "last_selected_version": None if buffer_stats is None else buffer_stats.get("learner_version"),
               "resume": f"distrl train --resume {run_dir} --max_steps N" if can_resume else None}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    then = (f"continue it:   {summary['resume']}" if can_resume else
            "fix the cause: resuming would meet the same error; start a new run (another --run_name)")
    print(f"\ndistrl: run ended early ({said})\n  run directory: {run_dir}\n  {then}", flush=True)


# ---- a role's error, as the driver shows it ------------------------------------------------------

ROLE_ERROR_FRAMES = 2  # innermost traceback frames shown on the terminal (the role's log holds them all)
ROLE_ERROR_LINES = 6  # lines of the exception's own message shown (a pydantic error can have hundreds)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def role_failed(exc: BaseException, handles: dict, run_dir: Path) -> BaseException:
    """``exc`` as :class:`RoleFailed` when it is a role's error that Ray gave back, else ``exc`` itself.

    ``handles``: role name -> Ray actor handle (None: not created). The role is found by the actor id
    in the error; its full error text is appended to ``<run_dir>/logs/<role>.log`` (Ray keeps it out
    of the role's own output), and the message reads::

        actor0 failed: KeyError: 'no such field'
          File ".../user_rewards.py", line 21, in raises
            raise KeyError("no such field")
          see <run_dir>/logs/actor0.log
    """
    from ray.exceptions import RayActorError, RayTaskError

    from distrl.core.errors import NoProgress

    if isinstance(exc, NoProgress):  # the run cannot advance: the cause's one line names the flag to change
        return getattr(exc, "cause", exc)
    if not isinstance(exc, (RayTaskError, RayActorError)):
        return exc
    text = _ANSI.sub("", str(exc))
    found = getattr(exc, "actor_id", None) or next(iter(re.findall(r"actor_id=([0-9a-f]+)", text)), None)
    name = next((n for n, h in handles.items() if h is not None and h._actor_id.hex() == found), None)
    log_file = Path(run_dir) / "logs" / f"{name or 'driver'}.log"
    with log_file.open("a") as out:
        out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} distrl.cmd.faults ERROR {name or 'a role'} failed "
                  f"(its error, as Ray gave it to the driver):\n{text.rstrip()}\n")
    return RoleFailed(f"{name or 'a role'} failed: " + "\n  ".join([*_short_error(text), f"see {log_file}"]))


def _short_error(text: str) -> list[str]:
    """A Python traceback (as Ray formats it) cut to: the exception's first line, the innermost
    ROLE_ERROR_FRAMES frames, then up to ROLE_ERROR_LINES more lines of the exception's message."""
    lines = [line.rstrip() for line in text.strip().splitlines()
             if line.strip() and set(line.strip()) - set("^~")]  # no caret-underline lines
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    end = frames[-1] + 1 if frames else 0
    while end < len(lines) and lines[end].startswith("    "):  # the last frame's source lines
        end += 1
    message = lines[end:] or ["(no message)"]
    shown = lines[frames[-min(len(frames), ROLE_ERROR_FRAMES)]:end] if frames else []
    more = message[1:ROLE_ERROR_LINES + 1]
    if len(message) > ROLE_ERROR_LINES + 1:
        more.append(f"... ({len(message) - ROLE_ERROR_LINES - 1} more lines in the log)")
    return [message[0], *shown, *more]


STALE_WEIGHTS_ENV = "DISTRL_FAULT_STALE_WEIGHTS"  # test-only: actor ids (comma-separated) that fake weight loads


def inject_faults(actor) -> None:
    """Test-only fault injection into a rollout actor (``distrl.rollout.actor.RolloutActor``), from the environment
    (which `distrl train`'s Ray roles inherit from the driver): with ``DISTRL_FAULT_STALE_WEIGHTS`` naming its
    actor id, the actor never loads weights but claims every announced version (:class:`StaleWeights`): the
    silent failure weight attestation exists to catch (distrl/weights/attest.py). Unset: nothing changes."""
    ids = os.environ.get(STALE_WEIGHTS_ENV, "")
    if str(actor.actor_id) in ids.split(","):
        log.warning("%s: FAULT INJECTED (%s): weights are never loaded, versions are claimed", actor.name,
                    STALE_WEIGHTS_ENV)
        actor.loader = StaleWeights(actor.loader)


class StaleWeights:
    """A weight loader that skips the load: the engine keeps its weights, its version says the announced one
    (the shape of trl#5312 and verl#7495: weights that never reach the generator)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.bytes_fetched, self.retains_versions = 0, inner.retains_versions

    def load(self, ann, engine):
        engine.version = ann.version
        return ann

    def close(self) -> None:
        self.inner.close()
