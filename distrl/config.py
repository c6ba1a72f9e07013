"""Typed run configuration: every option once, with its unit and default.

`distrl train --help` prints these docstrings. Flags are snake_case, as in the seed's
`train_distributed.py` (`--number_of_actors`). Nothing here imports torch or vLLM, so a bad flag
fails in a fraction of a second with a message naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

TASKS = ("arith", "gsm8k", "math500", "half_vocab")


@dataclass
class TrainConfig:
    """Asynchronous RL fine-tuning: rollout actors -> replay buffer -> learners -> weights by version."""

    run_name: str = ""
    """Name of the run; its directory is `<log_dir>/<run_name>/` and must not exist yet
    (default: `distrl-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of run directories (config, segments/, weights/, tb/<role><index>/)."""
    model: str = "tiny"
    """Hub id or local directory of a causal LM; `tiny` builds the embedded tiny Qwen2 model in code."""
    tokenizer: Optional[str] = None
    """Tokenizer hub id or directory (default: the model's own)."""
    dataset: Optional[str] = None
    """Hub id (e.g. `openai/gsm8k`) or a local .jsonl/.parquet file; unused by the built-in tasks."""
    task: Optional[Literal["arith", "gsm8k", "math500", "half_vocab"]] = None
    """Task (prompt template + reward): arith, gsm8k, math500, half_vocab. Default: inferred from the
    dataset's fields or name, `arith` when no dataset is given."""
    number_of_actors: int = 1
    """Rollout actors (each one generation engine)."""
    number_of_learners: int = 1
    """Learners; more than one form a torch.distributed group that averages gradients."""
    batch_size: int = 4
    """Groups consumed per policy version, across all learners."""
    group_size: int = 4
    """Completions sampled per prompt (n); a group is those n completions."""
    topk: Optional[int] = None
    """Completions kept per group for training, the k best by reward (default: all n)."""
    learner: Literal["pg", "grpo"] = "grpo"
    """Loss: `pg` (REINFORCE, group-mean baseline) or `grpo` (group-normalized advantages, clipped ratio)."""
    learner_chunk_size: int = 8
    """Completions per forward/backward micro-batch (gradient accumulation; equals the full-batch step)."""
    max_staleness: int = 1
    """Largest `learner_version - policy_version` of a completion used to train; 0 is on-policy."""
    max_steps: int = 10
    """Policy versions to produce (one optimizer step of the learner group each)."""
    learning_rate: float = 1e-5
    """AdamW learning rate."""
    clip_eps: float = 0.2
    """GRPO/PPO ratio clip: the importance ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA alpha (scale = alpha / r)."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides its logits by the same value."""
    max_new_tokens: int = 256
    """Longest completion in tokens; longer ones stop with finish_reason `length`."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the engine accepts, in tokens (default: the model's own limit)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for engine and learner (`auto`: float32 on CPU, bfloat16 on GPU)."""
    seed: int = 0
    """Seed for prompts, sampling and initialization."""
    ray_address: Optional[str] = None
    """Address of an existing Ray cluster; default starts a local one."""
    host: str = "127.0.0.1"
    """Address the buffer and weight endpoints bind to (loopback unless you need other hosts)."""

    def __post_init__(self) -> None:
        if not self.run_name:
            self.run_name = time.strftime("distrl-%Y%m%d-%H%M%S")
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        positive = ("number_of_actors", "number_of_learners", "batch_size", "group_size", "learner_chunk_size",
                    "max_steps", "lora_rank", "max_new_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.topk is not None and not 1 <= self.topk <= self.group_size:
            raise ValueError(f"--topk must be in [1, --group_size={self.group_size}], got {self.topk}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.batch_size % self.number_of_learners:
            raise ValueError(f"--batch_size {self.batch_size} must be a multiple of "
                             f"--number_of_learners {self.number_of_learners} (each learner takes a shard)")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}")
        if os.sep in self.run_name or self.run_name in ("", ".", ".."):
            raise ValueError(f"--run_name must be a plain name, got {self.run_name!r}")

    @property
    def k(self) -> int:
        """Completions kept per group."""
        return self.topk or self.group_size

    @property
    def run_dir(self) -> Path:
        return Path(self.log_dir).resolve() / self.run_name

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls(**json.loads(text))
