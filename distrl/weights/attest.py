"""Weights that prove themselves: each completion's stamp, and the learner's check of it.

**Stamp.** Every completion records which weights generated it, in three list columns of
:data:`distrl.core.rows.COMPLETION_SCHEMA` (one entry per version the engine served during the generate
call: one, or more with ``--inflight_update finish``; the first is ``policy_version``):

- ``served_versions``: the policy versions;
- ``weights_digests``: the digest of the payload the engine loaded for each, as its weight transport
  verified it before loading (``fs``/``zmq``: XXH3-128 of the version's directory, which the loader already
  hashes at memory speed, tens of ms per GB; ``nccl``: ``sum64`` of the received buffers, summed on the
  device); ``""`` for version 0 (the initial weights, nothing loaded). No extra hashing is done for it;
- ``canary_logprobs``: the engine's mean logprob (nats/token) of the fixed canary sequence
  (:func:`canary_ids`) at that version, at temperature 1, computed once per weight load
  (:class:`Stamper`): HF engine, one forward of :data:`CANARY_LENGTH` tokens with the head in fp32
  (:func:`canary_logprob`); vLLM, the same tokens as a prompt with ``prompt_logprobs=0``.

**Check.** Each learner rank computes its own canary logprob with the same function for each version it
makes (one forward of 32 tokens, no gradient) and compares every row's stamp with it
(:class:`Attestor`). A group with a stamp farther than the tolerance from the learner's canary for that
version (or, on rank 0 which publishes, with another digest than the one published) is quarantined: left
out of the batch, counted (``learner/quarantined_groups``), logged with its actor id and version. A run
where groups are quarantined at ``--attest_max_bad_versions`` consecutive versions stops with
:class:`WrongWeightsError`. Rows without a stamp (older runs' segments, replay) and stamps of versions the
learner did not compute (before a resume) are counted as ``learner/unattested_groups`` and kept.

**Tolerance** (mean logprob over the 31 predicted canary tokens, nats/token):

- fp32 on both sides, CPU: :data:`TOLERANCE_FP32` = 1e-4. Engine and learner run the same fp32 weights
  through different kernels (batch shapes, vLLM's CPU GEMMs, a LoRA merged or not), whose summation
  order differs: relative error about ``sqrt(d) * 2^-24`` (6e-8 sqrt(d)) per dot product of length d,
  i.e. 1e-6 .. 1e-5 on logits of magnitude 10 for d up to 10^4, through every layer; a logprob moves by
  at most 2 max|dlogit|. Measured on the tiny model: HF engine vs learner 0.0, vLLM-CPU vs HF 8.5e-8.
  1e-4 leaves a margin of 10x over the bound and 1000x over the measurement.
- bf16 on either side (or CUDA, where the learner's fp32 head uses TF32): :data:`TOLERANCE_BF16` = 0.15.
  bf16 keeps 8 significant bits (unit roundoff u = 2^-9 = 0.002); every layer's activations are rounded
  once per op, so a logit after L layers carries a relative error of order ``u * sqrt(L * ops)`` ~ 1-2 %
  (24-30 layers, about 6 rounded ops each), i.e. 0.1-0.2 nats on a logit of magnitude 10. A logprob
  ``z_t - logsumexp(z)`` cancels part of that common error, and the mean over 31 tokens averages the
  rest. Measured (CPU, SmolLM2-135M, 30 layers, the same weights in bf16 and in fp32): canary 1.75e-2
  apart (per token |Δ logprob| mean 5.4e-2, max 0.19). Two bf16 implementations round the same bf16
  weights, so they differ by about as much at the start. The gap grows as RL sharpens the model (larger
  activations, the same relative rounding): on one H100, SmolLM2 in bf16 with full fine-tuning at lr 2e-5,
  honest actors (every payload's digest verified) drifted to 0.054 from the learner's canary after 130-410
  versions, past an earlier tolerance of 0.05, which stopped 3 of 4 runs with WrongWeightsError. 0.15 is about
  3x that largest honest gap. ``--attest_tolerance`` sets another value. The price: one AdamW step at lr 1e-6
  moved the same model's canary by 3.3e-3, so in bf16 serving v-1 for v goes unseen; weights stuck at one
  version are caught once the learner's canary has drifted 0.15 from theirs (at lr 2e-5 within a few versions).

One optimizer step moves the canary by much more than these: the test measures it on the tiny model
(tests/integration/test_attest.py prints the numbers).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa

log = logging.getLogger("distrl.attest")

CANARY_LENGTH = 32  # tokens; the mean is over the 31 predicted ones
CANARY_SEED = 0x5EED_CA9A
CANARY_VOCAB = 256  # ids are drawn below min(vocab_size, 256): valid in every tokenizer of at least that size
TOLERANCE_FP32 = 1e-4  # nats/token (module docstring)
TOLERANCE_BF16 = 0.15  # nats/token (module docstring)
STAMP_FIELDS = ("served_versions", "weights_digests", "canary_logprobs")


class WrongWeightsError(RuntimeError):
    """Actors kept serving other weights than their stamps claim (the message names them and the versions)."""


def canary_ids(vocab_size: int) -> list[int]:
    """The canary: :data:`CANARY_LENGTH` token ids drawn with a fixed seed below ``min(vocab_size, 256)``;
    the same on every host for models with the same ``config.vocab_size``."""
    rng = random.Random(CANARY_SEED)
    top = min(int(vocab_size), CANARY_VOCAB)
    return [rng.randrange(top) for _ in range(CANARY_LENGTH)]


def canary_logprob(body, head, vocab_size: int) -> float:
    """Mean logprob (nats/token, temperature 1) of canary token t+1 given tokens 0..t, t < 31.

    ``body``: the transformer body (``body(input_ids=...)`` returns ``last_hidden_state`` (1, L, H));
    ``head``: the LM head (a Linear, weight (V, H)), applied in fp32 as the learner and the HF engine do.
    One forward of :data:`CANARY_LENGTH` tokens, no gradient.
    """
    import torch
    import torch.nn.functional as F

    device = head.weight.device
    ids = torch.tensor([canary_ids(vocab_size)], device=device)  # (1, L)
    with torch.no_grad():
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state[0, :-1].float()  # (L-1, H)
        bias = None if getattr(head, "bias", None) is None else head.bias.float()
        logp = torch.log_softmax(F.linear(hidden, head.weight.float(), bias), dim=-1)  # (L-1, V)
        return float(logp.gather(-1, ids[0, 1:, None]).mean())


def prompt_canary(ids: list[int], prompt_logprobs: list) -> float:
    """The canary logprob from vLLM's ``prompt_logprobs`` of the canary prompt ``ids`` (entry 0 is None;
    entry t a dict token id -> Logprob holding ``ids[t]``)."""
    return float(np.mean([prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))]))


def tolerance(dtype, device_type: str, override: float | None = None) -> float:
    """The canary tolerance in nats/token: ``override`` if set, else :data:`TOLERANCE_FP32` for float32 on
    CPU and :data:`TOLERANCE_BF16` otherwise (``dtype``: the learner's parameter torch dtype)."""
    if override is not None:
        return float(override)
    return TOLERANCE_FP32 if str(dtype) == "torch.float32" and device_type == "cpu" else TOLERANCE_BF16


@dataclass(frozen=True)
class Stamp:
    """What an engine served: ``version``, the verified ``digest`` of its payload, its ``canary`` logprob."""

    version: int
    digest: str
    canary: float


class Stamper:
    """An actor's stamps: ``canary()`` (its engine's canary logprob) runs once per served version.

    ``start(version, digest)`` begins a generate call; ``served(version, digest)`` records a version loaded
    during it (an in-flight update); ``fields()`` are the stamp columns of the call's rows. Disabled
    (``--no_attest_weights``), the columns are null and no canary is computed.
    """

    def __init__(self, canary: Callable[[], float], enabled: bool = True) -> None:
        self._canary, self.enabled = canary, enabled
        self.canary_s = 0.0  # seconds the last canary took (the ``actor/canary_s`` metric)
        self._known: dict[tuple[int, str], Stamp] = {}
        self.call: list[Stamp] = []

    def stamp(self, version: int, digest: str) -> Stamp:
        """The stamp of ``version`` as loaded with ``digest`` (its canary computed now, the first time)."""
        key = (version, digest)
        if key not in self._known:
            self._known = {k: s for k, s in self._known.items() if k[0] > version - 8}
            t0 = time.perf_counter()
            self._known[key] = Stamp(version, digest, self._canary())
            self.canary_s = time.perf_counter() - t0
        return self._known[key]

    def start(self, version: int, digest: str) -> None:
        self.call = [self.stamp(version, digest)] if self.enabled else []

    def served(self, version: int, digest: str) -> None:
        if self.enabled and (not self.call or self.call[-1].version != version):
            self.call.append(self.stamp(version, digest))

    def fields(self) -> dict:
        """The row fields of :data:`STAMP_FIELDS` for a completion of the current call (None: unstamped)."""
        if not self.enabled:
            return dict.fromkeys(STAMP_FIELDS)
        return {"served_versions": [s.version for s in self.call], "weights_digests": [s.digest for s in self.call],
                "canary_logprobs": [s.canary for s in self.call]}


@dataclass
class Verdict:
    """One shard's check: ``kept`` rows, ``quarantined`` and ``unattested`` group counts, and one line per
    quarantined group (actor id, version, stamp vs the learner's canary)."""

    kept: pa.Table
    quarantined: int = 0
    unattested: int = 0
    lines: list[str] = field(default_factory=list)


class Attestor:
    """A learner rank's side: the canary (and, where known, digest) of each version it made, and the check.

    ``record(version, canary, digest)`` after each optimizer step (and for the version it starts from);
    ``check(table)`` splits a shard into kept and quarantined groups; ``judge(quarantined, version)``, given
    the count over all ranks, raises WrongWeightsError after ``max_bad_versions`` consecutive versions
    with quarantined groups.
    """

    def __init__(self, tol: float, max_bad_versions: int = 3, keep: int = 64) -> None:
        self.tol, self.max_bad_versions, self.keep = tol, max_bad_versions, keep
        self.canaries: dict[int, float] = {}
        self.digests: dict[int, str] = {}
        self.bad_streak: list[int] = []  # consecutive learner versions with quarantined groups
        self.offenders: dict[tuple[int, int], int] = {}  # (actor id, stamped version) -> groups, this streak

    def record(self, version: int, canary: float, digest: str | None = None) -> None:
        self.canaries[version] = canary
        if digest is not None:
            self.digests[version] = digest
        for old in [v for v in self.canaries if v <= version - self.keep]:
            self.canaries.pop(old)
            self.digests.pop(old, None)

    def _group_fault(self, versions, digests, canaries) -> str | None:
        """Why a group's stamp does not match (None: it matches); raises KeyError when unverifiable."""
        for v, d, c in zip(versions, digests, canaries):
            expected = self.canaries[v]
            if not abs(c - expected) <= self.tol:
                return (f"version {v}: canary logprob {c:.6f}, the learner's {expected:.6f} "
                        f"(|diff| {abs(c - expected):.2e} > tolerance {self.tol:.0e})")
            if d and v in self.digests and d != self.digests[v]:  # "": nothing loaded (version 0, a shared model)
                return f"version {v}: digest {d[:20]}, published {self.digests[v][:20]}"
        return None

    def check(self, table: pa.Table) -> Verdict:
        """Quarantine the groups of ``table`` (rows of COMPLETION_SCHEMA, groups contiguous or not) whose stamp
        does not match; returns the :class:`Verdict` (``kept``: the other rows, in order)."""
        if table.num_rows == 0 or "served_versions" not in table.column_names:
            return Verdict(table)
        groups = table.column("group_id").to_pylist()
        cols = [table.column(name).to_pylist() for name in STAMP_FIELDS]
        actors = table.column("actor_id").to_pylist()
        verdict, bad, judged = Verdict(table), set(), set()
        for i, gid in enumerate(groups):
            if gid in judged:
                continue
            judged.add(gid)
            versions, digests, canaries = (c[i] for c in cols)
            if versions is None or not versions:
                verdict.unattested += 1
                continue
            try:
                fault = self._group_fault(versions, digests, canaries)
            except KeyError:
                verdict.unattested += 1
                continue
            if fault is not None:
                bad.add(gid)
                key = (actors[i], versions[0])
                self.offenders[key] = self.offenders.get(key, 0) + 1
                verdict.lines.append(f"group {gid} of actor {actors[i]} stamped version {versions[0]}: {fault}")
        if bad:
            keep = np.array([g not in bad for g in groups])
            verdict.kept, verdict.quarantined = table.filter(pa.array(keep)), len(bad)
        return verdict

    def judge(self, quarantined_all_ranks: int, learner_version: int) -> None:
        """Track the streak of versions with quarantined groups; raise WrongWeightsError at ``max_bad_versions``."""
        if quarantined_all_ranks == 0:
            self.bad_streak, self.offenders = [], {}
            return
        self.bad_streak.append(learner_version)
        if self.max_bad_versions and len(self.bad_streak) >= self.max_bad_versions:
            who = ", ".join(f"actor {a} (stamped version {v}: {n} groups)"
                            for (a, v), n in sorted(self.offenders.items()))
            raise WrongWeightsError(
                f"actors kept serving other weights than their stamps claim: groups were quarantined at "
                f"{len(self.bad_streak)} consecutive learner versions {self.bad_streak} (--attest_max_bad_versions "
                f"{self.max_bad_versions}); offenders: {who or 'on other learner ranks'}. Their engines did not load "
                f"the announced weights (see the actor logs), or --attest_tolerance {self.tol:g} is too tight "
                f"for this dtype")
