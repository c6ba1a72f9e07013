"""The rollout actor loop: credits -> newest weights -> generate -> score -> advantages -> PUT.

One actor owns one engine. Each turn it asks the buffer for credits (one credit = one group). The
reply carries the oldest policy version the learners can still use (`min_policy_version`); the actor
loads the newest announced version between generate calls, and waits for one if it serves an older
version than that. A group's completions carry the version served when the generate call started
(`policy_version`) and the newest one served before it ended (`last_policy_version`: they differ only
with `--inflight_update finish`, which loads versions between decode steps). The loop ends when the
buffer's credit reply says ``stop`` (the learners are done).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from distrl.advantages import group_advantages
from distrl.config import TrainConfig
from distrl.metrics import Metrics
from distrl.weights import WeightError, WeightSubscriber, make_fetcher
from distrl.wire import table_from_rows

log = logging.getLogger("distrl.actor")


class VersionBoundary(Exception):
    """Raised between decode steps to abort a generate call when a newer version is announced."""


@dataclass
class ActorEndpoints:
    buffer: str
    weights_pub: str
    weights_latest: str


class RolloutActor:
    """Runs one actor's loop; `run()` returns a summary dict when the buffer says stop."""

    def __init__(self, cfg: TrainConfig, actor_id: int, endpoints: ActorEndpoints, model_dir: str,
                 work_dir: str, tb_dir: str | None = None):
        from buffer.client import BufferClient
        from rollout.engines import make_engine
        from rollout.tasks import load_task

        self.cfg, self.actor_id = cfg, actor_id
        self.name = f"actor{actor_id}"
        self.task = load_task(cfg.task, cfg.dataset, seed=cfg.seed)
        self.problems = self.task.problems(seed=cfg.seed * 1000 + actor_id)
        self.position = 0  # problems taken from the stream so far; sampling seeds derive from it
        if cfg.resume:
            self._skip_used_problems(Path(cfg.resume))
        self.engine = make_engine(cfg.engine, model_dir, cfg.tokenizer, cfg.dtype, cfg.lora_rank, cfg.max_model_len,
                                  seed=cfg.seed * 1000 + actor_id, merge_lora=cfg.merge_lora)
        self.client = BufferClient(endpoints.buffer, self.name, curve_server_key=cfg.buffer_curve_server_key,
                                   curve_client_key=cfg.buffer_curve_client_key)
        self.weights = WeightSubscriber(endpoints.weights_pub, endpoints.weights_latest, self.name)
        try:  # a late or restarted actor starts from the current version, not from version 0
            self.weights.request_latest(timeout_s=10)
        except TimeoutError:
            log.warning("%s: no weight endpoint answer yet at %s: starting from version 0", self.name,
                        endpoints.weights_latest)
        if cfg.weights_transport == "nccl":
            from distrl.weights.base import endpoint_host
            from distrl.weights.nccl import BroadcastReceiver

            address = f"{endpoint_host(endpoints.weights_latest)}:{cfg.weights_broadcast_port}"
            self.fetcher = BroadcastReceiver(address, 1 + actor_id, cfg.number_of_actors, self.engine.device)
        else:
            self.fetcher = make_fetcher(cfg.weights_transport, endpoints.weights_latest,
                                        Path(work_dir) / "weights_cache" / self.name)
        self.metrics = Metrics(tb_dir)
        self.version = 0  # policy version served
        self._seq = 0
        self.aborted_calls = 0  # generate calls dropped at a version boundary (--inflight_update abort)

    def _refresh_weights(self, min_version: int) -> None:
        """Serve the newest announced version; block until one >= min_version exists."""
        if self.weights.newest.version < min_version:
            self.weights.wait_for(min_version, timeout_s=600, should_stop=lambda: False)
        ann = self.weights.poll()
        if ann.version <= self.version:
            return
        t0 = time.perf_counter()
        try:
            ann = self._load(ann)
        except WeightError as exc:
            log.error("%s: refusing policy version %d (%s); still serving %d", self.name, ann.version, exc,
                      self.version)
            return
        log.info("%s: switched from policy version %d to %d (%s, digest %s)", self.name, self.version,
                 ann.version, ann.format, ann.digest[:12])
        self.version = ann.version
        self.metrics.scalars({"actor/policy_version": ann.version, "actor/weight_load_s": time.perf_counter() - t0,
                              "actor/publish_to_serve_s": time.time() - ann.published_at,
                              "actor/weight_mb_fetched": self.fetcher.bytes_fetched / 2**20}, step=ann.version)

    def _skip_used_problems(self, run_dir: Path) -> None:
        """Resume: skip the problems this actor's acknowledged groups already used (from the segment log)."""
        from buffer.segments import read_segments, segment_paths

        if not segment_paths(run_dir):
            log.warning("%s: no segment log in %s: resuming at the start of the prompt stream", self.name, run_dir)
            return
        table = read_segments(run_dir)
        used = len({g for g, a in zip(table.column("group_id").to_pylist(), table.column("actor_id").to_pylist())
                    if a == self.actor_id})
        for _ in range(used):
            next(self.problems)
        self.position = used
        log.info("%s: resuming after the %d problems its groups already used", self.name, used)

    def _serve_final(self) -> None:
        """Load the last announced version if the learner still answers (it may already be gone)."""
        try:
            self._refresh_weights(self.weights.request_latest(timeout_s=5).version)
        except (TimeoutError, WeightError) as exc:
            log.warning("%s: final version not loaded (%s); serving %d", self.name, exc, self.version)

    def _load(self, ann):
        """Fetch and verify `ann`'s payload and load it into the engine; return what is now served."""
        if ann.location.startswith("nccl://"):  # a collective round: it may carry another version
            version, named = self.fetcher.receive(ann, self.weights.announcement)
            self.engine.load_tensors(version, named)
            return self.weights.announcement(version)
        self.engine.load_weights(ann.version, ann.format, self.fetcher.fetch(ann))
        return ann

    def _generate(self, prompts: list[str], seed: int) -> tuple[list, int]:
        """Generate with the served version; with --inflight_update, switch versions mid-call.

        `finish`: a newer version is loaded between decode steps and the running completions go on
        with it. `abort`: the call is dropped, the newer version loaded, and the prompts generated
        again. Returns (results, the version the call started with).
        """
        mode = self.cfg.inflight_update
        while True:
            start_version = self.version
            try:
                hook = None if mode == "off" else self._between_steps
                return self.engine.generate(prompts, self.cfg.group_size, self.cfg.temperature,
                                            self.cfg.max_new_tokens, between_steps=hook, seed=seed), start_version
            except VersionBoundary:
                self.aborted_calls += 1
                self._refresh_weights(0)

    def _between_steps(self) -> None:
        if self.weights.poll().version > self.version:
            if self.cfg.inflight_update == "abort":
                raise VersionBoundary
            self._refresh_weights(0)  # in place: the running completions continue with it

    def _make_group(self, problem, prompt_text: str, result, t0: float, gen_s: float,
                    start_version: int) -> pa.Table:
        """Score one prompt's completions, compute the group's advantages, build its Arrow rows."""
        comps = result.completions
        scored = [self.task.reward(c.text, c.token_ids, problem) for c in comps]
        rewards = [r for r, _ in scored]
        advantages = group_advantages(rewards, self.cfg.advantage_estimator)
        self._seq += 1
        group_id = f"{self.name}-{self._seq}-{uuid.uuid4().hex[:8]}"
        rows = [dict(sample_id=f"{group_id}-{i}", group_id=group_id, prompt_id=problem.prompt_id,
                     actor_id=self.actor_id, policy_version=start_version, last_policy_version=self.version,
                     prompt_ids=result.prompt_ids, completion_ids=c.token_ids, behavior_logprobs=c.logprobs,
                     temperature=self.cfg.temperature, reward=r, reward_components=comp, advantage=a,
                     finish_reason=c.finish_reason, prompt_text=prompt_text, completion_text=c.text,
                     gen_start_time=t0, gen_seconds=gen_s)
                for i, (c, (r, comp), a) in enumerate(zip(comps, scored, advantages))]
        return table_from_rows(rows)

    def step(self, granted: int) -> dict:
        """Generate, score and PUT `granted` groups with the served version; return step metrics."""
        problems = [next(self.problems) for _ in range(granted)]
        seed = (self.cfg.seed * 100_003 + self.actor_id) * 2**32 + self.position  # per prompt: seed + i
        self.position += granted
        prompts = [self.task.prompt(p, self.engine.tokenizer) for p in problems]
        t0, c0 = time.time(), time.perf_counter()
        results, start_version = self._generate(prompts, seed)
        gen_s = time.perf_counter() - c0
        groups = [self._make_group(problem, prompt, result, t0, gen_s, start_version)
                  for problem, prompt, result in zip(problems, prompts, results)]
        self.client.put_many(groups)  # one message, acknowledged once every group is in the segment log
        rewards = [r for g in groups for r in g.column("reward").to_pylist()]
        tokens = sum(len(c.token_ids) for result in results for c in result.completions)
        return {"actor/reward_mean": sum(rewards) / len(rewards), "actor/tokens_per_s": tokens / gen_s,
                "actor/groups": granted, "actor/generate_s": gen_s, "actor/aborted_calls": self.aborted_calls,
                "actor/inflight_versions": self.version - start_version}

    def run(self) -> dict:
        groups, idle_s, start = 0, 0.0, time.perf_counter()
        while True:
            reply = self.client.credits(want=max(1, self.cfg.batch_size // self.cfg.number_of_actors))
            if reply.get("stop"):  # training is over: serve the final version, then return
                self._serve_final()
                break
            if reply["granted"] == 0:
                self.weights.poll()
                time.sleep(0.05)
                idle_s += 0.05
                continue
            self._refresh_weights(reply["min_policy_version"])
            stats = self.step(reply["granted"])
            groups += reply["granted"]
            stats["actor/idle_fraction"] = idle_s / (time.perf_counter() - start)
            self.metrics.scalars(stats, step=self.version)
        self.metrics.close()
        log.info("%s: stopped after %d groups, last policy version %d", self.name, groups, self.version)
        return {"actor_id": self.actor_id, "groups": groups, "last_version": self.version}

    def close(self) -> None:
        self.client.close()
        self.weights.close()
