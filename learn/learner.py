"""The learner loop: GET a batch for version V -> loss -> (all-reduce) -> step -> V+1 -> publish.

One policy version is one optimizer step of the learner group. Each of the L learners GETs its shard
of the buffer's one selection for version V, accumulates gradients over micro-batches of
`learner_chunk_size` completions (token-mean over the whole version's batch, so the result equals
the full-batch step and L learners equal one on the union batch), sums gradients across learners,
and steps. Rank 0 then saves the LoRA adapter as version V+1 and announces it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pyarrow as pa
import torch
import torch.distributed as dist

from distrl.config import TrainConfig
from distrl.metrics import Metrics
from learn.logprobs import token_logprobs
from learn.losses import grpo_loss, pg_loss
from learn.model import body_and_head, load_policy

log = logging.getLogger("distrl.learner")


@dataclass
class MicroBatch:
    """Right-padded tensors of b completions; position t predicts token t+1 of prompt+completion.

    input_ids, attention_mask, targets, mask, behavior_logprobs: (b, L-1); advantages: (b,).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor


def collate(rows: list[dict], pad_id: int) -> MicroBatch:
    """Build a MicroBatch from completion rows (dicts of distrl.wire.COMPLETION_SCHEMA)."""
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    width = max(len(s) for s in seqs) - 1
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    targets = torch.full((b, width), -100, dtype=torch.long)
    mask = torch.zeros((b, width))
    behavior = torch.zeros((b, width))
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        n, p, c = len(seq) - 1, len(row["prompt_ids"]), len(row["completion_ids"])
        input_ids[i, :n] = torch.tensor(seq[:-1])
        attention[i, :n] = 1
        targets[i, :n] = torch.tensor(seq[1:])
        mask[i, p - 1:p - 1 + c] = 1.0  # completion token j is predicted at position p - 1 + j
        behavior[i, p - 1:p - 1 + c] = torch.tensor(row["behavior_logprobs"])
    advantages = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
    return MicroBatch(input_ids, attention, targets, mask, behavior, advantages)


