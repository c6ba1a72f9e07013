"""The rollout actors' ``run`` calls as `distrl train`'s driver follows them: one rule for an actor that is gone.

Ray restarts a rollout actor whose process died (``--max_actor_restarts``, the same for a crash, an OOM, a
stuck process the watchdog killed, or its node lost: Ray then places the actor's bundle on a node with room
and the actor rejoins the run there). What the driver sees of its ``run`` call:

=============================  ============================================================================
Ray's answer                   what :meth:`ActorRuns.settle` does
=============================  ============================================================================
the result                     the actor finished (after the learners' last version)
``ActorDiedError``             the actor is **gone**: its restarts are used up, or Ray cannot restart it. The
                               run goes on with the actors left (their groups keep the learners fed), those
                               that joined with `distrl rollout --join` included (``joined``: the buffer's
                               list of them); only when every actor is gone (and no learner generates and
                               no joined actor spoke lately) does it end (RoleFailed). The buffer returns a
                               gone actor's unused credits after --credit_timeout_s of silence
``ActorUnavailableError``      Ray cannot reach the actor and has not decided yet (a node that stopped
                               answering is marked dead only after Ray's health checks, ~15 s): ``run`` is
                               called again :data:`RETRY_S` later; the call waits while Ray restarts the
                               actor. After ``unavailable_s`` of such answers the actor is killed for good
                               (no restart) and counted gone
any other error                the actor's own error (a ``RayTaskError``): raised, it ends the run as before
=============================  ============================================================================
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("distrl.cmd.actor_runs")
RETRY_S = 2.0  # seconds between an ActorUnavailableError and the next `run` call on that actor


class ActorRuns:
    """Each rollout actor's current ``run`` call (``handles``: role name ``actor<i>`` -> Ray actor handle),
    its result, or why it is gone. ``others_generate``: a learner also generates (--learner_generates), so
    the run can go on with no actor. ``unavailable_s``: seconds an actor may stay unreachable (no death
    declared) before it is killed and counted gone. ``joined``: returns the names of the live actors that
    joined the run (``distrl.cmd.join.joined_actors``); the run goes on with them when the launcher's are gone."""

    def __init__(self, handles: dict, others_generate: bool = False, unavailable_s: float = 120.0, joined=None):
        self.handles, self.others_generate, self.unavailable_s = handles, others_generate, unavailable_s
        self.joined = joined or (lambda: [])
        self.refs = {name: handle.run.remote() for name, handle in handles.items()}  # None: a retry is due
        self.results: dict[str, dict] = {}
        self.gone: dict[str, str] = {}
        self._unavailable_since: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}

    def running(self) -> list[str]:
        """Names of the actors neither finished nor gone."""
        return [name for name in self.handles if name not in self.results and name not in self.gone]

    def pending(self) -> list:
        """The run calls in flight, after calling ``run`` again on each actor whose retry is due."""
        now = time.time()
        for name, at in list(self._retry_at.items()):
            if now >= at:
                del self._retry_at[name]
                self.refs[name] = self.handles[name].run.remote()
        return [self.refs[name] for name in self.running() if self.refs[name] is not None]

    def settle(self, ref) -> bool:
        """Take in a finished ``ref``; False when it is no actor's current run call. Raises the actor's own
        error (RayTaskError), or RoleFailed when the last actor is gone and no learner generates."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        name = next((n for n, r in self.refs.items() if r is not None and r == ref), None)
        if name is None:
            return False
        try:
            self.results[name] = ray.get(ref)
            self._unavailable_since.pop(name, None)
        except ActorUnavailableError as exc:
            since = self._unavailable_since.setdefault(name, time.time())
            if time.time() - since < self.unavailable_s:
                log.warning("%s unavailable (%s): calling its run again in %g s", name, _first_line(exc), RETRY_S)
                self.refs[name], self._retry_at[name] = None, time.time() + RETRY_S
            else:
                ray.kill(self.handles[name], no_restart=True)
                self._lose(name, f"unreachable for {self.unavailable_s:g} s: killed")
        except ActorDiedError as exc:
            self._lose(name, _first_line(exc))
        return True

    def _lose(self, name: str, why: str) -> None:
        from distrl.cmd.faults import RoleFailed

        self.gone[name] = why
        self.refs[name] = None
        left = self.running() or (self.joined() if not self.others_generate else [])
        log.error("%s is gone (%s); the run goes on with %s", name, why,
                  ", ".join(left) if left else "the learners' own generation" if self.others_generate else "none")
        if not left and not self.results and not self.others_generate:
            raise RoleFailed(f"every rollout actor is gone ({name}: {why}); see logs/driver.log")

    def outcomes(self) -> list[dict]:
        """Per actor in order: its result, or ``{"actor_id", "gone", "last_version": None}`` for one gone."""
        return [self.results.get(name) or {"actor_id": int(name[len("actor"):]), "gone": self.gone.get(name, "?"),
                                           "last_version": None} for name in self.handles]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
