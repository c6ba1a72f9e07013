"""`--learner_generates`: the learner's device also makes rollouts while the learner waits for data.

A :class:`LearnerGenerator` has no engine of its own: it samples with the learner's model object through
:meth:`distrl.rollout.engines.hf.HFEngine.sharing` (no weight copy, no weight transport), so a group it makes
carries the learner's current version as ``policy_version`` and its behavior logprobs are those of exactly the
weights the learner trains (fp32 head, same temperature). The learner calls :meth:`LearnerGenerator.generate_once`
each time its GET is answered WAIT; it asks the buffer for credits like any actor (so the staleness bound and
the credit rule hold), generates and PUTs the granted groups with the actor's own step,
:class:`distrl.rollout.rollouts.Rollouts` (prompts, rewards, group advantages and rows; each group PUT as soon as
its last completion ends, batched by --batching), then the learner asks for its batch again.

Identity in the data: ``actor_id = -1 - rank`` (never a real actor's id) and group ids that start with
``learner<rank>@<host>``; the schema has no host column, so the host travels in the group id.

Why not vLLM sleep/wake: vLLM-CPU has no sleep mode, and a second engine copy would double the
weights in memory and need a weight reload per version; sharing the model object needs neither.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable

from distrl.core.buffer_client import BufferApi
from distrl.core.metrics import Metrics
from distrl.core.run_options import BatchOptions, SharedOptions
from distrl.rollout.config import PromptOptions, TaskOptions
from distrl.rollout.rollouts import Rollouts, load_task

log = logging.getLogger("distrl.actor")


class LearnerGenerator:
    """Generates groups with learner ``rank``'s ``model`` (a torch causal LM, PEFT-wrapped or not).

    Args:
        prompt, generation, shared, batch: the run's sections a generator reads (an actor's own ``rollout``
            section is not: the engine is the learner's, its weights never change mid-call).
        rank: the learner's rank; the rows' ``actor_id`` is ``-1 - rank``.
        learners: the learner count (each generator asks credits for its share of a version's batch).
        model: the learner's model object, shared (not copied).
        client: the buffer client (:class:`distrl.core.buffer_client.BufferApi`); the generator closes it.
        model_dir: where the tokenizer is read (``--tokenizer`` when given).
        policy_version: reads the learner's policy version (``lambda: learner.version``): the learner owns it;
            the generator and its shared engine hold none (:attr:`version` reads this).
        tb_dir: TensorBoard directory of its ``actor/*`` scalars (None: none).
    The client's sender name is :func:`generator_name`'s.
    """

    def __init__(self, prompt: PromptOptions, generation: TaskOptions, shared: SharedOptions, batch: BatchOptions,
                 rank: int, learners: int, model, client: BufferApi, model_dir: str,
                 policy_version: Callable[[], int], tb_dir: str | None = None):
        from transformers import AutoTokenizer

        from distrl.rollout.engines.hf import HFEngine

        self.rank, self.model, self.policy_version = rank, model, policy_version
        self.actor_id, self.name, self.client = -1 - rank, client.sender, client
        task = load_task(prompt, generation, shared)
        tokenizer = AutoTokenizer.from_pretrained(shared.tokenizer or model_dir)
        engine = HFEngine.sharing(model, tokenizer, shared.max_model_len, seed=shared.seed * 1000 + 999 - rank,
                                  batching=generation.batching, max_num_seqs=generation.max_num_seqs)
        self.metrics = Metrics(tb_dir)
        # log_samples 0: actor 0's --log_samples is an actor's option (the generator has no rollout section)
        self.rollouts = Rollouts(generation, shared, batch, self.actor_id, self.name, engine, task, client,
                                 self.metrics, version=policy_version, log_samples=0)
        self.groups, self.generate_s = 0, 0.0
        self.want = max(1, batch.batch_size // learners)

    @property
    def version(self) -> int:
        """The policy version its groups are generated with: the learner's, read at each use (read-only)."""
        return self.policy_version()

    def generate_once(self) -> bool:
        """Ask for credits and generate + PUT the granted groups at the learner's current version.

        Returns True if it generated (the learner asks for its batch again at once), False when the
        buffer granted nothing or says stop (the learner's GET then sleeps its poll interval).
        """
        reply = self.client.credits(want=self.want)
        if reply["stop"] or reply["granted"] == 0:
            if not reply["stop"]:
                self.rollouts.flush()  # groups whose rewards came in meanwhile (--async_scoring)
            return False
        version = self.version  # the learner's: it does not change while its GET waits on this call
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            stats = self.rollouts.step(reply["granted"])
        finally:
            self.model.train(was_training)
        self.generate_s += time.perf_counter() - t0
        self.groups += reply["granted"]
        self.metrics.scalars(stats, step=version)
        log.info("%s: generated %d groups at policy version %d while waiting for data", self.name,
                 reply["granted"], version)
        return True

    def summary(self) -> dict:
        """``{name, actor_id, groups, generate_s, long_prompts_skipped, reward_timeouts}`` so far."""
        return {"name": self.name, "actor_id": self.actor_id, "groups": self.groups, "generate_s": self.generate_s,
                "long_prompts_skipped": self.rollouts.long_prompts.skipped,
                "reward_timeouts": self.rollouts.reward_timeouts}

    def close(self) -> None:
        """Close its TensorBoard writer, the buffer client and the --reward workers (the task's math_verify)."""
        self.metrics.close()
        self.client.close()
        self.rollouts.close()


def generator_name(rank: int) -> str:
    """The sender name of learner ``rank``'s generator: ``learner<rank>@<host>`` (group ids start with it)."""
    return f"learner{rank}@{socket.gethostname()}"
