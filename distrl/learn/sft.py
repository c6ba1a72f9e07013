"""Supervised warm start (`distrl train --warm_start_steps N`): fine-tune the base model on gold answers.

Before any role starts, the driver trains the whole base model (every weight; no LoRA) for N AdamW
steps on the task's own problems, teacher-forced: the input is ``prompt + gold + EOS`` and the
cross-entropy is taken on the answer and EOS tokens only (the prompt's tokens get no loss), so the
model learns the answer format and when to stop. With ``--env`` the input is a whole demonstrated episode
(``transcript``: the command layer passes the environment's demonstrations in, so this package imports no
rollout code) and the loss is on the model's turns only, never on the environment's observations. The
result is saved with ``save_pretrained`` (model and tokenizer) to ``<run_dir>/warm_start/``, and every
role then uses that directory as its base model: policy version 0 *is* the warm-started model, and RL
alone earns what comes after.

Training problems come from the task's stream under a seed of their own (:data:`SFT_SEED`), apart
from the actors' (``seed * 1000 + actor_id``); with the built-in ``arith`` task a held-out problem may
still also appear here by chance (10,000 two-digit additions exist).

Why: a tiny random model almost never answers ``37+45=`` right, so GRPO gets no reward signal at all
(every group scores 0). About 350 steps of supervised learning (20-110 s on 2 CPU cores, by load) bring
the tiny model's greedy accuracy on two-digit addition to ~25 %, where sampled groups have reward variance
and RL can take over (`docs/demo.md`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("distrl.sft")

SFT_SEED = 7_777_777  # problems(seed) of the warm start: a stream no actor draws from
UNTIL_WINDOW = 5  # batches averaged for --warm_start_until_accuracy


def exact_match(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose every labelled token is the argmax of the logits before it.

    `logits` (B, L, V) and `labels` (B, L, -100 where unlabelled) of a teacher-forced batch. Under teacher
    forcing, all answer and EOS tokens being the argmax means greedy decoding writes exactly that answer and
    stops: this is the batch's greedy accuracy, measured on problems the model has not trained on yet
    (each batch is fresh), for free from the training forward pass.
    """
    pred, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    ok = (pred == target) | (target == -100)
    return ok.all(dim=1).float().mean().item()


@dataclass
class SFTResult:
    """What :func:`warm_start` did: the output directory, losses of the first and last step (nats per
    answer token), steps taken, wall seconds, and the exact match of the last batches."""

    model_dir: Path
    first_loss: float
    last_loss: float
    steps: int
    wall_s: float
    exact_match: float  # mean exact-match fraction of the last UNTIL_WINDOW batches (see exact_match)


