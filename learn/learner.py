"""The learner loop: GET a batch for version V -> loss -> (all-reduce) -> step -> V+1 -> publish.

One policy version is one optimizer step of the learner group. Each of the L learners GETs its shard
of the buffer's one selection for version V and then, per version:

1. all-reduces the batch totals (tokens, completions, reward sum, completions with a non-zero
   advantage), which fix the loss normalizers of the whole version (``learn.losses.Normalizer``) and
   the running-mean baseline, identically on every rank;
2. accumulates gradients over micro-batches of ``--learner_chunk_size`` completions (each micro-batch's
   loss is its share of the global loss, so the sum equals the full-batch step, for every aggregation);
3. sums gradients across learners (``learn.distributed``), clips them to ``--max_grad_norm``, steps
   AdamW and the learning-rate schedule (``learn.optim``);
4. rank 0 saves the weights as version V+1 and announces them (format ``lora`` or ``full``).

Zero-variance groups have all-zero advantages and contribute exactly zero to the policy term (no NaN:
``distrl.core.advantages`` returns exact zeros). When the WHOLE version's batch (all ranks) has zero
advantages and there is no KL term, the gradient would be exactly zero but AdamW would still move the
weights along its momentum; the learner then skips the forward, backward and optimizer step, still
advances the learning-rate schedule, increments the version (the weights are unchanged) and publishes
it, and logs ``learner/skipped_step = 1``: actors and the buffer keep their version contract.

With ``--truncation mask`` (DAPO's overlong filtering) completions cut at the length limit get no loss
and are not counted by the normalizers (:meth:`Learner.in_loss`); their rewards still count in the
version's reward. After the last version rank 0 exports ``<run_dir>/final/`` (``--export_final``,
``learn.model.export_final``).

Works under Ray (``distrl.cmd.trainer.LearnerRole`` creates the process group) and under torchrun
(:func:`init_distributed_from_env`, re-exported here from ``learn.distributed``).
"""

from __future__ import annotations

import logging
import shutil
import time
from array import array
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import pyarrow as pa
import torch

from distrl.core.metrics import Metrics
from learn.baseline import RunningMeanBaseline
from learn.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from learn.config import LearnOptions
from learn.distributed import all_reduce_grads, all_reduce_sum, broadcast_params, init_distributed_from_env
from learn.logprobs import head_impl, token_logprobs
from learn.losses import LossConfig, Normalizer, policy_loss
from learn.model import body_and_head, export_final, frozen_reference, load_policy, reference_context, save_for_publish
from learn.optim import build_optimizer
from learn.tensor_metrics import to_floats

__all__ = ["Learner", "MicroBatch", "collate", "init_distributed_from_env", "loss_config", "pack"]
log = logging.getLogger("distrl.learner")


class History:
    """The per-version series `Learner.run` returns (``rows()``: one dict per version with the keys of
    ``TAGS``; every other metric is in TensorBoard only), held as typed arrays: 40 bytes a version, where a
    dict of every metric per version cost ~2 KB (gigabytes over a week-long run)."""

    TAGS = {"learner/loss": "d", "learner/reward_mean": "d", "learner/grad_norm": "d",
            "learner/staleness_mean": "d", "learner/staleness_max": "q"}  # tag -> array type code

    def __init__(self) -> None:
        self.series = {tag: array(code) for tag, code in self.TAGS.items()}

    def append(self, stats: dict) -> None:
        """Record one version's ``stats`` (must hold every tag of ``TAGS``; other keys are ignored)."""
        for tag, series in self.series.items():
            series.append(stats[tag])

    def rows(self) -> list[dict]:
        return [dict(zip(self.series, row)) for row in zip(*self.series.values())]

    @property
    def nbytes(self) -> int:
        return sum(s.itemsize * len(s) for s in self.series.values())


