"""The rollout actor loop: credits -> newest weights -> generate -> score -> advantages -> PUT.

One actor owns one engine. Each turn it asks the buffer for credits (one credit = one group). The
reply carries the oldest policy version the learners can still use (`min_policy_version`); the actor
loads the newest announced version between generate calls, and waits for one if it serves an older
version than that. The engine yields each group as soon as its last completion ends
(``Engine.generate_groups``): the actor scores it and PUTs it then, while the other groups of the call
go on generating. A group's completions carry the version of its first token (`policy_version`) and of
its last (`last_policy_version`: they differ only with `--inflight_update finish`, which loads versions
between decode steps; an engine that records no per-completion versions gives the call's start and the
version served when the group ended). The loop ends when the buffer's credit reply says ``stop`` (the
learners are done).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa

from distrl.core.advantages import group_advantages
from distrl.core.metrics import Metrics
from distrl.core.rows import table_from_rows
from distrl.core.run_options import BatchOptions, SharedOptions
from distrl.core.startup import mark
from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions
from distrl.rollout.engines.base import PromptResult
from distrl.rollout.prompt_fit import LongPrompts, prompt_limit
from distrl.rollout.reward_workers import DEFAULT_WORKERS
from distrl.rollout.rewards import UserReward, apply_truncation, timed_out
from distrl.weights import LoadOptions, WeightError, WeightSubscriber, transport
from distrl.weights.attest import Stamper

log = logging.getLogger("distrl.actor")


class VersionBoundary(Exception):
    """Raised between decode steps to abort a generate call when a newer version is announced."""


@dataclass
class ActorEndpoints:
    buffer: str
    weights_pub: str
    weights_latest: str


LOAD_ATTEMPTS = 3  # versions tried in one refresh when a load fails (each newer than the one before)


class RolloutActor:
    """Runs one actor's loop; `run()` returns a summary dict when the buffer says stop.

    Its inputs are the rollout's config sections (distrl/rollout/config.py: ``prompt``, ``generation`` and
    ``rollout``, the actor's own; None for a generator on a learner's engine, which reads none of it), the
    foundation's (distrl/core/run_options.py: ``shared``, ``batch``), ``resumed`` (the run continues an earlier one)
    and the objects assembled for it; never a command's config. ``endpoints``: the
    buffer's and the learner's addresses, or a callable that returns them, called once the engine is loaded and
    warmed up (``distrl train`` starts its actors while the learners load).
    """

    @property
    def version(self) -> int:
        """The policy version this actor serves: its engine's, the one owner (``colocated`` reads its learner's)."""
        return self.engine.version

    def __init__(self, prompt: PromptOptions, generation: TaskOptions, rollout: RolloutOptions | None,
                 shared: SharedOptions, batch: BatchOptions, actor_id: int, endpoints: ActorEndpoints | Callable,
                 model_dir: str, work_dir: str, tb_dir: str | None = None, rejoin: bool = False, engine=None,
                 name: str | None = None, resumed: bool = False):
        from distrl.core.buffer_client import BufferClient
        from distrl.rollout.engines import make_engine
        from distrl.rollout.tasks import load_task

        self.prompt, self.generation, self.rollout, self.shared, self.batch = prompt, generation, rollout, shared, batch
        self.actor_id, self.name = actor_id, name or f"actor{actor_id}"  # the name: also its sender name
        workers = generation.reward_workers or DEFAULT_WORKERS  # child processes that score in parallel
        self.task = load_task(prompt.task, prompt.dataset, seed=shared.seed, arith_ops=prompt.arith_ops,
                              arith_max_operand=prompt.arith_max_operand, verify_workers=workers)
        self.task.set_prompt(prompt.prompt_template, prompt.chat_template)  # held-out problems: left out of the stream
        heldout = self.task.heldout(generation.eval_size, shared.seed) if generation.eval_every else []
        # [(completion_text, completion_ids, problem)] -> [(reward, components)], a hand-back's at once
        self.rewards, self.user_reward = self.task.rewards, None
        if generation.reward is not None:  # import and call it once now: a bad --reward fails here, not mid-run
            self.user_reward = UserReward(generation.reward, generation.reward_timeout_s, workers)
            self.user_reward.check(next(self.task.problems(seed=0)))
            self.rewards = self.user_reward.score_many
        # a given engine (distrl.rollout.colocated shares the learner's model) never changes weights mid-call
        self.inflight_update = "off"
        if engine is None:
            engine = make_engine(rollout.engine, model_dir, shared.tokenizer, shared.dtype, shared.lora_rank,
                                 shared.max_model_len, seed=shared.seed * 1000 + actor_id,
                                 merge_lora=rollout.merge_lora, batching=generation.batching,
                                 max_num_seqs=generation.max_num_seqs, lora=shared.finetune == "lora",
                                 gpu_memory_utilization=rollout.gpu_memory_utilization)
            self.inflight_update = rollout.inflight_update
        self.engine = engine
        mark("engine_ready")  # start-up marks (distrl.core.startup)
        engine.warm_up()  # compiles now (CUDA), while distrl train's learners load, not in the first rollouts
        mark("engine_warm")
        if callable(endpoints):  # distrl train: the learner's weight endpoints, known once it is up
            endpoints = endpoints()
        mark("learner_endpoints")
        self.task.prompt(next(self.task.problems(seed=0)), self.engine.tokenizer)  # --chat_template on: checked
        limit = prompt_limit(shared.max_model_len, shared.max_new_tokens, engine.max_model_len)
        self.long_prompts = LongPrompts(self.task, engine.tokenizer, policy=generation.long_prompts, limit=limit,
                                        max_new_tokens=shared.max_new_tokens)
        # (problem, prompt text, prompt ids) of the prompts that fit (--long_prompts: long ones skipped or cut)
        self.problems = self.long_prompts.stream(self.task.problems(seed=shared.seed * 1000 + actor_id))
        self.position = 0  # problems taken from the stream so far; sampling seeds derive from it
        self.client = BufferClient(endpoints.buffer, self.name, curve_server_key=shared.buffer_curve_server_key,
                                   curve_client_key=shared.buffer_curve_client_key)
        if resumed or rejoin:  # resumed, or restarted after a crash: none of an acknowledged group's seeds reused
            self._skip_used_problems()
        self.long_prompts.skipped = self.long_prompts.truncated = 0  # count the ones met while generating
        self.evaluator = self._periodic_eval(heldout, work_dir) if heldout and actor_id == 0 else None
        self._connect_weights(endpoints, work_dir)
        self.digest = ""  # the verified digest of the payload the engine serves ("": version 0, nothing loaded)
        self.stamps = Stamper(self.engine.canary_logprob, shared.attest_weights)  # distrl.weights.attest
        self.metrics = Metrics(tb_dir)
        self._seq = 0
        self.aborted_calls = 0  # generate calls dropped at a version boundary (--inflight_update abort)
        self.weight_wait_s = 0.0  # time blocked waiting for a new enough policy version
        self.tokens = 0  # completion tokens generated
        self.reward_timeouts = 0  # completions whose reward ran past its time limit and scored 0
        self._samples_version = -1  # last policy version whose samples were logged (actor 0)

    def _periodic_eval(self, heldout: list, work_dir: str):
        """Actor 0 with --eval_every: a distrl.rollout.evaluation.PeriodicEval of the held-out problems whose
        prompts fit whole (a long one would stop the engine; it is left out, not cut); None if none fits."""
        from distrl.rollout.evaluation import PeriodicEval

        kept = [p for p in heldout if self.long_prompts.fits(p)]
        if len(kept) < len(heldout):
            log.warning("%s: %d of the %d held-out problems are longer as templated than the %s prompt tokens "
                        "--max_model_len leaves: evaluated without them", self.name, len(heldout) - len(kept),
                        len(heldout), self.long_prompts.limit)
        if not kept:
            return None
        return PeriodicEval(self.generation.eval_every, self.task, kept, Path(work_dir) / "eval.jsonl",
                            num_samples=self.rollout.eval_num_samples, temperature=self.rollout.eval_temperature,
                            max_new_tokens=self.shared.max_new_tokens, seed=self.shared.seed)

    def _connect_weights(self, endpoints: ActorEndpoints, work_dir: str) -> None:
        """Subscribe to the learner's announcements and set up the weight loader of --weights_transport."""
        shared = self.shared
        self.weights = WeightSubscriber(endpoints.weights_pub, endpoints.weights_latest, self.name)
        try:  # a late or restarted actor starts from the current version, not from version 0
            self.weights.request_latest(timeout_s=10)
        except TimeoutError:
            log.warning("%s: no weight endpoint answer yet at %s: starting from version 0", self.name,
                        endpoints.weights_latest)
        options = LoadOptions(endpoints.weights_latest, Path(work_dir) / "weights_cache" / self.name,
                              rank=1 + self.actor_id, actors=shared.number_of_actors,
                              broadcast_port=shared.weights_broadcast_port, device=self.engine.device)
        self.loader = transport(shared.weights_transport).loader(options, self.weights)

    def _refresh_weights(self, min_version: int, target=None) -> None:
        """Serve the newest announced version (or the announcement `target`); block until one >= min_version exists."""
        if self.weights.newest.version < min_version:
            t0 = time.perf_counter()
            self.weights.wait_for(min_version, timeout_s=600, should_stop=lambda: False)
            self.weight_wait_s += time.perf_counter() - t0
        ann = self.weights.poll() if target is None else target
        if ann.version <= self.version:
            return
        t0, served = time.perf_counter(), self.version
        for attempt in range(LOAD_ATTEMPTS):
            try:
                ann = self.loader.load(ann, self.engine)  # what is now served (a broadcast may carry a newer one)
                break
            except WeightError as exc:  # e.g. pruned while loading (a joiner on a fast run): take a newer one now
                newer = self.weights.poll()
                if newer.version <= ann.version or attempt == LOAD_ATTEMPTS - 1:
                    log.error("%s: refusing policy version %d (%s); still serving %d", self.name, ann.version, exc,
                              self.version)
                    return
                log.warning("%s: policy version %d unusable (%s); loading %d", self.name, ann.version, exc,
                            newer.version)
                ann = newer
        self.digest = ann.digest
        self.stamps.served(ann.version, ann.digest)  # the canary of the loaded weights, once per load
        log.info("%s: switched from policy version %d to %d (%s, digest %s)", self.name, served,
                 ann.version, ann.format, ann.digest[:12])
        self.metrics.scalars({"actor/policy_version": ann.version, "actor/weight_load_s": time.perf_counter() - t0,
                              "actor/publish_to_serve_s": time.time() - ann.published_at,
                              "actor/weight_mb_fetched": self.loader.bytes_fetched / 2**20,
                              "actor/canary_s": self.stamps.canary_s}, step=ann.version)

    def _skip_used_problems(self) -> None:
        """Resumed or restarted: skip the problems of this actor's groups that the buffer accepted (it counts
        them per actor id, rebuilt from its segment log after its own restart; no file is read here, so
        the buffer may be on another host), so that the position-derived seeds of acknowledged groups are
        not reused. Raises TimeoutError if the buffer does not answer."""
        used = self.client.acked_groups(self.actor_id)
        for _ in range(used):
            next(self.problems)
        self.position = used
        log.info("%s: resuming after the %d problems its groups already used (the buffer's count)", self.name, used)

    def _serve_final(self) -> None:
        """Load the last announced version if the learner still answers (it may already be gone)."""
        try:
            latest = self.weights.request_latest(timeout_s=5).version
            self._serve_skipped_eval_version()
            self._refresh_weights(latest)
        except (TimeoutError, WeightError) as exc:
            log.warning("%s: final version not loaded (%s); serving %d", self.name, exc, self.version)
        self._evaluate_if_due(final=True)

    def _evaluate_if_due(self, final: bool = False) -> None:
        """Actor 0 with --eval_every: evaluate the served version if due (distrl/rollout/evaluation.py)."""
        if self.evaluator is not None and self.evaluator.due(self.version, final):
            self.evaluator.evaluate(self.engine, self.metrics)

    def _serve_skipped_eval_version(self) -> None:
        """Actor 0 with --eval_every: when the newest version has passed a multiple of N this actor never
        served, serve and evaluate that one first (when the transport still keeps its payload)."""
        if self.evaluator is None or not self.loader.retains_versions:
            return
        target = self.evaluator.skipped(self.version, self.weights.poll().version)
        if target is not None and target in self.weights.seen:
            self._refresh_weights(0, self.weights.seen[target])
            self._evaluate_if_due()

    def _generate(self, prompts: list[list[int]], seed: int) -> Iterator[list[tuple[int, PromptResult, tuple]]]:
        """Generate with the served version, yielding each group as its last completion ends (the engine's
        ``generate_groups``): lists of (prompt index, result, (policy_version, last_policy_version)).

        With --inflight_update `finish`, a newer version is loaded between decode steps and the running
        completions go on with it; a group's versions are those of its first and last tokens. `abort`:
        the call is dropped, the newer version loaded, and the prompts whose groups were not yet yielded
        generated again.
        """
        left = list(range(len(prompts)))
        while left:
            start_version = self.version
            base = start_version - self.engine.version  # 0, or the learner's version for a shared engine
            self.stamps.start(start_version, self.digest)
            hook = None if self.inflight_update == "off" else self._between_steps
            done: set[int] = set()
            try:
                for finished in self.engine.generate_groups([prompts[i] for i in left], self.batch.group_size,
                                                            self.shared.temperature, self.shared.max_new_tokens,
                                                            between_steps=hook, seed=seed):
                    done.update(left[j] for j, _ in finished)
                    yield [(left[j], result, _versions(result, base, start_version, self.version))
                           for j, result in finished]
                return
            except VersionBoundary:
                self.aborted_calls += 1
                left = [i for i in left if i not in done]
                self._refresh_weights(0)

    def _between_steps(self) -> None:
        if self.weights.poll().version > self.version:
            if self.inflight_update == "abort":
                raise VersionBoundary
            self._refresh_weights(0)  # in place: the running completions continue with it

    def _make_groups(self, finished, problems, prompts, t0: float, gen_s: float) -> list[pa.Table]:
        """The Arrow rows of each ended group of a hand-back (``(prompt index, result, versions)``): every
        completion scored in one :attr:`rewards` call (in parallel where the scorer runs child processes)."""
        items = [(c.text, c.token_ids, problems[i]) for i, result, _ in finished for c in result.completions]
        scored, at = self.rewards(items), 0
        timeouts = timed_out(scored)
        if timeouts and not self.reward_timeouts:  # the first one says so; all are counted (actor/reward_timeouts)
            limit = (f"--reward_timeout_s {self.generation.reward_timeout_s}" if self.user_reward else
                     f"math_verify's {self.task.verifier.timeout_s} s limit")
            log.warning("%s: %d rewards ran past %s and scored 0 (component `timeout`); counted in TensorBoard "
                        "actor/reward_timeouts and summary.json's reward_timeouts", self.name, timeouts, limit)
        self.reward_timeouts += timeouts
        groups = []
        for i, result, versions in finished:
            n = len(result.completions)
            groups.append(self._make_group(problems[i], prompts[i], result, t0, gen_s, versions, scored[at:at + n]))
            at += n
        return groups

    def _make_group(self, problem, prompt_text: str, result, t0: float, gen_s: float,
                    versions: tuple[int, int], scored: list[tuple[float, dict]]) -> pa.Table:
        """One prompt's group: its completions' ``scored`` rewards under --truncation, the group's advantages,
        its Arrow rows. ``versions``: the policy versions of the group's first and last tokens; ``gen_s``:
        seconds from the call's start to the group's end."""
        comps = result.completions
        scored = [apply_truncation(r, comp, c.finish_reason, self.shared.truncation)
                  for c, (r, comp) in zip(comps, scored)]
        rewards = [r for r, _ in scored]
        advantages = group_advantages(rewards, self.shared.advantage_estimator)
        self._seq += 1
        group_id = f"{self.name}-{self._seq}-{uuid.uuid4().hex[:8]}"
        stamp = self.stamps.fields()  # the versions this call served, their digests and canaries
        stamp = _served_within(stamp, *versions)  # continuous batching: those this group's tokens saw
        rows = [dict(**stamp, sample_id=f"{group_id}-{i}", group_id=group_id, prompt_id=problem.prompt_id,
                     actor_id=self.actor_id, policy_version=versions[0], last_policy_version=versions[1],
                     prompt_ids=result.prompt_ids, completion_ids=c.token_ids, behavior_logprobs=c.logprobs,
                     temperature=self.shared.temperature, reward=r, reward_components=comp, advantage=a,
                     finish_reason=c.finish_reason, prompt_text=prompt_text, completion_text=c.text,
                     gen_start_time=t0, gen_seconds=gen_s)
                for i, (c, (r, comp), a) in enumerate(zip(comps, scored, advantages))]
        return table_from_rows(rows)

    def step(self, granted: int) -> dict:
        """Generate, score and PUT `granted` groups with the served version; return step metrics."""
        problems, prompts, prompt_ids = zip(*(next(self.problems) for _ in range(granted)))
        # Prompt i of this call samples with seeds seed + i * group_size + j (vLLM's n > 1 uses seed + j),
        # so no two completions of a run share a seed.
        seed = (self.shared.seed * 100_003 + self.actor_id) * 2**32 + self.position * self.batch.group_size
        self.position += granted
        t0, c0 = time.time(), time.perf_counter()
        start_version, groups, results = self.version, [], []
        for finished in self._generate(list(prompt_ids), seed):  # PUT each group as soon as it ends
            ended = self._make_groups(finished, problems, prompts, t0, time.perf_counter() - c0)
            self.client.put_many(ended)  # one message, acknowledged once every group is in the segment log
            groups += ended
            results += [result for _, result, _ in finished]
        gen_s = time.perf_counter() - c0
        rewards = [r for g in groups for r in g.column("reward").to_pylist()]
        tokens = sum(len(c.token_ids) for result in results for c in result.completions)
        self.tokens += tokens
        reasons = [f for g in groups for f in g.column("finish_reason").to_pylist()]
        if self.actor_id == 0 and self.rollout.log_samples and start_version != self._samples_version:
            self._samples_version = start_version
            self.metrics.text("actor/samples", samples_markdown(groups, self.rollout.log_samples), step=start_version)
        return {"actor/reward_mean": sum(rewards) / len(rewards), "actor/tokens_per_s": tokens / gen_s,
                "actor/truncated_fraction": reasons.count("length") / len(reasons),
                "actor/groups": granted, "actor/generate_s": gen_s, "actor/aborted_calls": self.aborted_calls,
                "actor/reward_timeouts": self.reward_timeouts,  # cumulative, like aborted_calls
                "actor/inflight_versions": self.version - start_version,
                "actor/graph_captures": self.engine.graph_captures(),  # cumulative (engines' graph captures)
                "rollout/long_prompts_skipped": self.long_prompts.skipped,
                "rollout/long_prompts_truncated": self.long_prompts.truncated}

    def run(self) -> dict:
        groups, idle_s, start = 0, 0.0, time.perf_counter()
        self._evaluate_if_due()  # version 0, before any update
        while True:
            reply = self.client.credits(want=max(1, self.batch.batch_size // self.shared.number_of_actors))
            if reply.get("stop"):  # training is over: serve the final version, then return
                self._serve_final()
                break
            if reply["granted"] == 0:
                newest = self.weights.poll()
                if newest.version > self.version:  # idle: take the newest version now (a broadcast
                    self._refresh_weights(newest.version)  # transport's round waits for this actor)
                    continue
                time.sleep(0.05)
                idle_s += 0.05
                continue
            self._serve_skipped_eval_version()
            self._refresh_weights(reply["min_policy_version"])
            self._evaluate_if_due()
            timeouts = self.reward_timeouts
            stats = self.step(reply["granted"])
            groups += reply["granted"]
            wall = time.perf_counter() - start
            stats.update({"actor/idle_fraction": (idle_s + self.weight_wait_s) / wall,
                          "actor/credit_wait_fraction": idle_s / wall,
                          "actor/weight_wait_fraction": self.weight_wait_s / wall,
                          "actor/tokens_per_s_wall": self.tokens / wall})
            self.metrics.scalars(stats, step=self.version)
            if self.reward_timeouts > timeouts:  # on disk now, not within 10 s: distrl train's console warns
                self.metrics.flush()
        self.metrics.close()
        log.info("%s: stopped after %d groups, last policy version %d", self.name, groups, self.version)
        return {"actor_id": self.actor_id, "groups": groups, "last_version": self.version,
                "long_prompts_skipped": self.long_prompts.skipped,
                "long_prompts_truncated": self.long_prompts.truncated, "reward_timeouts": self.reward_timeouts}

    def close(self) -> None:
        """Tell the buffer this actor leaves (its unused credits return at once; it may be gone already), then
        close the buffer client, the --reward worker, the weight loader and subscriber."""
        try:
            log.info("%s: left the run; the buffer returned %d unused credits", self.name, self.client.leave())
        except (TimeoutError, RuntimeError) as exc:  # a buffer already shut down, or one without LEAVE
            log.info("%s: could not tell the buffer it leaves (%s)", self.name, exc)
        self.client.close()
        if self.user_reward is not None:
            self.user_reward.close()
        if getattr(self.task, "verifier", None) is not None:  # its math_verify children
            self.task.verifier.close()
        self.loader.close()
        self.weights.close()


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
