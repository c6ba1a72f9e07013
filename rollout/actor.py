"""The rollout actor loop: credits -> newest weights -> generate -> score -> advantages -> PUT.

One actor owns one engine. Each turn it asks the buffer for credits (one credit = one group). The
reply carries the oldest policy version the learners can still use (`min_policy_version`); the actor
loads the newest announced version between generate calls, and waits for one if it serves an older
version than that. A group's completions all carry the version that was served when the generate
call started. The loop ends when the buffer's credit reply says ``stop`` (the learners are done).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa

from distrl.advantages import group_advantages
from distrl.config import TrainConfig
from distrl.metrics import Metrics
from distrl.weights import WeightError, WeightSubscriber, fetch
from distrl.wire import table_from_rows

log = logging.getLogger("distrl.actor")


@dataclass
class ActorEndpoints:
    buffer: str
    weights_pub: str
    weights_latest: str


class RolloutActor:
    """Runs one actor's loop; `run()` returns a summary dict when the buffer says stop."""

    def __init__(self, cfg: TrainConfig, actor_id: int, endpoints: ActorEndpoints, model_dir: str,
                 tb_dir: str | None = None):
        from buffer.client import BufferClient
        from rollout.engine import VLLMEngine
        from rollout.tasks import load_task

        self.cfg, self.actor_id = cfg, actor_id
        self.name = f"actor{actor_id}"
        self.task = load_task(cfg.task, cfg.dataset, seed=cfg.seed)
        self.problems = self.task.problems(seed=cfg.seed * 1000 + actor_id)
        self.engine = VLLMEngine(model_dir, cfg.tokenizer, cfg.dtype, cfg.lora_rank, cfg.max_model_len,
                                 seed=cfg.seed * 1000 + actor_id)
        self.client = BufferClient(endpoints.buffer, self.name)
        self.weights = WeightSubscriber(endpoints.weights_pub, endpoints.weights_latest, self.name)
        self.metrics = Metrics(tb_dir)
        self.version = 0  # policy version served
        self._seq = 0

    def _refresh_weights(self, min_version: int) -> None:
        """Serve the newest announced version; block until one >= min_version exists."""
        if self.weights.newest.version < min_version:
            self.weights.wait_for(min_version, timeout_s=600, should_stop=lambda: False)
        ann = self.weights.poll()
        if ann.version <= self.version:
            return
        t0 = time.perf_counter()
        try:
            path = fetch(ann)
        except WeightError as exc:
            log.error("%s: refusing policy version %d (%s); still serving %d", self.name, ann.version, exc,
                      self.version)
            return
        self.engine.load_lora(ann.version, path)
        log.info("%s: switched from policy version %d to %d (lora %s, digest %s)", self.name, self.version,
                 ann.version, path.name, ann.digest[:12])
        self.version = ann.version
        self.metrics.scalars({"actor/policy_version": ann.version,
                              "actor/weight_load_s": time.perf_counter() - t0}, step=ann.version)

    def _make_group(self, problem, prompt_text: str, result, t0: float, gen_s: float) -> pa.Table:
        """Score one prompt's completions, compute the group's advantages, build its Arrow rows."""
        comps = result.completions
        scored = [self.task.reward(c.text, c.token_ids, problem) for c in comps]
        rewards = [r for r, _ in scored]
        advantages = group_advantages(rewards, self.cfg.learner)
        self._seq += 1
        group_id = f"{self.name}-{self._seq}-{uuid.uuid4().hex[:8]}"
        rows = [dict(sample_id=f"{group_id}-{i}", group_id=group_id, prompt_id=problem.prompt_id,
                     actor_id=self.actor_id, policy_version=self.version, last_policy_version=self.version,
                     prompt_ids=result.prompt_ids, completion_ids=c.token_ids, behavior_logprobs=c.logprobs,
                     temperature=self.cfg.temperature, reward=r, reward_components=comp, advantage=a,
                     finish_reason=c.finish_reason, prompt_text=prompt_text, completion_text=c.text,
                     gen_start_time=t0, gen_seconds=gen_s)
                for i, (c, (r, comp), a) in enumerate(zip(comps, scored, advantages))]
        return table_from_rows(rows)

    def step(self, granted: int) -> dict:
        """Generate, score and PUT `granted` groups with the served version; return step metrics."""
        problems = [next(self.problems) for _ in range(granted)]
        prompts = [self.task.prompt(p, self.engine.tokenizer) for p in problems]
        t0, c0 = time.time(), time.perf_counter()
        results = self.engine.generate(prompts, self.cfg.group_size, self.cfg.temperature, self.cfg.max_new_tokens)
        gen_s = time.perf_counter() - c0
        rewards, tokens = [], 0
        for problem, prompt, result in zip(problems, prompts, results):
            table = self._make_group(problem, prompt, result, t0, gen_s)
            self.client.put(table)
            rewards += table.column("reward").to_pylist()
            tokens += sum(len(c.token_ids) for c in result.completions)
        return {"actor/reward_mean": sum(rewards) / len(rewards), "actor/tokens_per_s": tokens / gen_s,
                "actor/groups": granted, "actor/generate_s": gen_s}

    def run(self) -> dict:
        groups, idle_s, start = 0, 0.0, time.perf_counter()
        while True:
            reply = self.client.credits(want=max(1, self.cfg.batch_size // self.cfg.number_of_actors))
            if reply.get("stop"):
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
