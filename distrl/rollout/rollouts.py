"""One rollout step, whoever generates: prompts -> generate -> score -> group advantages -> PUT.

:class:`Rollouts` is the part of the actor loop that knows neither weights nor credits: it takes prompts from
the task's stream, generates ``group_size`` completions per prompt with its engine, scores them, computes each
group's advantages and PUTs every group as soon as its last completion ends (``Engine.generate_groups``), the
rows stamped with the policy version served (``version``, read at each use: the one owner is the engine for a
:class:`distrl.rollout.actor.RolloutActor`, the learner for a
:class:`distrl.rollout.learner_generates.LearnerGenerator`). Both hold one and call :meth:`Rollouts.step` once
their buffer granted credits; the actor also passes ``between_steps`` (``--inflight_update``: new weights between
decode steps) and ``on_boundary`` (load the newer version after an aborted call).

With ``--env`` a completion is an episode: :class:`distrl.rollout.envs.episodes.EpisodeRunner` plays its turns with
the engine and the environment, its row carries ``turn_ends`` and ``loss_mask``, and its reward is the
environment's final reward (an episode ended by an environment's error gets no advantage).

A group's completions carry the version of its first token (``policy_version``) and of its last
(``last_policy_version``: they differ only with ``--inflight_update finish``; an engine that records no
per-completion versions gives the call's start and the version served when the group ended).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple

import pyarrow as pa

from distrl.core.advantages import group_advantages
from distrl.core.buffer_client import BufferApi
from distrl.core.metrics import Metrics
from distrl.core.rows import table_from_rows
from distrl.core.run_options import BatchOptions, SharedOptions
from distrl.rollout.config import PromptOptions, TaskOptions
from distrl.rollout.engines.base import PromptResult
from distrl.rollout.prompt_fit import LongPrompts, prompt_limit
from distrl.rollout.reward_workers import DEFAULT_WORKERS
from distrl.rollout.rewards import UserReward, apply_truncation, timed_out
from distrl.rollout.scoring import Scoring
from distrl.weights.attest import Stamper

log = logging.getLogger("distrl.actor")


class VersionBoundary(Exception):
    """Raised between decode steps to abort a generate call when a newer version is announced."""


class TaskParts(NamedTuple):
    """What :func:`load_task` makes of the prompt and task sections."""

    task: Any  # a distrl.rollout.tasks task, its prompt template set
    rewards: Callable  # [(completion_text, completion_ids, problem)] -> [(reward, components)]
    user_reward: UserReward | None  # the --reward scorer ``rewards`` is (None: the task's own)
    heldout: list  # --eval_every's held-out problems, left out of every generator's stream (else [])


def load_task(prompt: PromptOptions, generation: TaskOptions, shared: SharedOptions) -> TaskParts:
    """The task of the ``prompt`` section (problems, template) and its scorer (the ``generation`` section's
    --reward, or the task's own); ``shared``: the seed. A --reward is imported and called once now: a bad one
    fails here, not mid-run. With --eval_every the held-out problems are taken out of the task's stream now,
    before any problem is."""
    from distrl.rollout.tasks import load_task as load

    workers = generation.reward_workers or DEFAULT_WORKERS  # child processes that score in parallel
    task = load(prompt.task, prompt.dataset, seed=shared.seed, arith_ops=prompt.arith_ops,
                arith_max_operand=prompt.arith_max_operand, verify_workers=workers)
    task.set_prompt(prompt.prompt_template, prompt.chat_template)
    rewards, user_reward = task.rewards, None
    if generation.reward is not None:
        user_reward = UserReward(generation.reward, generation.reward_timeout_s, workers)
        user_reward.check(next(task.problems(seed=0)))
        rewards = user_reward.score_many
    heldout = task.heldout(generation.eval_size, shared.seed) if generation.eval_every else []
    return TaskParts(task, rewards, user_reward, heldout)


class Rollouts:
    """Generates, scores and PUTs groups for one generator (see the module docstring).

    Args:
        generation: the task section (long_prompts, reward_timeout_s).
        shared: the sampling options (temperature, max_new_tokens, max_model_len, truncation, seed,
            attest_weights, advantage_estimator).
        batch: the batch's shape (group_size: completions per prompt).
        actor_id: the rows' ``actor_id``; its prompt stream and sampling seeds derive from it.
        name: the generator's name (group ids start with it).
        engine: the generation engine (:mod:`distrl.rollout.engines`).
        task: :func:`load_task`'s parts.
        client: the buffer (:class:`distrl.core.buffer_client.BufferApi`) groups are PUT to.
        metrics: where ``actor/samples`` go (actor 0, ``--log_samples``).
        version: the policy version served now.
        between_steps: called between decode steps (None: weights never change mid-call); it raises
            VersionBoundary to abort the call, after which ``on_boundary`` is called and the prompts whose groups
            were not yet PUT are generated again.
        log_samples: completions actor 0 logs to ``actor/samples`` per version (an actor's --log_samples; 0: none).
    """

    def __init__(self, generation: TaskOptions, shared: SharedOptions, batch: BatchOptions, actor_id: int,
                 name: str, engine, task: TaskParts, client: BufferApi, metrics: Metrics,
                 version: Callable[[], int], between_steps: Callable[[], None] | None = None,
                 on_boundary: Callable[[], None] | None = None, log_samples: int = 0) -> None:
        self.generation, self.shared, self.batch, self.log_samples = generation, shared, batch, log_samples
        self.actor_id, self.name, self.engine, self.client, self.metrics = actor_id, name, engine, client, metrics
        self.task, self.rewards, self.user_reward = task.task, task.rewards, task.user_reward
        task = task.task
        self.version, self.between_steps, self.on_boundary = version, between_steps, on_boundary
        task.prompt(next(task.problems(seed=0)), engine.tokenizer)  # --chat_template on: checked
        self.long_prompts = LongPrompts(task, engine.tokenizer, policy=generation.long_prompts,
                                        limit=prompt_limit(shared.max_model_len, shared.max_new_tokens,
                                                           engine.max_model_len),
                                        max_new_tokens=shared.max_new_tokens)
        # (problem, prompt text, prompt ids) of the prompts that fit (--long_prompts: long ones skipped or cut)
        self.problems = self.long_prompts.stream(task.problems(seed=shared.seed * 1000 + actor_id))
        self.position = 0  # problems taken from the stream so far; sampling seeds derive from it
        self.digest = ""  # the verified digest of the payload the engine serves ("": nothing loaded)
        self.stamps = Stamper(engine.canary_logprob, shared.attest_weights)  # distrl.weights.attest
        self._seq = itertools.count(1)  # group ids' sequence (next() is atomic: scoring threads take from it)
        self.scoring = Scoring(generation.async_scoring)  # hand-backs scored now or while decoding on
        self.aborted_calls = 0  # generate calls dropped at a version boundary (--inflight_update abort)
        self.tokens = 0  # completion tokens generated
        self.reward_timeouts = 0  # completions whose reward ran past its time limit and scored 0
        self._samples_version = -1  # last policy version whose samples were logged (actor 0)
        self.episodes = None  # --env: the episode loop (distrl.rollout.envs.episodes)
        if generation.env is not None:
            from distrl.rollout.envs.episodes import EpisodeRunner

            chat = task.chat != "off" and bool(getattr(engine.tokenizer, "chat_template", None))
            self.episodes = EpisodeRunner(engine, generation, shared.max_new_tokens, chat)
            self.episodes.check(next(task.problems(seed=0)))  # a bad --env fails here, not mid-run

    def skip(self, used: int) -> None:
        """Skip the first ``used`` problems of the stream (a resumed actor's acknowledged groups used them), so
        that their position-derived seeds are not reused; counters of long prompts start again after them."""
        for _ in range(used):
            next(self.problems)
        self.position = used
        self.long_prompts.skipped = self.long_prompts.truncated = 0

    def served(self, version: int, digest: str) -> None:
        """The engine now serves ``version`` (its payload's verified ``digest``): stamped from now on."""
        self.digest = digest
        self.stamps.served(version, digest)  # the canary of the loaded weights, once per load

    def step(self, granted: int) -> dict:
        """Generate, score and PUT ``granted`` groups with the served version; return step metrics."""
        problems, prompts, prompt_ids = zip(*(next(self.problems) for _ in range(granted)))
        # Prompt i of this call samples with seeds seed + i * group_size + j (vLLM's n > 1 uses seed + j),
        # so no two completions of a run share a seed.
        seed = (self.shared.seed * 100_003 + self.actor_id) * 2**32 + self.position * self.batch.group_size
        self.position += granted
        t0, c0 = time.time(), time.perf_counter()
        start_version, groups, results = self.version(), [], []
        for finished in self._generate(list(prompt_ids), seed, problems):  # PUT each group as soon as it's scored
            stamp, gen_s = self.stamps.fields(), time.perf_counter() - c0  # the call's served versions, digests
            for part in [finished] if not self.scoring.limit else [[one] for one in finished]:  # async: by group
                job = partial(self._make_groups, part, problems, prompts, t0, gen_s, stamp)
                groups += self._put(self.scoring.submit(job, len(part)))
            results += [result for _, result, _ in finished]
        groups += self._put(self.scoring.collect())
        gen_s = time.perf_counter() - c0
        tokens = sum(len(c.token_ids) for result in results for c in result.completions)
        self.tokens += tokens
        if groups and self.actor_id == 0 and self.log_samples and start_version != self._samples_version:
            self._samples_version = start_version
            self.metrics.text("actor/samples", samples_markdown(groups, self.log_samples), step=start_version)
        return {**_put_stats(groups), "actor/tokens_per_s": tokens / gen_s,
                "actor/scoring_waiting": self.scoring.waiting(),  # groups awaiting rewards (--async_scoring)
                "actor/groups": granted, "actor/generate_s": gen_s, "actor/aborted_calls": self.aborted_calls,
                "actor/reward_timeouts": self.reward_timeouts,  # cumulative, like aborted_calls
                "actor/inflight_versions": self.version() - start_version,
                "actor/graph_captures": self.engine.graph_captures(),  # cumulative (engines' graph captures)
                "rollout/long_prompts_skipped": self.long_prompts.skipped,
                "rollout/long_prompts_truncated": self.long_prompts.truncated, **self._episode_stats()}

    def flush(self) -> int:
        """PUT the groups whose rewards came in since the last step (``--async_scoring``); returns how many."""
        return len(self._put(self.scoring.collect()))

    def _put(self, scored: list[tuple[list[pa.Table], int]]) -> list[pa.Table]:
        """PUT each scoring job's groups (one message a job, acknowledged once every group is in the segment
        log) and count its reward timeouts; the groups PUT."""
        groups = []
        for tables, timeouts in scored:
            if timeouts and not self.reward_timeouts:  # the first one says so; all are counted (actor/reward_timeouts)
                limit = (f"--reward_timeout_s {self.generation.reward_timeout_s}" if self.user_reward else
                         f"math_verify's {self.task.verifier.timeout_s} s limit")
                log.warning("%s: %d rewards ran past %s and scored 0 (component `timeout`); counted in TensorBoard "
                            "actor/reward_timeouts and summary.json's reward_timeouts", self.name, timeouts, limit)
            self.reward_timeouts += timeouts
            self.client.put_many(tables)
            groups += tables
        return groups

    def _episode_stats(self) -> dict:
        """--env: cumulative episode counts (errors: an environment's error, crash or timeout; cut: a limit)."""
        if self.episodes is None:
            return {}
        e = self.episodes
        return {"actor/env_errors": e.errors, "actor/env_cut": e.cut, "actor/turns_mean": e.turns / max(e.episodes, 1)}

    def _generate(self, prompts: list[list[int]], seed: int,
                  problems) -> Iterator[list[tuple[int, PromptResult, tuple]]]:
        """Generate with the served version, yielding each group as its last completion ends (the engine's
        ``generate_groups``): lists of (prompt index, result, (policy_version, last_policy_version)).

        With ``between_steps`` (--inflight_update), a newer version may be loaded between decode steps and the
        running completions go on with it; a group's versions are those of its first and last tokens. When it
        raises VersionBoundary (`abort`) the call is dropped, ``on_boundary`` loads the newer version, and the
        prompts whose groups were not yet yielded are generated again.
        """
        left = list(range(len(prompts)))
        while left:
            start_version = self.version()
            base = start_version - self.engine.version  # 0, or the learner's version for a shared engine
            self.stamps.start(start_version, self.digest)
            done: set[int] = set()
            if self.episodes is None:
                calls = self.engine.generate_groups([prompts[i] for i in left], self.batch.group_size,
                                                    self.shared.temperature, self.shared.max_new_tokens,
                                                    between_steps=self.between_steps, seed=seed)
            else:
                calls = self.episodes.run([problems[i] for i in left], [prompts[i] for i in left],
                                          self.batch.group_size, self.shared.temperature, seed=seed,
                                          between_steps=self.between_steps)
            try:
                for finished in calls:
                    done.update(left[j] for j, _ in finished)
                    yield [(left[j], result, _versions(result, base, start_version, self.version()))
                           for j, result in finished]
                return
            except VersionBoundary:
                self.aborted_calls += 1
                left = [i for i in left if i not in done]
                self.on_boundary()

    def _make_groups(self, finished, problems, prompts, t0: float, gen_s: float,
                     stamp: dict) -> tuple[list[pa.Table], int]:
        """The Arrow rows of each ended group of a hand-back (``(prompt index, result, versions)``), every
        completion scored in one :attr:`rewards` call (in parallel where the scorer runs child processes), and
        how many rewards timed out. ``stamp``: the attestation fields of the call (Stamper.fields). Runs in a
        scoring thread with --async_scoring: it reads no state the actor's thread changes."""
        items = [(c.text, c.token_ids, problems[i]) for i, result, _ in finished for c in result.completions]
        if self.episodes is not None:  # an episode's reward is its environment's
            scored, at = [(c.reward, c.components) for _, result, _ in finished for c in result.completions], 0
        else:
            scored, at = self.rewards(items), 0
        groups = []
        for i, result, versions in finished:
            n = len(result.completions)
            groups.append(self._make_group(problems[i], prompts[i], result, t0, gen_s, versions, scored[at:at + n],
                                           stamp))
            at += n
        return groups, timed_out(scored)

    def _make_group(self, problem, prompt_text: str, result, t0: float, gen_s: float,
                    versions: tuple[int, int], scored: list[tuple[float, dict]], stamp: dict) -> pa.Table:
        """One prompt's group: its completions' ``scored`` rewards under --truncation, the group's advantages,
        its Arrow rows. ``versions``: the policy versions of the group's first and last tokens; ``gen_s``:
        seconds from the call's start to the group's end."""
        comps = result.completions
        scored = [apply_truncation(r, comp, c.finish_reason, self.shared.truncation)
                  for c, (r, comp) in zip(comps, scored)]
        advantages = _advantages([r for r, _ in scored], [c.finish_reason == "error" for c in comps],
                                 self.shared.advantage_estimator)
        group_id = f"{self.name}-{next(self._seq)}-{uuid.uuid4().hex[:8]}"
        stamp = _served_within(stamp, *versions)  # continuous batching: those this group's tokens saw
        rows = [dict(**stamp, sample_id=f"{group_id}-{i}", group_id=group_id, prompt_id=problem.prompt_id,
                     actor_id=self.actor_id, policy_version=versions[0], last_policy_version=versions[1],
                     prompt_ids=getattr(c, "prompt_ids", None) or result.prompt_ids, completion_ids=c.token_ids,
                     behavior_logprobs=c.logprobs, turn_ends=getattr(c, "turn_ends", None),
                     loss_mask=getattr(c, "loss_mask", None),
                     temperature=self.shared.temperature, reward=r, reward_components=comp, advantage=a,
                     finish_reason=c.finish_reason, prompt_text=prompt_text, completion_text=c.text,
                     gen_start_time=t0, gen_seconds=gen_s)
                for i, (c, (r, comp), a) in enumerate(zip(comps, scored, advantages))]
        return table_from_rows(rows)

    def close(self) -> None:
        """Close the scoring threads (groups still awaiting rewards are dropped, never acknowledged), the --reward
        worker processes, the task's math_verify children and the --env processes."""
        self.scoring.close()
        if self.episodes is not None:
            self.episodes.close()
        if self.user_reward is not None:
            self.user_reward.close()
        if getattr(self.task, "verifier", None) is not None:
            self.task.verifier.close()


def _put_stats(groups: list[pa.Table]) -> dict:
    """Mean reward and truncated fraction of the groups PUT in a step (none PUT: no keys)."""
    rewards = [r for g in groups for r in g.column("reward").to_pylist()]
    reasons = [f for g in groups for f in g.column("finish_reason").to_pylist()]
    if not rewards:
        return {}
    return {"actor/reward_mean": sum(rewards) / len(rewards),
            "actor/truncated_fraction": reasons.count("length") / len(reasons)}


def _advantages(rewards: list[float], errors: list[bool], estimator: str) -> list[float]:
    """The group's advantages over the completions not ended by an environment's error; those get 0."""
    if not any(errors):
        return group_advantages(rewards, estimator)
    kept = iter(group_advantages([r for r, e in zip(rewards, errors) if not e], estimator) if not all(errors) else [])
    return [0.0 if e else next(kept) for e in errors]


def _versions(result: PromptResult, base: int, start_version: int, version: int) -> tuple[int, int]:
    """A group's (policy_version, last_policy_version): ``base`` plus the engine versions of its first and
    last tokens (the HF engine records them), else the call's start version and the version served now."""
    stamped = [c.versions for c in result.completions if c.versions is not None]
    if not stamped:
        return start_version, version
    return base + min(v[0] for v in stamped), base + max(v[1] for v in stamped)


def _served_within(stamp: dict, first: int, last: int) -> dict:
    """The stamp fields (distrl.weights.attest.Stamper.fields) of the versions in [first, last] only (all of
    them when none is, or when stamps are off)."""
    served = stamp.get("served_versions")
    keep = [i for i, v in enumerate(served or []) if first <= v <= last]
    if not keep or len(keep) == len(served):
        return stamp
    return {k: [v[i] for i in keep] for k, v in stamp.items()}


def samples_markdown(groups: list[pa.Table], n: int) -> str:
    """Markdown of the first ``n`` completions of ``groups`` (one per group first, then more of each):
    reward, finish reason and policy version, then prompt and completion as code blocks (TensorBoard's
    Text tab renders markdown)."""
    rows = [g.slice(i, 1).to_pylist()[0] for i in range(max(len(g) for g in groups)) for g in groups if i < len(g)]

    def block(text: str) -> str:
        return "\n".join("    " + line for line in (text or " ").splitlines() or [" "])

    parts = [f"**reward {r['reward']:.3f}** (finish `{r['finish_reason']}`, policy version {r['policy_version']}, "
             f"prompt `{r['prompt_id']}`)\n\nprompt:\n\n{block(r['prompt_text'])}\n\ncompletion:\n\n"
             f"{block(r['completion_text'])}" for r in rows[:n]]
    return "\n\n---\n\n".join(parts)