@dataclass
class MicroBatch:
    """Right-padded tensors of b completions; position t predicts token t+1 of prompt+completion.

    input_ids, attention_mask, targets, mask, behavior_logprobs: (b, L-1); advantages: (b,).
    Packed (:func:`pack`): the model instead runs on ``packed_ids`` and ``packed_positions`` (R, P):
    the b sequences laid end to end in R rows of at most ``--learner_pack_tokens`` tokens, positions
    restarting at 0 at each sequence, so attention stays inside each sequence; ``packed_index`` (n,)
    gives, for each completion position ``mask > 0`` of the padded layout (row-major), its flat index
    into the (R * P) packed positions. The loss still reads the padded (b, L-1) tensors.
    ``completion_index`` (n,): the flat (row-major) indices of the positions ``mask > 0``, computed from
    ``mask`` when the micro-batch is made (on the host), so that selecting them on the device needs no
    sync (a boolean mask index would wait for the GPU to learn n).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    packed_ids: Optional[torch.Tensor] = None
    packed_positions: Optional[torch.Tensor] = None
    packed_index: Optional[torch.Tensor] = None
    completion_index: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.completion_index is None:
            self.completion_index = (self.mask.reshape(-1) > 0).nonzero().reshape(-1)

    def to(self, device: torch.device) -> "MicroBatch":
        """The same micro-batch on ``device`` (the model's); to a GPU through pinned memory without
        waiting (the copy is queued behind the work already launched)."""
        cuda = torch.device(device).type == "cuda"

        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            return t.pin_memory().to(device, non_blocking=True) if cuda and t.device.type == "cpu" else t.to(device)

        return MicroBatch(*(move(getattr(self, f.name)) for f in fields(self)))


def collate(rows: list[dict], pad_id: int, advantages: Optional[list[float]] = None) -> MicroBatch:
    """Build a MicroBatch from completion rows (dicts of distrl.core.wire.COMPLETION_SCHEMA).

    ``advantages`` (one per row) replaces the rows' own ``advantage`` (a learner-state baseline).
    """
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
    adv = [r["advantage"] for r in rows] if advantages is None else advantages
    return MicroBatch(input_ids, attention, targets, mask, behavior, torch.tensor(adv, dtype=torch.float32))


def pack(mb: MicroBatch, pad_id: int, pack_tokens: int) -> MicroBatch:
    """``mb`` with its sequences packed into rows of at most ``pack_tokens`` tokens (no padding waste).

    First-fit decreasing: each sequence (its ``attention_mask`` length) goes into the first row with
    room, longest first; one longer than ``pack_tokens`` gets a row of its own. Rows are right-padded
    to the fullest row's length; the padding is a segment of its own (positions from 0) that no
    completion position reads. transformers (>= 5) turns position ids that restart at 0 into a
    block-diagonal causal mask when no attention mask is given (``masking_utils``,
    ``find_packed_sequence_indices``), for the sdpa and eager attention of Qwen2/Llama-like models.
    Raises ValueError for ``pack_tokens < 1``.
    """
    if pack_tokens < 1:
        raise ValueError(f"--learner_pack_tokens must be >= 1 to pack, got {pack_tokens}")
    lengths = mb.attention_mask.sum(1).tolist()  # (b,) tokens of each sequence
    rows: list[list[int]] = []  # sequence indices per row
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, f in enumerate(fill) if f + lengths[i] <= pack_tokens), None)
        if j is None:
            rows.append([])
            fill.append(0)
            j = len(rows) - 1
        rows[j].append(i)
        fill[j] += lengths[i]
    width = max(fill)
    packed_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    start = torch.zeros(len(lengths), dtype=torch.long)  # flat packed index of each sequence's token 0
    for r, seqs in enumerate(rows):
        offset = 0
        for i in seqs:
            n = lengths[i]
            packed_ids[r, offset:offset + n] = mb.input_ids[i, :n]
            positions[r, offset:offset + n] = torch.arange(n)
            start[i] = r * width + offset
            offset += n
        positions[r, offset:] = torch.arange(width - offset)  # padding: its own segment
    seq, pos = mb.completion_index // mb.mask.shape[1], mb.completion_index % mb.mask.shape[1]  # row-major
    return MicroBatch(mb.input_ids, mb.attention_mask, mb.targets, mb.mask, mb.behavior_logprobs, mb.advantages,
                      packed_ids, positions, start[seq] + pos, mb.completion_index)


def loss_config(cfg: LearnOptions) -> LossConfig:
    """The objective of ``cfg`` (``dr_grpo`` is GRPO's clipped ratio with its own aggregation)."""
    eps = cfg.clip_eps
    off = cfg.off_policy_config()
    return LossConfig(kind="pg" if cfg.learner == "pg" else "grpo",
                      clip_eps_low=eps if cfg.clip_eps_low is None else cfg.clip_eps_low,
                      clip_eps_high=eps if cfg.clip_eps_high is None else cfg.clip_eps_high,
                      kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, off_policy=off)


class Learner:
    """One learner rank. `run()` trains `max_steps` versions and returns a summary dict.

    ``cfg`` is the command's composed config (`distrl.cmd.config.LearnConfig` or `TrainConfig`): learn/config.py's
    section and the shared ones of distrl/core/run_options.py.

    ``train_step(table)`` is the whole step on one shard (usable without a buffer); ``accumulate``
    only computes the gradients (tests compare micro-batchings with it).
    """

    def __init__(self, cfg: LearnOptions, rank: int, world_size: int, buffer_address: str, model_dir: str,
                 publisher=None, transport=None, tb_dir: str | None = None, broadcast_host: str | None = None,
                 run_dir: str | Path | None = None):
        from buffer.client import BufferClient

        self.cfg, self.rank, self.world_size, self.model_dir = cfg, rank, world_size, model_dir
        torch.manual_seed(cfg.seed)
        self.model = load_policy(model_dir, cfg.dtype, cfg.lora_rank, cfg.lora_alpha, cfg.max_model_len or 2048,
                                 cfg.seed, finetune=cfg.finetune, backend=cfg.backend,
                                 target_modules=cfg.lora_target_modules, load_in_4bit=cfg.load_in_4bit)
        self.body, self.head = body_and_head(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        if cfg.learner_pack_tokens and cfg.backend == "unsloth" and self.device.type == "cuda":
            raise ValueError("--learner_pack_tokens needs --backend hf on a GPU: Unsloth's own attention "
                             "does not split packed rows at position-id restarts")
        if cfg.gradient_checkpointing:  # HF recomputes each decoder layer in backward (train mode only)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.train()  # Qwen2/Llama have no dropout by default; LoRA is built with lora_dropout=0
        if cfg.learner_compile and self.device.type == "cuda":
            for layer in self.body.layers:
                layer.compile(dynamic=True)
        if self.device.type == "cuda" and self.params[0].dtype in (torch.bfloat16, torch.float16):
            # The fp32 head multiplies bf16-valued hidden states and weights: TF32 inputs hold bf16 values
            # exactly, so the forward logits keep fp32 accumulation at tensor-core speed. (An fp32 model
            # keeps full fp32 matmuls.)
            torch.backends.cuda.matmul.allow_tf32 = True
        self.head_impl, why = head_impl(cfg.learner_head, self.head, cfg.temperature)
        log.info("learner%d: LM head %s (%s)", rank, self.head_impl, why)
        broadcast_params(self.params, world_size)
        self.optimizer, self.scheduler = build_optimizer(self.params, cfg.learning_rate, cfg.lr_warmup_steps,
                                                         cfg.max_steps, cfg.lr_schedule)
        self.loss_cfg = loss_config(cfg)
        self.baseline = RunningMeanBaseline(cfg.baseline_decay) if cfg.pg_baseline == "running_mean" else None
        self.reference = None  # (body, head) of a frozen copy: full fine-tuning with a KL term
        if cfg.kl_coef > 0 and cfg.finetune == "full":
            self.reference = frozen_reference(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        self.client = BufferClient(buffer_address, f"learner{rank}", timeout_s=60.0,
                                   curve_server_key=cfg.buffer_curve_server_key,
                                   curve_client_key=cfg.buffer_curve_client_key)
        self.publisher, self.transport = publisher, transport
        self.run_dir = None if run_dir is None else Path(run_dir)  # checkpoints go to <run_dir>/ckpt/
        self.broadcaster = None  # rank 0 with --weights_transport nccl: full weights by collective broadcast
        if publisher is not None and cfg.weights_transport == "nccl":
            from distrl.weights.nccl import BroadcastSender

            self.broadcaster = BroadcastSender(broadcast_host or cfg.host, cfg.weights_broadcast_port,
                                               cfg.number_of_actors, self.device)
        self.metrics = Metrics(tb_dir)
        self.version = 0
        # Called as while_waiting(version) each time a GET has to wait (--learner_generates sets it to
        # generate with this model); returns True if it did work, False to let the GET sleep instead.
        self.while_waiting = None

    # ---- one micro-batch ---------------------------------------------------------------------

    def _logprobs(self, body, head, mb: MicroBatch, entropy: bool):
        """Learner logprobs (b, T) fp32, zero off the completion [, entropy (n,)]; the head runs on
        completion positions only (prompt logits are never needed)."""
        index = mb.completion_index  # (n,) flat positions of mask > 0, row-major
        if mb.packed_ids is None:
            hidden = body(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)  # (n, H), completion positions only
        else:  # packed rows: no attention mask, positions restart per sequence (see `pack`)
            hidden = body(input_ids=mb.packed_ids, position_ids=mb.packed_positions, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.packed_index)  # (n, H), padded order
        targets = mb.targets.reshape(-1).index_select(0, index)
        out = token_logprobs(hidden.unsqueeze(0), head, targets.unsqueeze(0), self.cfg.temperature,
                             chunk_tokens=self.cfg.learner_head_chunk_tokens, return_entropy=entropy,
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
        # One optimizer step per version: this forward runs at the proximal weights (learn.offpolicy).
        loss, m = policy_loss(logp, mb.behavior_logprobs, mb.advantages, mb.mask, norm, self.loss_cfg,
                              proximal_logprobs=logp.detach(), ref_logprobs=ref, sync=False)
        loss.backward()
        m["loss"] = loss.detach()
        m["entropy_sum"] = entropy.sum()
        return m  # 0-dim device tensors: read once per step (`accumulate`), not per micro-batch

    # ---- one version -------------------------------------------------------------------------

    def prepare(self, rows: list[dict]) -> tuple[Normalizer, list[float], dict]:
        """All-reduced batch totals -> (normalizer, this rank's advantages, totals)."""
        loss = [self.in_loss(r) for r in rows]  # --truncation mask: truncated completions get no loss
        tokens = sum(len(r["completion_ids"]) for r, k in zip(rows, loss) if k)
        reward_sum = sum(r["reward"] for r in rows)
        nonzero = sum(r["advantage"] != 0.0 for r, k in zip(rows, loss) if k)
        n_tok, n_seq, r_sum, n_nonzero, n_rows = all_reduce_sum([tokens, sum(loss), reward_sum, nonzero, len(rows)],
                                                                self.world_size)
        totals = {"tokens": n_tok, "sequences": n_seq, "reward_mean": r_sum / max(n_rows, 1.0)}
        advantages = [r["advantage"] for r in rows]
        if self.baseline is not None:
            advantages = self.baseline.advantages([r["reward"] for r in rows], totals["reward_mean"])
            n_nonzero = all_reduce_sum([sum(a != 0.0 for a, k in zip(advantages, loss) if k)], self.world_size)[0]
        totals["signal"] = n_nonzero > 0 or (self.loss_cfg.kl_coef > 0 and n_seq > 0)
        norm_tokens = float(self.cfg.loss_norm_tokens or self.cfg.max_new_tokens)
        norm = Normalizer(self.cfg.aggregation, n_tok, n_seq, norm_tokens)
        return norm, advantages, totals

    def in_loss(self, row: dict) -> bool:
        """Whether a completion row gets a loss: with ``--truncation mask`` (DAPO's overlong filtering)
        those cut at the length limit (finish_reason ``length``) do not; their tokens count nowhere."""
        return self.cfg.truncation != "mask" or row["finish_reason"] != "length"

    def accumulate(self, rows: list[dict], advantages: list[float], norm: Normalizer) -> list[dict]:
        """Forward/backward over micro-batches of ``learner_chunk_size``; gradients accumulate in .grad.
        Rows that get no loss (:meth:`in_loss`) are left out."""
        keep = [i for i, r in enumerate(rows) if self.in_loss(r)]
        rows, advantages = [rows[i] for i in keep], [advantages[i] for i in keep]
        parts, chunk = [], self.cfg.learner_chunk_size
        for start in range(0, len(rows), chunk):
            mb = collate(rows[start:start + chunk], self.pad_id, advantages[start:start + chunk])
            if self.cfg.learner_pack_tokens:
                mb = pack(mb, self.pad_id, self.cfg.learner_pack_tokens)
            mb = mb.to(self.device)
            parts.append(self._forward_backward(mb, norm))
        return to_floats(parts)  # the step's one wait for the device

    def train_step(self, table: pa.Table) -> dict:
        """One optimizer step of this rank on its shard; returns metrics of the version's batch."""
        rows = table.to_pylist()
        norm, advantages, totals = self.prepare(rows)
        lr = self.optimizer.param_groups[0]["lr"]
        parts, grad_norm = [], 0.0
        if totals["signal"]:
            parts = self.accumulate(rows, advantages, norm)
            all_reduce_grads(self.params, self.world_size)
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
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
        stats = _combine(parts, rows, self.version, grad_norm)
        stats.update({"learner/loss": loss, "learner/reward_mean": totals["reward_mean"], "learner/lr": lr,
                      "learner/skipped_step": 0.0 if totals["signal"] else 1.0,
                      "learner/truncated_fraction": sum(r["finish_reason"] == "length" for r in rows)
                      / max(len(rows), 1),
                      "learner/advantage_abs_mean": sum(abs(a) for a in advantages) / max(len(advantages), 1)})
        if self.baseline is not None:
            stats["learner/baseline"] = self.baseline.value
        return stats

    def _publish(self) -> None:
        t0 = time.perf_counter()
        fmt = "lora" if self.cfg.finetune == "lora" else "full"
        if self.broadcaster is not None:
            ann = self.broadcaster.publish(self.version, list(self.model.named_parameters()))
        else:
            ann = self.transport.publish(self.version, fmt,
                                         lambda d: save_for_publish(self.model, d, self.cfg.finetune))
        self.publisher.announce(ann)
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
        every, last = self.cfg.checkpoint_every, self.version == self.cfg.max_steps
        if self.run_dir is None or not (last or (every and self.version % every == 0)):
            return
        self.save_checkpoint(checkpoint_dir(self.run_dir, self.version))
        if self.rank == 0:
            for old in sorted((self.run_dir / "ckpt").glob("v[0-9]*"))[:-2]:
                shutil.rmtree(old, ignore_errors=True)

    def run(self) -> dict:
        idle_s, start, tokens = 0.0, time.perf_counter(), 0
        history = History()
        if self.rank == 0 and self.version > 0:  # resumed: actors start from the version we hold
            self._publish()
        while self.version < self.cfg.max_steps:
            t0 = time.perf_counter()
            waiting = None if self.while_waiting is None else (lambda: self.while_waiting(self.version))
            table = self.client.get(self.version, self.rank, self.world_size, timeout_s=1800, on_wait=waiting)
            wait_s = time.perf_counter() - t0
            idle_s += wait_s
            t1 = time.perf_counter()
            stats = self.train_step(table)
            tokens += stats["tokens"]
            stats["learner/tokens_per_s"] = stats.pop("tokens") / (time.perf_counter() - t1)
            if torch.cuda.is_available():  # the most GPU memory torch's allocator held so far, GiB
                stats["learner/peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            self.version += 1
            if self.rank == 0:
                self._publish()
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
            if self.broadcaster is not None and not self.broadcaster.flush(timeout_s=600):
                log.warning("learner0: actors did not join the broadcast of the final version %d", self.version)
            if self.run_dir is not None and self.cfg.export_final != "off":
                merged = self.cfg.export_final == "merged" and not self.cfg.load_in_4bit
                if self.cfg.export_final == "merged" and not merged:
                    log.warning("learner0: --load_in_4bit: exporting the adapter only (merging into 4-bit "
                                "weights loses precision: merge it into the unquantized base instead)")
                final = export_final(self.model, self.run_dir / "final", self.model_dir, self.cfg.tokenizer,
                                     merged=merged)
                log.info("learner0: final model (version %d) exported to %s", self.version, final)
        self.metrics.close()
        return {"rank": self.rank, "version": self.version, "history": history.rows()}

    def save_checkpoint(self, directory) -> Path:
        """Checkpoint this rank at ``self.version`` (learn.checkpoint; collective with several ranks)."""
        extra = {"baseline": self.baseline.state_dict() if self.baseline is not None else None}
        return save_checkpoint(directory, self.model, self.optimizer, self.scheduler, self.version,
                               self.cfg.to_json(), extra, self.rank, self.world_size)

    def load_checkpoint(self, directory) -> dict:
        """Restore weights, optimizer, LR schedule, RNG, baseline and version from ``directory``."""
        state = load_checkpoint(directory, self.model, self.optimizer, self.scheduler, self.rank)
        self.version = state["version"]
        if self.baseline is not None and state["extra"].get("baseline"):
            self.baseline.load_state_dict(state["extra"]["baseline"])
        return state

    def close(self) -> None:
        self.client.close()
        if self.broadcaster is not None:
            self.broadcaster.close()


def _combine(parts: list[dict], rows: list[dict], version: int, grad_norm: float) -> dict:
    """Token-weighted means of micro-batch metrics (maxima of ``*_max``, minima of ``*_min``), and
    batch-level statistics of this rank's shard. An empty ``parts`` (skipped step) gives no loss metrics."""
    n = sum(p["masked_tokens"] for p in parts)
    staleness = [version - r["policy_version"] for r in rows] or [0]
    stats = {
        "learner/grad_norm": grad_norm,
        "learner/staleness_mean": sum(staleness) / len(staleness),
        "learner/staleness_max": max(staleness),
        "learner/completion_tokens": float(sum(len(r["completion_ids"]) for r in rows)),
        "staleness_values": staleness,
        "tokens": sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows),
    }
    if not parts or n == 0:
        return stats
    stats["learner/entropy"] = sum(p["entropy_sum"] for p in parts) / n
    skip = {"masked_tokens", "loss", "entropy_sum"}
    for key in sorted({k for p in parts for k in p} - skip):
        values = [(p[key], p["masked_tokens"]) for p in parts if key in p]
        if key.endswith("_max"):
            stats[f"learner/{key}"] = max(v for v, _ in values)
        elif key.endswith("_min"):
            stats[f"learner/{key}"] = min(v for v, _ in values)
        else:
            stats[f"learner/{key}"] = sum(v * w for v, w in values) / n
    return stats
