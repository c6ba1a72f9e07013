"""The rollout actor loop: credits -> newest weights -> generate -> score -> advantages -> PUT.

One actor owns one engine. Each turn it asks the buffer for credits (one credit = one group). The
reply carries the oldest policy version the learners can still use (`min_policy_version`); the actor
loads the newest announced version between generate calls, and waits for one if it serves an older
version than that. Then :class:`distrl.rollout.rollouts.Rollouts` makes the granted groups: the engine
yields each group as soon as its last completion ends (``Engine.generate_groups``), which is scored and
PUT then, while the other groups of the call go on generating (versions per completion: see that module;
`--inflight_update` loads versions between decode steps through this actor). The loop ends when the
buffer's credit reply says ``stop`` (the learners are done).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from distrl.core.buffer_client import BufferApi
from distrl.core.metrics import Metrics
from distrl.core.run_options import BatchOptions, SharedOptions
from distrl.core.startup import mark
from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions
from distrl.rollout.rollouts import Rollouts, VersionBoundary, load_task
from distrl.weights import LoadOptions, WeightError, WeightSubscriber, transport

log = logging.getLogger("distrl.actor")


@dataclass
class ActorEndpoints:
    buffer: str
    weights_pub: str
    weights_latest: str


LOAD_ATTEMPTS = 3  # versions tried in one refresh when a load fails (each newer than the one before)


class RolloutActor:
    """Runs one actor's loop; `run()` returns a summary dict when the buffer says stop.

    Its inputs are the rollout's config sections (distrl/rollout/config.py: ``prompt``, ``generation`` and
    ``rollout``, the actor's own), the foundation's (distrl/core/run_options.py: ``shared``, ``batch``),
    ``resumed`` (the run continues an earlier one) and the objects assembled for it; never a command's config.
    ``endpoints``: the buffer's and the learner's addresses, or a callable that returns them, called once the
    engine is loaded and warmed up (``distrl train`` starts its actors while the learners load; a first vLLM start
    calls it before its engine: :meth:`_start_engine`). ``client``: the buffer client
    (:class:`distrl.core.buffer_client.BufferApi`) to use instead of a :class:`BufferClient` of
    ``endpoints.buffer`` (tests: ``distrl.buffer.inprocess``). Each step is :class:`Rollouts`' (``rollouts``).
    """

    @property
    def version(self) -> int:
        """The policy version this actor serves: its engine's, the one owner."""
        return self.engine.version

    def _start_engine(self, rollout: RolloutOptions, generation: TaskOptions, shared: SharedOptions,
                      model_dir: str, endpoints):
        """The engine (--engine's), and ``endpoints`` resolved first where the engine must start after the
        learners: vLLM on CUDA the first time its settings start on this host (distrl.rollout.engines.vllm_plan)."""
        from distrl.rollout.engines import make_engine

        if rollout.engine == "hf":  # transformers' import, its own start-up mark (vLLM's: probed in make_engine)
            import distrl.rollout.engines.hf  # noqa: F401
        mark("engine_imported")
        settings = dict(model=model_dir, tokenizer=shared.tokenizer, dtype=shared.dtype, max_lora_rank=shared.lora_rank,
                        max_model_len=shared.max_model_len, seed=shared.seed * 1000 + self.actor_id,
                        merge_lora=rollout.merge_lora, batching=generation.batching,
                        max_num_seqs=generation.max_num_seqs, lora=shared.finetune == "lora",
                        gpu_memory_utilization=rollout.gpu_memory_utilization)
        if rollout.engine != "vllm":
            return make_engine(rollout.engine, **settings), endpoints
        from distrl.rollout.engines.vllm_plan import remember_start, started_before

        if callable(endpoints) and not started_before(settings):
            endpoints = endpoints()  # a first start profiles its memory: after the learners loaded theirs
        engine = make_engine(rollout.engine, **settings)
        remember_start(settings)
        return engine, endpoints

    def __init__(self, prompt: PromptOptions, generation: TaskOptions, rollout: RolloutOptions,
                 shared: SharedOptions, batch: BatchOptions, actor_id: int,
                 endpoints: ActorEndpoints | Callable[[], ActorEndpoints], model_dir: str, work_dir: str,
                 tb_dir: str | None = None, rejoin: bool = False, name: str | None = None, resumed: bool = False,
                 client: BufferApi | None = None):
        self.prompt, self.generation, self.rollout, self.shared, self.batch = prompt, generation, rollout, shared, batch
        self.actor_id = actor_id
        self.name = name or f"actor{actor_id}"  # also the sender name towards the buffer
        task = load_task(prompt, generation, shared)  # and --eval_every's held-out problems, left out of its stream
        mark("task_loaded")
        self.inflight_update = rollout.inflight_update
        self.engine, endpoints = self._start_engine(rollout, generation, shared, model_dir, endpoints)
        mark("engine_ready")  # start-up marks (distrl.core.startup)
        # compiles now (CUDA), while distrl train's learners load, not in the first rollouts; sized for the larger of
        # a step's rows and an evaluation's
        evaluation = len(task.heldout) * rollout.eval_num_samples if actor_id == 0 else 0
        self.engine.warm_up(rows=max(self._want(batch, shared) * batch.group_size, evaluation))
        mark("engine_warm")
        if callable(endpoints):  # distrl train: the learner's weight endpoints, known once it is up
            endpoints = endpoints()
        mark("learner_endpoints")
        if client is None:
            from distrl.core.buffer_client import BufferClient

            client = BufferClient(endpoints.buffer, self.name, curve_server_key=shared.buffer_curve_server_key,
                                  curve_client_key=shared.buffer_curve_client_key)
        self.client, self.metrics = client, Metrics(tb_dir)
        hook = None if self.inflight_update == "off" else self._between_steps  # --inflight_update
        self.rollouts = Rollouts(generation, shared, batch, actor_id, self.name, self.engine, task, client,
                                 self.metrics, version=lambda: self.version, between_steps=hook,
                                 on_boundary=lambda: self._refresh_weights(0), log_samples=rollout.log_samples)
        if resumed or rejoin:  # resumed, or restarted after a crash: none of an acknowledged group's seeds reused
            self._skip_used_problems()
        self.evaluator = self._periodic_eval(task.heldout, work_dir) if task.heldout and actor_id == 0 else None
        self._connect_weights(endpoints, work_dir)
        self.weight_wait_s = 0.0  # time blocked waiting for a new enough policy version

    def _periodic_eval(self, heldout: list, work_dir: str):
        """Actor 0 with --eval_every: a distrl.rollout.evaluation.PeriodicEval of the held-out problems whose
        prompts fit whole (a long one would stop the engine; it is left out, not cut); None if none fits."""
        from distrl.rollout.evaluation import PeriodicEval

        long_prompts = self.rollouts.long_prompts
        kept = [p for p in heldout if long_prompts.fits(p)]
        if len(kept) < len(heldout):
            log.warning("%s: %d of the %d held-out problems are longer as templated than the %s prompt tokens "
                        "--max_model_len leaves: evaluated without them", self.name, len(heldout) - len(kept),
                        len(heldout), long_prompts.limit)
        if not kept:
            return None
        return PeriodicEval(self.generation.eval_every, self.rollouts.task, kept, Path(work_dir) / "eval.jsonl",
                            num_samples=self.rollout.eval_num_samples, temperature=self.rollout.eval_temperature,
                            max_new_tokens=self.shared.max_new_tokens, seed=self.shared.seed,
                            episodes=self.rollouts.episodes)

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
        self.rollouts.served(ann.version, ann.digest)
        log.info("%s: switched from policy version %d to %d (%s, digest %s)", self.name, served,
                 ann.version, ann.format, ann.digest[:12])
        self.metrics.scalars({"actor/policy_version": ann.version, "actor/weight_load_s": time.perf_counter() - t0,
                              "actor/publish_to_serve_s": time.time() - ann.published_at,
                              "actor/weight_mb_fetched": self.loader.bytes_fetched / 2**20,
                              "actor/canary_s": self.rollouts.stamps.canary_s}, step=ann.version)

    def _skip_used_problems(self) -> None:
        """Resumed or restarted: skip the problems of this actor's groups that the buffer accepted (it counts
        them per actor id, rebuilt from its segment log after its own restart; no file is read here, so
        the buffer may be on another host), so that the position-derived seeds of acknowledged groups are
        not reused. Raises TimeoutError if the buffer does not answer."""
        used = self.client.acked_groups(self.actor_id)
        self.rollouts.skip(used)
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

    def _between_steps(self) -> None:
        if self.weights.poll().version > self.version:
            if self.inflight_update == "abort":
                raise VersionBoundary
            self._refresh_weights(0)  # in place: the running completions continue with it

    def step(self, granted: int) -> dict:
        """Generate, score and PUT `granted` groups with the served version (:meth:`Rollouts.step`)."""
        return self.rollouts.step(granted)

    @staticmethod
    def _want(batch: BatchOptions, shared: SharedOptions) -> int:
        """The groups this actor asks the buffer for at each step: its share of a version's batch."""
        return max(1, batch.batch_size // shared.number_of_actors)

    def run(self) -> dict:
        groups, idle_s, start = 0, 0.0, time.perf_counter()
        self._evaluate_if_due()  # version 0, before any update
        while True:
            reply = self.client.credits(want=self._want(self.batch, self.shared))
            if reply.get("stop"):  # training is over: serve the final version, then return
                self._serve_final()
                break
            if reply["granted"] == 0:
                self.rollouts.flush()  # groups whose rewards came in meanwhile (--async_scoring)
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
            timeouts = self.rollouts.reward_timeouts
            stats = self.step(reply["granted"])
            groups += reply["granted"]
            wall = time.perf_counter() - start
            stats.update({"actor/idle_fraction": (idle_s + self.weight_wait_s) / wall,
                          "actor/credit_wait_fraction": idle_s / wall,
                          "actor/weight_wait_fraction": self.weight_wait_s / wall,
                          "actor/tokens_per_s_wall": self.rollouts.tokens / wall})
            self.metrics.scalars(stats, step=self.version)
            if self.rollouts.reward_timeouts > timeouts:  # on disk now, not within 10 s: distrl train's console warns
                self.metrics.flush()
        self.metrics.close()
        log.info("%s: stopped after %d groups, last policy version %d", self.name, groups, self.version)
        return {"actor_id": self.actor_id, "groups": groups, "last_version": self.version,
                "long_prompts_skipped": self.rollouts.long_prompts.skipped,
                "long_prompts_truncated": self.rollouts.long_prompts.truncated,
                "reward_timeouts": self.rollouts.reward_timeouts}

    def close(self) -> None:
        """Tell the buffer this actor leaves (its unused credits return at once; it may be gone already), then
        close the buffer client, the --reward worker, the weight loader and subscriber."""
        try:
            log.info("%s: left the run; the buffer returned %d unused credits", self.name, self.client.leave())
        except (TimeoutError, RuntimeError) as exc:  # a buffer already shut down, or one without LEAVE
            log.info("%s: could not tell the buffer it leaves (%s)", self.name, exc)
        self.client.close()
        self.rollouts.close()
        self.loader.close()
        self.weights.close()
