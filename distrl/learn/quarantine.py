"""A learner rank's weight attestation (distrl.weights.attest): its canary per version, and the quarantine.

Each rank computes the canary logprob of the weights of every version it makes (all ranks hold the same
weights, so none waits for another), rank 0 also records the digest it published, and each rank checks
the stamps of its own shard before the step. The count of quarantined groups is summed over the ranks
(one all-reduce of one number), so every rank takes the same stop decision (:meth:`Attestor.judge`).
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from distrl.core.metrics import Metrics
from distrl.learn.config import LearnOptions
from distrl.learn.distributed import all_reduce_sum
from distrl.weights.attest import Attestor, canary_logprob, tolerance

log = logging.getLogger("distrl.learner")


class LearnerAttestation:
    """``record(version)`` after each step (and for the version the run starts from); ``published(version,
    digest)`` on rank 0; ``check(table, version)`` returns the rows to train on (raises WrongWeightsError)."""

    def __init__(self, learn: LearnOptions, max_staleness: int, rank: int, world_size: int, body, head,
                 vocab_size: int, metrics: Metrics) -> None:
        self.rank, self.world_size, self.metrics = rank, world_size, metrics
        self.record_s = 0.0  # seconds the last record() took
        self.body, self.head, self.vocab_size = body, head, vocab_size
        tol = tolerance(head.weight.dtype, head.weight.device.type, learn.attest_tolerance)
        self.attestor = Attestor(tol, learn.attest_max_bad_versions, keep=max(64, 2 * max_staleness + 8))
        log.info("learner%d: weight attestation on (canary tolerance %g nats/token)", rank, tol)

    def record(self, version: int) -> None:
        """Compute and keep ``version``'s canary logprob (one 32-token forward, no gradient)."""
        t0 = time.perf_counter()
        canary = canary_logprob(self.body, self.head, self.vocab_size)
        self.attestor.record(version, canary)
        self.record_s = time.perf_counter() - t0
        self.metrics.scalar("learner/canary_logprob", canary, version)

    def published(self, version: int, digest: str) -> None:
        self.attestor.digests[version] = digest

    def check(self, table: pa.Table, version: int) -> pa.Table:
        """The rows of ``table`` (this rank's shard for learner ``version``) whose groups' stamps match."""
        t0 = time.perf_counter()
        verdict = self.attestor.check(table)
        for line in verdict.lines:
            log.warning("learner%d: learner version %d quarantined %s", self.rank, version, line)
        total = int(all_reduce_sum([verdict.quarantined], self.world_size)[0])
        # attest_s: this check and the canary of the version it trains (seconds; bench/attest.py reads it)
        self.metrics.scalars({"learner/quarantined_groups": verdict.quarantined,
                              "learner/unattested_groups": verdict.unattested,
                              "learner/attest_s": time.perf_counter() - t0 + self.record_s}, step=version + 1)
        self.attestor.judge(total, version)  # after the metrics: the version that stops the run is counted
        return verdict.kept
