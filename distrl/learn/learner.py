"""The learner loop: GET a batch for version V -> loss -> (all-reduce) -> step -> V+1 -> publish.

One policy version is one optimizer step of the learner group. Each of the L learners GETs its shard
of the buffer's one selection for version V and then, per version:

1. all-reduces the batch totals (tokens, completions, reward sum, completions with a non-zero
   advantage), which fix the loss normalizers of the whole version (``distrl.learn.losses.Normalizer``) and
   the running-mean baseline, identically on every rank;
2. accumulates gradients over micro-batches of ``--learner_chunk_tokens`` padded tokens (or of
   ``--learner_chunk_size`` completions, when given; each micro-batch's
   loss is its share of the global loss, so the sum equals the full-batch step, for every aggregation);
3. sums gradients across learners (``distrl.learn.distributed``), clips them to ``--max_grad_norm``, steps
   AdamW and the learning-rate schedule (``distrl.learn.optim``);
4. rank 0 saves the weights as version V+1 and announces them (format ``lora`` or ``full``; with
   ``--number_of_actors 0`` nothing subscribes, and only the last version is published).

Zero-variance groups have all-zero advantages and contribute exactly zero to the policy term (no NaN:
``distrl.core.advantages`` returns exact zeros). When the WHOLE version's batch (all ranks) has zero
advantages and there is no KL term, the gradient would be exactly zero but AdamW would still move the
weights along its momentum; the learner then skips the forward, backward and optimizer step, still
advances the learning-rate schedule, increments the version (the weights are unchanged) and publishes
it, and logs ``learner/skipped_step = 1``: actors and the buffer keep their version contract.

With ``--truncation mask`` (DAPO's overlong filtering) completions cut at the length limit get no loss
and are not counted by the normalizers (:meth:`Learner.in_loss`); their rewards still count in the
version's reward. After the last version rank 0 exports ``<run_dir>/final/`` (``--export_final``,
``distrl.learn.model.export_final``).

With ``--bias_correction reweight`` each row's advantage is multiplied by its group's weight
(:meth:`Learner.bias_weights`, :mod:`distrl.learn.reweight`: the buffer's generated / trained shares of the group's
(length, difficulty) cell, sent with the BATCH), which weights the policy loss toward the generated mix.

Works under Ray (``distrl.cmd.roles.LearnerRole`` creates the process group) and under torchrun
(:func:`init_distributed_from_env`, re-exported here from ``distrl.learn.distributed``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from distrl.core.buffer_client import BufferApi
from distrl.core.metrics import Metrics
from distrl.core.run_options import SharedOptions, StalenessOptions
from distrl.core.startup import mark
from distrl.learn.baseline import RunningMeanBaseline
from distrl.learn.batch import MicroBatch, collate, loss_tokens, micro_batches, pack, widest_first
from distrl.learn.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from distrl.learn.config import LearnOptions, aggregation_in_effect
from distrl.learn.distributed import all_reduce_grads, all_reduce_sum, broadcast_params, init_distributed_from_env
from distrl.learn.logprobs import head_impl, token_logprobs, warm_up
from distrl.learn.losses import LossConfig, Normalizer, policy_loss
from distrl.learn.model import (
    body_and_head,
    compile_layers,
    export_final,
    frozen_reference,
    load_policy,
    reference_context,
    settle_backend,
)
from distrl.learn.optim import build_optimizer
from distrl.learn.quarantine import LearnerAttestation
from distrl.learn.reweight import normalise, row_weights
from distrl.learn.staleness import SIGNALS, StalenessController
from distrl.learn.step_stats import History, combine
from distrl.learn.tensor_metrics import to_floats

__all__ = ["Learner", "init_distributed_from_env", "loss_config"]

log = logging.getLogger("distrl.learner")


def _buffer_client(address: str, rank: int, shared: SharedOptions) -> BufferApi:
    """The ZeroMQ client of learner ``rank`` to the buffer at ``address`` (CURVE keys from ``shared``)."""
    from distrl.core.buffer_client import BufferClient

    return BufferClient(address, f"learner{rank}", timeout_s=60.0, curve_server_key=shared.buffer_curve_server_key,
                        curve_client_key=shared.buffer_curve_client_key)


def loss_config(learn: LearnOptions, shared: SharedOptions) -> LossConfig:
    """The objective of ``learn`` and the --learner of ``shared`` (``dr_grpo`` is GRPO's clipped ratio with its own
    aggregation)."""
    eps = learn.clip_eps
    off = learn.off_policy_config()
    return LossConfig(kind="pg" if shared.learner == "pg" else "grpo",
                      clip_eps_low=eps if learn.clip_eps_low is None else learn.clip_eps_low,
                      clip_eps_high=eps if learn.clip_eps_high is None else learn.clip_eps_high,
                      kl_coef=learn.kl_coef, kl_estimator=learn.kl_estimator, off_policy=off)


class Learner:
    """One learner rank. `run()` trains `max_steps` versions and returns a summary dict.

    Its inputs are its own config section (``learn``, distrl/learn/config.py), the foundation's sections it reads
    (``shared``: model, sampling, weight transport; ``staleness``: the weight versions attestation keeps,
    distrl/core/run_options.py) and the objects assembled for it (``publisher``); never a command's config.

    ``train_step(table)`` is the whole step on one shard (usable without a buffer); ``accumulate``
    only computes the gradients (tests compare micro-batchings with it). ``client``: the buffer client
    (:class:`distrl.core.buffer_client.BufferApi`) to use instead of a BufferClient of ``buffer_address``
    (tests: ``distrl.buffer.inprocess``); ``buffer_address`` may be a callable returning it, called once the model
    is loaded (``distrl train`` starts its learners while the buffer still binds).
    """

    def __init__(self, learn: LearnOptions, shared: SharedOptions, staleness: StalenessOptions, rank: int,
                 world_size: int, buffer_address: str | Callable[[], str], model_dir: str, publisher=None,
                 tb_dir: str | None = None, run_dir: str | Path | None = None, client: BufferApi | None = None):
        self.learn, self.shared, self.staleness = learn, shared, staleness
        self.rank, self.world_size, self.model_dir = rank, world_size, model_dir
        torch.manual_seed(shared.seed)
        backend = settle_backend(learn.backend, learn.load_in_4bit)  # the commands settled it: a cached probe here
        self.model = load_policy(model_dir, shared.dtype, shared.lora_rank, learn.lora_alpha,
                                 shared.max_model_len or 2048, shared.seed, finetune=shared.finetune, backend=backend,
                                 target_modules=learn.lora_target_modules, load_in_4bit=learn.load_in_4bit)
        self.body, self.head = body_and_head(self.model)
        mark("model_loaded")  # start-up marks (distrl.core.startup)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        if learn.learner_pack_tokens and backend == "unsloth" and self.device.type == "cuda":
            raise ValueError("--learner_pack_tokens needs --backend hf on a GPU: Unsloth's own attention "
                             "does not split packed rows at position-id restarts")
        if learn.gradient_checkpointing:  # HF recomputes each decoder layer in backward (train mode only)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.train()  # Qwen2/Llama have no dropout by default; LoRA is built with lora_dropout=0
        if learn.compiles_layers() and (self.device.type == "cuda" or learn.learner_compile):
            compile_layers(self.model, packed=learn.learner_pack_tokens > 0, kl=learn.kl_coef > 0)
        if self.device.type == "cuda" and self.params[0].dtype in (torch.bfloat16, torch.float16):
            # The fp32 head multiplies bf16-valued hidden states and weights: TF32 inputs hold bf16 values
            # exactly, so the forward logits keep fp32 accumulation at tensor-core speed. (An fp32 model
            # keeps full fp32 matmuls.)
            torch.backends.cuda.matmul.allow_tf32 = True
        self.head_impl, why = head_impl(learn.learner_head, self.head, shared.temperature)
        log.info("learner%d: LM head %s (%s)", rank, self.head_impl, why)
        warm_up(self.head, self.model.config.get_text_config().hidden_size, self.params[0].dtype, shared.temperature,
                learn.learner_head_chunk_tokens, self.head_impl)  # CUDA: compiles while the actors start
        broadcast_params(self.params, world_size)
        self.optimizer, self.scheduler = build_optimizer(self.params, learn.learning_rate, learn.lr_warmup_steps,
                                                         learn.max_steps, learn.lr_schedule)
        self.loss_cfg = loss_config(learn, shared)
        self.baseline = RunningMeanBaseline(learn.baseline_decay) if learn.pg_baseline == "running_mean" else None
        self.reference = None  # (body, head) of a frozen copy: full fine-tuning with a KL term
        if learn.kl_coef > 0 and shared.finetune == "full":
            self.reference = frozen_reference(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        # a callable ``buffer_address`` is called only now, once the model is loaded and warmed up
        self.buffer_address = buffer_address() if callable(buffer_address) else buffer_address
        self.client = client if client is not None else _buffer_client(self.buffer_address, rank, shared)
        self.publisher = publisher  # rank 0: a distrl.weights Publisher (any transport); its builder closes it
        self.run_dir = None if run_dir is None else Path(run_dir)  # checkpoints go to <run_dir>/ckpt/
        self.metrics = Metrics(tb_dir)
        self.attest = None if not shared.attest_weights else LearnerAttestation(  # distrl/learn/quarantine.py
            learn, staleness.bound.ceiling, rank, world_size, self.body, self.head, self.model.config.vocab_size,
            self.metrics)
        self.version = 0  # this process's one policy version (a LearnerGenerator reads it, never sets it)
        bound = staleness.bound  # --max_staleness auto: the controller moves it, each GET announces it
        self.controller = StalenessController(bound.ceiling, learn.staleness_band()) if bound.auto else None
        self.max_staleness = bound.initial  # the staleness bound in force for self.version's batch
        # Called as while_waiting() each time a GET has to wait (--learner_generates sets it to generate with
        # this model at self.version); returns True if it did work, False to let the GET sleep instead.
        self.while_waiting = None

    # ---- one micro-batch ---------------------------------------------------------------------

    def _logprobs(self, body, head, mb: MicroBatch, entropy: bool):
        """Learner logprobs (b, T) fp32, zero off the completion [, entropy (n,)]; the head runs on
        completion positions only (prompt logits are never needed)."""
        index = mb.completion_index  # (n,) flat positions of mask > 0, row-major
        if mb.packed_ids is None:  # no mask: rows are right-padded, so causal attention never reaches a pad from a
            # real token (the pads' own outputs are never read), and sdpa runs its fused causal kernel
            hidden = body(input_ids=mb.input_ids, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)  # (n, H), completion positions only
        else:  # packed rows: no attention mask, positions restart per sequence (see `pack`)
            hidden = body(input_ids=mb.packed_ids, position_ids=mb.packed_positions, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.packed_index)  # (n, H), padded order
        targets = mb.targets.reshape(-1).index_select(0, index)
        out = token_logprobs(hidden.unsqueeze(0), head, targets.unsqueeze(0), self.shared.temperature,
                             chunk_tokens=self.learn.learner_head_chunk_tokens, return_entropy=entropy,
                             impl=self.head_impl if head is self.head else "chunked")
        lp = out[0] if entropy else out
        logp = torch.zeros(mb.mask.numel(), dtype=torch.float32, device=hidden.device)
        logp = logp.index_put((index,), lp[0]).reshape(mb.mask.shape)  # (b, T)
        return (logp, out[1][0]) if entropy else logp

    @torch.no_grad()
    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Reference logprobs (b, T): LoRA adapter disabled, or the frozen copy."""
        if self.reference is not None:
            return self._logprobs(*self.reference, mb, entropy=False)
        with reference_context(self.model):
            return self._logprobs(self.body, self.head, mb, entropy=False)

    def _forward_backward(self, mb: MicroBatch, norm: Normalizer) -> dict:
        logp, entropy = self._logprobs(self.body, self.head, mb, entropy=True)
        ref = self._ref_logprobs(mb) if self.loss_cfg.kl_coef > 0 else None
        # One optimizer step per version: this forward runs at the proximal weights (distrl.learn.offpolicy).
        loss, m = policy_loss(logp, mb.behavior_logprobs, mb.advantages, mb.mask, norm, self.loss_cfg,
                              proximal_logprobs=logp.detach(), ref_logprobs=ref, sync=False)
        loss.backward()
        m["loss"] = loss.detach()
        m["entropy_sum"] = entropy.sum()
        return m  # 0-dim device tensors: read once per step (`accumulate`), not per micro-batch

    # ---- one version -------------------------------------------------------------------------

    def prepare(self, table: pa.Table, weights: np.ndarray | None = None) -> tuple[Normalizer, np.ndarray, dict]:
        """All-reduced batch totals -> (normalizer, this rank's advantages (b,) float64, totals); ``weights`` (b,)
        > 0 (``--bias_correction``, :meth:`bias_weights`) multiply the advantages: the weighted policy loss."""
        loss = self.in_loss(table)  # --truncation mask: truncated completions get no loss
        advantages = table.column("advantage").to_numpy().astype(np.float64)
        rewards = table.column("reward").to_numpy().astype(np.float64).tolist()
        tokens = int(loss_tokens(table)[loss].sum())  # generated tokens: an episode's observations count nowhere
        nonzero = int(np.count_nonzero(advantages[loss]))
        # Python's sum, in row order: the same float as summing the rows one by one
        n_tok, n_seq, r_sum, n_nonzero, n_rows = all_reduce_sum([tokens, int(loss.sum()), sum(rewards), nonzero,
                                                                 table.num_rows], self.world_size)
        totals = {"tokens": n_tok, "sequences": n_seq, "reward_mean": r_sum / max(n_rows, 1.0)}
        if self.baseline is not None:  # the learner's own advantages replace the actors' (distrl.learn.baseline)
            advantages = np.array(self.baseline.advantages(rewards, totals["reward_mean"]), dtype=np.float64)
            n_nonzero = all_reduce_sum([int(np.count_nonzero(advantages[loss]))], self.world_size)[0]
        totals["signal"] = n_nonzero > 0 or (self.loss_cfg.kl_coef > 0 and n_seq > 0)
        norm_tokens = float(self.learn.loss_norm_tokens or self.shared.max_new_tokens)
        aggregation = aggregation_in_effect(self.shared.learner, self.learn.loss_aggregation)
        norm = Normalizer(aggregation, n_tok, n_seq, norm_tokens)
        if weights is not None:
            advantages = advantages * weights
        return norm, advantages, totals

    def bias_weights(self, table: pa.Table) -> np.ndarray | None:
        """``--bias_correction reweight``: (b,) weights of this shard's rows from the buffer's histograms sent
        with the batch, mean 1 over the version's batch (all ranks; :mod:`distrl.learn.reweight`); else None."""
        if self.learn.bias_correction != "reweight":
            return None
        ids = table.column("group_id").to_pylist()
        bias = self.client.last_bias
        raw = np.ones(len(ids)) if bias is None else row_weights(ids, *bias)
        total, count = all_reduce_sum([float(raw.sum()), len(ids)], self.world_size)
        return normalise(raw, total, int(count))

    def in_loss(self, table: pa.Table) -> np.ndarray:
        """(b,) bool: which completion rows get a loss: with ``--truncation mask`` (DAPO's overlong
        filtering) those cut at the length limit (finish_reason ``length``) do not; their tokens count nowhere."""
        if self.shared.truncation != "mask":
            return np.ones(table.num_rows, dtype=bool)
        return pc.not_equal(table.column("finish_reason"), "length").to_numpy()

    def accumulate(self, table: pa.Table, advantages: np.ndarray, norm: Normalizer) -> list[dict]:
        """Forward/backward over the micro-batches of ``table`` (:func:`distrl.learn.batch.micro_batches`: by
        ``--learner_chunk_tokens``, the rows widest first (:func:`distrl.learn.batch.widest_first`), or
        ``--learner_chunk_size`` rows in table order when given; ``advantages``: (b,), one per row); gradients
        accumulate in .grad. Rows that get no loss (:meth:`in_loss`) are left out."""
        rows = np.flatnonzero(self.in_loss(table))
        if self.learn.learner_chunk_size is None:  # by token budget: rows of similar width share a micro-batch
            rows = rows[widest_first(table.take(rows))]
        table, advantages = table.take(rows), advantages[rows]
        parts = []
        for start, stop in micro_batches(table, self.learn.learner_chunk_size, self.learn.learner_chunk_tokens):
            mb = collate(table.slice(start, stop - start), self.pad_id, advantages[start:stop])
            if self.learn.learner_pack_tokens:
                mb = pack(mb, self.pad_id, self.learn.learner_pack_tokens)
            mb = mb.to(self.device)
            parts.append(self._forward_backward(mb, norm))
        return to_floats(parts)  # the step's one wait for the device

    def train_step(self, table: pa.Table, weights: np.ndarray | None = None) -> dict:
        """One optimizer step of this rank on its shard (a COMPLETION_SCHEMA table; ``weights``: see
        :meth:`prepare`); returns metrics of the version's batch."""
        norm, advantages, totals = self.prepare(table, weights)
        lr = self.optimizer.param_groups[0]["lr"]
        parts, grad_norm = [], 0.0
        if totals["signal"]:
            parts = self.accumulate(table, advantages, norm)
            all_reduce_grads(self.params, self.world_size)
            max_norm = self.learn.max_grad_norm if self.learn.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm=max_norm))
        # Without signal no gradient was computed: every .grad is None, which torch.optim skips (no moment,
        # step-count or weight-decay update), so this step changes nothing. Stepping anyway keeps the optimizer
        # before the per-version schedule on every version (else torch warns when the first one is skipped).
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.baseline is not None:
            self.baseline.update(totals["reward_mean"])
        loss = all_reduce_sum([sum(p["loss"] for p in parts)], self.world_size)[0]
        stats = combine(parts, table, self.version, grad_norm)
        truncated = np.count_nonzero(pc.equal(table.column("finish_reason"), "length").to_numpy())
        stats.update({"learner/loss": loss, "learner/reward_mean": totals["reward_mean"], "learner/lr": lr,
                      "learner/skipped_step": 0.0 if totals["signal"] else 1.0,
                      "learner/truncated_fraction": truncated / max(table.num_rows, 1),
                      "learner/advantage_abs_mean": sum(np.abs(advantages).tolist()) / max(len(advantages), 1)})
        if self.baseline is not None:
            stats["learner/baseline"] = self.baseline.value
        if weights is not None and len(weights):
            stats.update({"learner/bias_weight_min": float(weights.min()),
                          "learner/bias_weight_max": float(weights.max())})
        return stats

    @property
    def subscribed(self) -> bool:
        """Whether any actor takes each version's weights: not with --number_of_actors 0 (--learner_generates
        alone, whose generator uses this learner's model object); then only the last version is published."""
        return self.shared.number_of_actors > 0

    def _publish(self) -> None:
        t0 = time.perf_counter()
        ann = self.publisher.publish(self.version, self.model)
        if self.attest is not None:
            self.attest.published(self.version, ann.digest)
        self.metrics.scalar("learner/weight_publish_s", time.perf_counter() - t0, self.version)

    def resume(self) -> int:
        """Restore the newest checkpoint under ``<run_dir>/ckpt/``; returns its version (0: none found)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            log.warning("learner%d: no checkpoint in %s/ckpt: starting from version 0", self.rank, self.run_dir)
            return 0
        self.load_checkpoint(ckpt)
        log.info("learner%d: resumed from %s at version %d", self.rank, ckpt, self.version)
        return self.version

    def _checkpoint(self) -> None:
        """Save `<run_dir>/ckpt/v<version>` every --checkpoint_every versions and at the last; keep two."""
        every, last = self.learn.checkpoint_every, self.version == self.learn.max_steps
        if self.run_dir is None or not (last or (every and self.version % every == 0)):
            return
        self.save_checkpoint(checkpoint_dir(self.run_dir, self.version))
        if self.rank == 0:
            for old in sorted((self.run_dir / "ckpt").glob("v[0-9]*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)

    def run(self) -> dict:
        idle_s, start, tokens = 0.0, time.perf_counter(), 0
        history = History()
        if self.attest is not None:
            self.attest.record(self.version)
        if self.rank == 0 and self.version > 0:  # resumed: actors start from the version we hold
            self._publish()
        while self.version < self.learn.max_steps:
            t0 = time.perf_counter()
            table = self.client.get(self.version, self.rank, self.world_size, timeout_s=1800,
                                    on_wait=self.while_waiting,
                                    max_staleness=self.max_staleness if self.controller is not None else None)
            wait_s = time.perf_counter() - t0
            idle_s += wait_s
            mark("first_batch")
            if self.attest is not None:  # groups whose weight stamp does not match are not trained on
                table = self.attest.check(table, self.version)
            t1 = time.perf_counter()
            stats = self.train_step(table, self.bias_weights(table))
            stats["learner/max_staleness"] = self.max_staleness  # the bound this version's batch was selected under
            self._next_bound(stats)
            tokens += stats["tokens"]
            stats["learner/tokens_per_s"] = stats.pop("tokens") / (time.perf_counter() - t1)
            if torch.cuda.is_available():  # the most GPU memory torch's allocator held so far, GiB
                stats["learner/peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.version += 1
            if self.attest is not None:
                self.attest.record(self.version)
            if self.rank == 0 and (self.subscribed or self.version == self.learn.max_steps):
                self._publish()
            mark("first_version")
            self._checkpoint()
            now = time.perf_counter()
            stats.update({"learner/idle_fraction": idle_s / (now - start),  # cumulative: GET waits / wall
                          "learner/idle_fraction_version": wait_s / (now - t0),  # this version's
                          "learner/tokens_per_s_wall": tokens / (now - start)})
            stats["learner/policy_version"] = self.version
            self.metrics.histogram("learner/staleness", stats.pop("staleness_values"), step=self.version)
            self.metrics.scalars(stats, step=self.version)
            history.append(stats)
            log.info("learner%d: version %d loss %.4f reward %.3f staleness max %d logprob |diff| mean %.2e%s",
                     self.rank, self.version, stats["learner/loss"], stats["learner/reward_mean"],
                     stats["learner/staleness_max"], stats.get("learner/logprob_mismatch_mean_abs", 0.0),
                     " (no signal: step skipped)" if stats["learner/skipped_step"] else "")
        if self.rank == 0:
            self.client.stop()
            if not self.publisher.flush(timeout_s=600):
                log.warning("learner0: the final version %d did not reach every actor", self.version)
            if self.run_dir is not None and self.learn.export_final != "off":
                merged = self.learn.export_final == "merged" and not self.learn.load_in_4bit
                if self.learn.export_final == "merged" and not merged:
                    log.warning("learner0: --load_in_4bit: exporting the adapter only (merging into 4-bit "
                                "weights loses precision: merge it into the unquantized base instead)")
                final = export_final(self.model, self.run_dir / "final", self.model_dir, self.shared.tokenizer,
                                     merged=merged)
                log.info("learner0: final model (version %d) exported to %s", self.version, final)
        self.metrics.close()
        return {"rank": self.rank, "version": self.version, "history": history.rows()}

    def _next_bound(self, stats: dict) -> None:
        """--max_staleness auto: feed this version's signals to the controller (the ranks' means, so every rank
        announces the same bound); ``self.max_staleness`` becomes the bound for the next version."""
        if self.controller is None:
            return
        tags = list(SIGNALS.values())
        signals = {tag: stats[tag] for tag in tags if tag in stats}
        if self.world_size > 1:
            sums = all_reduce_sum([stats.get(t, 0.0) for t in tags] + [float(t in stats) for t in tags],
                                  self.world_size)
            signals = {t: sums[i] / sums[len(tags) + i] for i, t in enumerate(tags) if sums[len(tags) + i]}
        before = self.max_staleness
        self.max_staleness = self.controller.update(signals)
        if self.max_staleness != before:
            log.info("learner%d: max_staleness %d -> %d after version %d (%s)", self.rank, before,
                     self.max_staleness, self.version + 1,
                     ", ".join(f"{t.split('/')[-1]} {v:.4f}" for t, v in signals.items()))

    def save_checkpoint(self, directory) -> Path:
        """Checkpoint this rank at ``self.version`` (distrl.learn.checkpoint; collective with several ranks)."""
        extra = {"baseline": self.baseline.state_dict() if self.baseline is not None else None,
                 "staleness": self.controller.state_dict() if self.controller is not None else None}
        return save_checkpoint(directory, self.model, self.optimizer, self.scheduler, self.version,
                               self.config_json(), extra, self.rank, self.world_size)

    def config_json(self) -> str:
        """The options this learner reads, flat (a checkpoint's config.json)."""
        sections = (self.shared, self.staleness, self.learn)
        return json.dumps({k: v for s in sections for k, v in dataclasses.asdict(s).items()}, indent=2, sort_keys=True)

    def load_checkpoint(self, directory) -> dict:
        """Restore weights, optimizer, LR schedule, RNG, baseline, version and the moving staleness bound
        (``--max_staleness auto``) from ``directory``."""
        state = load_checkpoint(directory, self.model, self.optimizer, self.scheduler, self.rank)
        self.version = state["version"]
        if self.baseline is not None and state["extra"].get("baseline"):
            self.baseline.load_state_dict(state["extra"]["baseline"])
        if self.controller is not None and state["extra"].get("staleness"):
            self.controller.load_state_dict(state["extra"]["staleness"])
            self.max_staleness = self.controller.bound
        return state

    def close(self) -> None:
        self.client.close()