class Learner:
    """One learner rank. `run()` trains `max_steps` versions and returns a summary dict."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, buffer_address: str, model_dir: str,
                 publisher=None, transport=None, tb_dir: str | None = None):
        from buffer.client import BufferClient

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        torch.manual_seed(cfg.seed)
        self.model = load_policy(model_dir, cfg.dtype, cfg.lora_rank, cfg.lora_alpha, cfg.max_model_len or 2048,
                                 cfg.seed)
        self.body, self.head = body_and_head(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=0.0)
        self.pad_id = self.model.config.pad_token_id or 0
        self.client = BufferClient(buffer_address, f"learner{rank}", timeout_s=60.0)
        self.publisher, self.transport = publisher, transport
        self.metrics = Metrics(tb_dir)
        self.version = 0

    def _forward_backward(self, mb: MicroBatch, num_tokens: float) -> dict:
        hidden = self.body(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
        # The head runs on completion positions only (prompt logits are never needed): (1, N, H).
        sel = mb.mask > 0
        lp, ent = token_logprobs(hidden[sel].unsqueeze(0), self.head, mb.targets[sel].unsqueeze(0),
                                 self.cfg.temperature, return_entropy=True)
        logp = torch.zeros(mb.mask.shape, dtype=torch.float32, device=hidden.device)
        logp = logp.index_put((sel.nonzero(as_tuple=True)), lp[0])  # (b, T), zero off the completion
        entropy = ent[0]
        if self.cfg.learner == "grpo":
            loss, m = grpo_loss(logp, mb.behavior_logprobs, mb.advantages, mb.mask, num_tokens, self.cfg.clip_eps)
        else:
            loss, m = pg_loss(logp, mb.advantages, mb.mask, num_tokens, behavior_logprobs=mb.behavior_logprobs)
        loss.backward()
        m["loss"] = loss.item()
        m["entropy_sum"] = float(entropy.sum())
        return m

    def train_step(self, table: pa.Table) -> dict:
        """One optimizer step on this rank's shard; returns metrics of the version's batch."""
        rows = table.to_pylist()
        num_tokens = torch.tensor(float(sum(len(r["completion_ids"]) for r in rows)))
        if self.world_size > 1:
            dist.all_reduce(num_tokens)
        parts = []
        chunk = self.cfg.learner_chunk_size
        for start in range(0, len(rows), chunk):
            parts.append(self._forward_backward(collate(rows[start:start + chunk], self.pad_id), num_tokens))
        if self.world_size > 1:
            for p in self.params:
                dist.all_reduce(p.grad)  # SUM: each rank's loss is already its share of the token mean
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm=1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _combine(parts, rows, self.version, float(grad_norm))

    def _publish(self) -> None:
        t0 = time.perf_counter()
        ann = self.transport.publish(self.version, "lora", lambda d: self.model.save_pretrained(str(d)))
        self.publisher.announce(ann)
        self.metrics.scalar("learner/weight_publish_s", time.perf_counter() - t0, self.version)

    def run(self) -> dict:
        idle_s, start, history = 0.0, time.perf_counter(), []
        while self.version < self.cfg.max_steps:
            t0 = time.perf_counter()
            table = self.client.get(self.version, self.rank, self.world_size, timeout_s=1800)
            idle_s += time.perf_counter() - t0
            t1 = time.perf_counter()
            stats = self.train_step(table)
            stats["learner/tokens_per_s"] = stats.pop("tokens") / (time.perf_counter() - t1)
            self.version += 1
            if self.rank == 0:
                self._publish()
            stats["learner/idle_fraction"] = idle_s / (time.perf_counter() - start)
            stats["learner/policy_version"] = self.version
            self.metrics.histogram("learner/staleness", stats.pop("staleness_values"), step=self.version)
            self.metrics.scalars(stats, step=self.version)
            history.append(stats)
            log.info("learner%d: version %d loss %.4f reward %.3f staleness max %d logprob |diff| mean %.2e",
                     self.rank, self.version, stats["learner/loss"], stats["learner/reward_mean"],
                     stats["learner/staleness_max"], stats["learner/logprob_mismatch_mean_abs"])
        if self.rank == 0:
            self.client.stop()
        self.metrics.close()
        return {"rank": self.rank, "version": self.version, "history": history}

    def close(self) -> None:
        self.client.close()


def _combine(parts: list[dict], rows: list[dict], version: int, grad_norm: float) -> dict:
    """Token-weighted means of micro-batch metrics, maxima of maxima, batch-level statistics."""
    n = sum(p["masked_tokens"] for p in parts) or 1.0

    def mean(key):
        return sum(p[key] * p["masked_tokens"] for p in parts if key in p) / n

    staleness = [version - r["policy_version"] for r in rows]
    stats = {
        "learner/loss": sum(p["loss"] for p in parts),
        "learner/reward_mean": sum(r["reward"] for r in rows) / len(rows),
        "learner/advantage_abs_mean": sum(abs(r["advantage"]) for r in rows) / len(rows),
        "learner/entropy": sum(p["entropy_sum"] for p in parts) / n,
        "learner/grad_norm": grad_norm,
        "learner/logprob_mismatch_mean_abs": mean("logprob_mismatch_mean_abs"),
        "learner/logprob_mismatch_max_abs": max(p.get("logprob_mismatch_max_abs", 0.0) for p in parts),
        "learner/kl_behavior_learner_k3": mean("kl_behavior_learner_k3"),
        "learner/staleness_mean": sum(staleness) / len(staleness),
        "learner/staleness_max": max(staleness),
        "learner/completion_tokens": n,
        "staleness_values": staleness,
        "tokens": sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows),
    }
    if any("clip_fraction" in p for p in parts):
        stats.update({"learner/clip_fraction": mean("clip_fraction"), "learner/ratio_mean": mean("ratio_mean"),
                      "learner/ratio_max": max(p["ratio_max"] for p in parts),
                      "learner/ratio_min": min(p["ratio_min"] for p in parts)})
    return stats