def sft_batch(tokenizer, prompts: list[str], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor,
                                                                           torch.Tensor]:
    """Teacher-forcing tensors for ``prompt + answer + EOS``, right-padded (:func:`segments_batch` of
    ``[(prompt ids, False), (answer ids + [EOS], True)]`` each).

    Returns ``input_ids`` (B, L), ``attention_mask`` (B, L) and ``labels`` (B, L): ``labels`` is -100
    on prompt and padding positions and the token id on answer and EOS positions (transformers shifts
    labels by one inside the model's loss). Raises ValueError if the tokenizer has no EOS token.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the warm start needs a tokenizer with an EOS token (completions must learn to stop)")
    examples = [[(tokenizer(prompt, add_special_tokens=True)["input_ids"], False),
                 (tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos], True)]
                for prompt, answer in zip(prompts, answers)]
    return segments_batch(examples, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)


def segments_batch(examples: list[list[tuple[list[int], bool]]], pad: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """Teacher-forcing tensors of sequences given as segments ``(token ids, trained)``, right-padded with ``pad``.

    Each example is its segments' ids in order; ``labels`` is the token id on the positions of trained segments
    and -100 elsewhere (the prompt, an environment's observations, padding). Returns ``input_ids``,
    ``attention_mask`` and ``labels``, each (B, L) int64, L the longest example. Raises ValueError for an
    example with no trained token.
    """
    width = max(sum(len(ids) for ids, _ in segments) for segments in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, segments in enumerate(examples):
        if not any(trained and part for part, trained in segments):
            raise ValueError("every warm-start example needs at least one trained token")
        at = 0
        for part, trained in segments:
            ids[i, at:at + len(part)] = torch.tensor(part, dtype=torch.long)
            if trained:
                labels[i, at:at + len(part)] = torch.tensor(part, dtype=torch.long)
            at += len(part)
        mask[i, :at] = 1
    return ids, mask, labels


def _next_batch(task, tok, batch: list, transcript, pad: int):
    """``(input_ids, attention_mask, labels)`` of ``batch``'s problems: their transcripts' segments, or (None)
    the task's prompt then its gold answer and EOS (:func:`sft_batch`)."""
    if transcript is None:
        return sft_batch(tok, [task.prompt(p, tok) for p in batch], [p.gold for p in batch])
    return segments_batch([transcript(p, tok) for p in batch], pad)


def warm_start(model_dir: str | Path, out_dir: str | Path, task, *, steps: int, learning_rate: float,
               batch_size: int, seed: int = 0, tokenizer: str | None = None, dtype: str = "float32",
               log_every: int = 50, until_accuracy: float | None = None,
               transcript: Callable[[object, object], list[tuple[list[int], bool]]] | None = None) -> SFTResult:
    """Fine-tune the causal LM in `model_dir` on `task`'s gold answers and save it to `out_dir`.

    Args:
        model_dir: hub id or directory of the base model (the run's ``--model``, or the tiny build).
        out_dir: where the model and tokenizer are saved (``save_pretrained``); created.
        task: a :class:`distrl.rollout.tasks.Task`; its ``problems(SFT_SEED)``, ``prompt`` and ``gold`` are used.
        steps: optimizer steps (>= 1). learning_rate: AdamW learning rate (> 0), constant.
        batch_size: problems per step (>= 1).
        seed: torch seed of the run (the problem stream has its own seed, :data:`SFT_SEED`).
        tokenizer: another tokenizer's hub id or directory (default: the model's).
        dtype: torch dtype name of the weights while training (``auto`` is float32 on CPU).
        log_every: steps between log lines.
        until_accuracy: stop before `steps` once the mean :func:`exact_match` (greedy accuracy) of the last
            :data:`UNTIL_WINDOW` batches reaches this fraction (None: always `steps`). On two-digit addition
            the tiny model's accuracy jumps from ~5 % to ~60 % within ~150 steps, at a step that moves with
            the data order: a fixed step count lands anywhere in that jump, a target does not.
        transcript: ``(problem, tokenizer) -> segments`` of one training sequence, ``(token ids, trained)`` in
            order (:func:`segments_batch`), e.g. a whole multi-turn episode whose observations are not trained
            on (``distrl train --env``: the command passes those of ``distrl.rollout.envs.demonstrations``). None: the
            task's prompt, then its gold answer and EOS trained.
    Returns:
        :class:`SFTResult`. Raises ValueError on steps, learning_rate or batch_size out of range.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distrl.core.dtypes import resolve_dtype

    if steps < 1 or batch_size < 1 or not learning_rate > 0:
        raise ValueError(f"warm start needs steps >= 1, batch_size >= 1, learning_rate > 0; got {steps}, "
                         f"{batch_size}, {learning_rate}")
    start = time.perf_counter()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(tokenizer or model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(dtype))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    problems = task.problems(SFT_SEED)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    first = last = float("nan")
    recent: list[float] = []  # exact-match fractions of the last UNTIL_WINDOW batches
    for step in range(1, steps + 1):
        ids, mask, labels = _next_batch(task, tok, [next(problems) for _ in range(batch_size)], transcript, pad)
        labels = labels.to(device)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels)
        recent = (recent + [exact_match(out.logits.detach(), labels)])[-UNTIL_WINDOW:]
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        last = out.loss.item()
        first = last if step == 1 else first
        accuracy = sum(recent) / len(recent)
        done = until_accuracy is not None and len(recent) == UNTIL_WINDOW and accuracy >= until_accuracy
        if step % log_every == 0 or step == steps or done:
            log.info("warm start: step %d/%d loss %.4f exact match (last %d batches) %.3f", step, steps, last,
                     len(recent), accuracy)
        if done:
            break
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return SFTResult(out_dir, first, last, step, time.perf_counter() - start, accuracy)
