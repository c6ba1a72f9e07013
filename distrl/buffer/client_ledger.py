"""The buffer's ledger of its clients, by header sender: who spoke when, and the credits each holds.

Actors come and go (``distrl rollout --join``; docs/multinode.md): the credits granted to a sender and not
yet PUT are its ``owed``; they return to the pool (``GroupStore.refund_credits``) when it asks again, when it
says LEAVE, or when it has been silent for ``credit_timeout_s`` (killed, node lost; logged). Over the
changing set the store counts groups accepted beyond AReaL's rule (``credit_violations``).

:class:`ClientLedger` is plain bookkeeping around the store, no sockets: :class:`distrl.buffer.handlers.Handlers`
answers CREDIT, JOIN and LEAVE with it, and :class:`distrl.buffer.server.BufferServer` tells it who spoke.
"""

from __future__ import annotations

import logging
import re
import time

from distrl.buffer.store import GroupStore

log = logging.getLogger(__name__)

MAX_CLIENTS_TRACKED = 4096  # senders remembered for liveness (a bound against made-up names)
CREDIT_TIMEOUT_S = 60.0  # an actor silent this long with unused credits is lost: they return (--credit_timeout_s)


class ClientLedger:
    """Who talks to the buffer: when each sender last spoke, the credits granted to it and not yet PUT
    (``owed``), the actor ids JOIN handed out, and how many left or were lost (``departures``).

    Args:
        store: the store the credits are granted from and return to.
        credit_timeout_s: seconds a sender holding unused credits may be silent before they return.
    """

    def __init__(self, store: GroupStore, credit_timeout_s: float = CREDIT_TIMEOUT_S) -> None:
        self.store, self.credit_timeout_s = store, credit_timeout_s
        self.last_seen: dict[str, float] = {}  # sender -> time.monotonic() of its last request
        self.owed: dict[str, int] = {}  # sender -> credits granted to it and not yet PUT
        self._joined: dict[str, int] = {}  # sender name -> actor id handed out by JOIN
        self._lost: set[str] = set()  # senders whose credits returned after silence (a PUT from one is logged)
        self.departures = {"left": 0, "lost": 0, "credits_returned_on_leave": 0, "credits_returned_on_timeout": 0}

    def seen(self, sender: str) -> None:
        """Liveness: remember when each client (by header sender) last sent a request."""
        if sender in self.last_seen or len(self.last_seen) < MAX_CLIENTS_TRACKED:
            self.last_seen[sender] = time.monotonic()
        if self._lost and sender in self._lost:
            self._lost.discard(sender)
            log.warning("buffer: %s speaks again after its credits were returned for silence: what it PUTs "
                        "now may exceed AReaL's rule (credit_violations); raise --credit_timeout_s", sender)

    def reclaim(self, sender: str) -> None:
        """A CREDIT from ``sender``: what it was granted and did not PUT returns first (a client asks again only
        after PUTting its grant: it restarted, or our reply was lost)."""
        unused = self.owed.pop(sender, 0)
        if unused:
            self.store.refund_credits(unused)
            log.info("buffer: %s asks for credits again with %d unused: returned", sender, unused)

    def record_grant(self, sender: str, credits: int) -> None:
        """``credits`` were granted to ``sender``: owed until it PUTs them."""
        if credits and len(self.owed) < MAX_CLIENTS_TRACKED:
            self.owed[sender] = credits

    def record_put(self, sender: str, groups: int) -> None:
        """``sender`` PUT ``groups`` groups: they used its credits."""
        if sender in self.owed:
            self.owed[sender] = max(0, self.owed[sender] - groups)

    def join(self, sender: str, first_id: int) -> int:
        """A fresh actor id: above ``first_id``, every id whose groups the buffer holds in its log, every sender
        ``actor<N>`` seen and every id handed out before."""
        seen = [int(m.group(1)) for name in self.last_seen if (m := re.fullmatch(r"actor(\d+)", name))]
        actor_id = max([first_id - 1, *seen, *self.store.actor_ids(), *self._joined.values()]) + 1
        self._joined[f"actor{actor_id}"] = actor_id
        log.info("buffer: an actor joins (%s asked): actor id %d, at learner version %d", sender or "?",
                 actor_id, self.store.learner_version)
        return actor_id

    def leave(self, sender: str) -> int:
        """``sender`` stops: its unused credits return now (counted, logged); returns how many."""
        returned = self.store.refund_credits(self.owed.pop(sender, 0))
        self.departures["left"] += 1
        self.departures["credits_returned_on_leave"] += returned
        self._joined.pop(sender, None)
        log.info("buffer: %s leaves at learner version %d: %d unused credits returned", sender,
                 self.store.learner_version, returned)
        return returned

    def expire_silent(self) -> None:
        """Liveness: the unused credits of a sender silent for ``credit_timeout_s`` return (it is lost)."""
        now = time.monotonic()
        for sender in [s for s in self.owed if now - self.last_seen.get(s, now) > self.credit_timeout_s]:
            if not self.owed[sender]:  # it PUT all it was granted: nothing to return, no one to call lost
                del self.owed[sender]
                continue
            returned = self.store.refund_credits(self.owed.pop(sender))
            self._lost.add(sender)
            self.departures["lost"] += 1
            self.departures["credits_returned_on_timeout"] += returned
            log.warning("buffer: %s sent nothing for %.0f s (--credit_timeout_s) with unused credits: counted lost, "
                        "%d credits returned", sender, now - self.last_seen[sender], returned)

    def stats(self) -> dict:
        """``last_seen_s`` (seconds since each client's last request, by sender name; the driver's watchdog
        reads it), ``credits_owed`` (the sum of ``owed``), ``owed`` (unused credits by sender), ``joined_actors``
        (JOINed senders heard within credit_timeout_s), ``left``, ``lost``, ``credits_returned_on_leave``,
        ``credits_returned_on_timeout``."""
        now = time.monotonic()
        joined = [s for s in self._joined if now - self.last_seen.get(s, -1e18) <= self.credit_timeout_s]
        return {"last_seen_s": {s: round(now - t, 3) for s, t in self.last_seen.items()},
                "credits_owed": sum(self.owed.values()), "owed": dict(self.owed), "joined_actors": joined,
                **self.departures}
