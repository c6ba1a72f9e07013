"""Each command's config: named sections (composition, `distrl/cmd/compose.py`); the rules joining two sections.

Sections (every option declared once, with its unit and default, in the package that reads it), by the name
each has in the commands' configs:

| name: section | module | read by |
|---|---|---|
| shared: SharedOptions, batch, staleness | distrl/core/run_options.py | actors, learners (batch, staleness: buffer) |
| prompt, generation: TaskOptions, rollout | distrl/rollout/config.py | generators (eval: prompt); actors |
| learn: LearnOptions, warm_start: WarmStartOptions | distrl/learn/config.py | learners; the warm start |
| keep: TopkOptions, selection, storage, endpoint: BufferEndpoint | distrl/buffer/config.py | the buffer |
| file: ConfigFile, run: RunOptions, train: TrainOptions | distrl/cmd/sections.py | the commands |
| endpoints: LearnEndpoints, actor: RolloutEndpoints | here | `distrl learn`, `distrl rollout` |

ReplayConfig and EvalConfig (distrl/cmd/config_offline.py) are composed the same way (selection; prompt).

`distrl train` takes every section; `distrl learn|rollout|buffer` only those its role reads, so their
`--help` lists only those. Building a config resolves each section's derived values once (``resolve``:
the default --run_name, absolute paths), then the role counts (--gpu_split's), then ``validate`` runs each
section's ``check`` and this module's cross-section rules; neither changes the config. Nothing here imports
torch or vLLM, so a bad flag fails in a fraction of a second with a message naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from distrl.buffer.config import (
    DEFAULT_BUFFER_ADDRESS,
    BufferEndpoint,
    SelectionOptions,
    StorageOptions,
    TopkOptions,
    buffer_options,
)
from distrl.cmd.compose import composed
from distrl.cmd.config_offline import EvalConfig, ReplayConfig
from distrl.cmd.sections import ConfigFile, RunOptions, TrainOptions, gpu_split_counts, ray_resources
from distrl.core.run_options import BatchOptions, SharedOptions, StalenessOptions
from distrl.learn.config import LearnOptions, WarmStartOptions, aggregation_in_effect
from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions
from distrl.weights import transport

__all__ = ["BufferConfig", "EvalConfig", "LearnConfig", "ReplayConfig", "RolloutConfig", "TrainConfig",
           "SelectionOptions", "StorageOptions", "buffer_options", "ray_resources", "loss_aggregation",
           "kept_per_group"]

DEFAULT_WEIGHTS_PUB = "tcp://127.0.0.1:5556"
DEFAULT_WEIGHTS_ENDPOINT = "tcp://127.0.0.1:5557"


def settle_roles(cfg) -> None:
    """The role counts: --gpu_split's, else 1 for an unset count; an unset --weights_transport is `fs` for the
    separate launchers (`distrl train` picks it once its roles are placed, distrl.cmd.nodes)."""
    for name, value in gpu_split_counts(cfg).items():
        setattr(cfg, name, value)
    for name in ("number_of_actors", "number_of_learners"):
        if hasattr(cfg, name) and getattr(cfg, name) is None:
            setattr(cfg, name, 1)
    if getattr(cfg, "weights_transport", "") is None and not isinstance(cfg, TrainConfig):
        cfg.weights_transport = "fs"


def loss_aggregation(learn: LearnOptions, shared: SharedOptions) -> str:
    """The loss aggregation in effect (--loss_aggregation, or the --learner's default)."""
    return aggregation_in_effect(shared.learner, learn.loss_aggregation)


def kept_per_group(keep: TopkOptions, batch: BatchOptions) -> int:
    """Completions kept per group (--topk, or all --group_size)."""
    return keep.topk or batch.group_size


# The rules joining two sections; each command lists those whose sections it has.
def topk_fits_group(cfg) -> None:
    if cfg.keep.topk is not None and not 1 <= cfg.keep.topk <= cfg.batch.group_size:
        raise ValueError(f"--topk must be in [1, --group_size={cfg.batch.group_size}], got {cfg.keep.topk}")


def learners_share_the_batch(cfg) -> None:
    if cfg.batch.batch_size % cfg.learn.number_of_learners:
        raise ValueError(f"--batch_size {cfg.batch.batch_size} must be a multiple of "
                         f"--number_of_learners {cfg.learn.number_of_learners} (each learner takes a shard)")


def actors_exist(cfg) -> None:
    shared = cfg.shared
    generates = hasattr(cfg, "learn") and cfg.learn.learner_generates
    if shared.number_of_actors < (0 if generates else 1):
        raise ValueError(f"--number_of_actors must be >= 1 (>= 0 with --learner_generates), "
                         f"got {shared.number_of_actors}")
    if shared.number_of_actors == 0 and transport(shared.weights_transport).needs_actors:
        raise ValueError(f"--weights_transport {shared.weights_transport} needs at least one actor "
                         "(--number_of_actors 0)")


def env_fits(cfg) -> None:
    """--env (multi-turn episodes) runs on the actors' engines; --learner_generates makes single completions; the
    warm start with --env trains on the environment's demonstrations (distrl/rollout/envs/demonstrations.py)."""
    from distrl.rollout.envs import BUILTIN, DEMONSTRATED

    env = cfg.generation.env
    if env is None:
        return
    if hasattr(cfg, "learn") and cfg.learn.learner_generates:
        raise ValueError("--learner_generates makes single completions: not available with --env yet (drop one)")
    task = cfg.prompt.task or ("arith" if cfg.prompt.dataset is None else "(from --dataset)")
    # a user's environment may demonstrate (its class's demonstrate(), asked at the warm start, where it imports)
    if (getattr(cfg, "warm_start", None) and cfg.warm_start.warm_start_steps and env in BUILTIN
            and task not in DEMONSTRATED.get(env, ())):
        raise ValueError(f"--warm_start_steps with --env {env} --task {task}: no demonstrations of that "
                         "environment on that task (built in: --env calculator --task arith); drop --warm_start_steps")


def learner_options_agree(cfg) -> None:
    learn, shared = cfg.learn, cfg.shared
    if learn.pg_baseline == "running_mean" and shared.learner != "pg":
        raise ValueError(f"--pg_baseline running_mean needs --learner pg, got --learner {shared.learner}")
    if transport(shared.weights_transport).full_weights_only and shared.finetune != "full":
        raise ValueError(f"--weights_transport {shared.weights_transport} carries full weights: it needs --finetune "
                         "full (LoRA adapters are small: use fs or zmq)")
    if shared.finetune == "lora" and not learn.lora_target_modules:
        raise ValueError("--lora_target_modules must name at least one module with --finetune lora")
    if learn.load_in_4bit and (shared.finetune != "lora" or learn.backend == "hf"):
        raise ValueError(f"--load_in_4bit is QLoRA through Unsloth: it needs --finetune lora and --backend "
                         f"unsloth (or auto), got --finetune {shared.finetune} --backend {learn.backend}")
    if learn.export_final == "adapter" and shared.finetune != "lora":
        raise ValueError("--export_final adapter needs --finetune lora (full fine-tuning has no adapter: "
                         "use merged or off)")


def groups_give_advantages(cfg) -> None:
    """A group of one completion has advantage 0 under every group-relative estimator (its reward minus its
    own mean, distrl/core/advantages.py): such a run would train nothing and exit 0."""
    learner, pg_baseline = cfg.shared.learner, cfg.learn.pg_baseline
    group_relative = learner in ("grpo", "dr_grpo") or pg_baseline == "group"
    if cfg.batch.group_size == 1 and group_relative and not cfg.learn.kl_coef > 0:
        baseline = " --pg_baseline group" if learner == "pg" else ""
        raise ValueError(f"--group_size 1 with --learner {learner}{baseline}: a group's advantages are its rewards "
                         "minus the group's mean, all 0 with one completion a group, so nothing would be trained; "
                         "use --group_size 2 or more, or --learner pg --pg_baseline running_mean, or a KL term "
                         "(--kl_coef > 0)")


def train_makes_its_keys(cfg) -> None:
    for name in ("buffer_curve_server_key", "buffer_curve_client_key"):
        if getattr(cfg.shared, name) is not None:
            raise ValueError(f"--{name} is for `distrl learn|rollout` against a `distrl buffer` with key files: "
                             "`distrl train` makes its run's CURVE keys itself (--no_auth turns them off)")


@composed(actors_exist, learners_share_the_batch, topk_fits_group, learner_options_agree, groups_give_advantages,
          train_makes_its_keys, env_fits, settle=settle_roles)
@dataclass
class TrainConfig:
    """Asynchronous RL fine-tuning: rollout actors -> replay buffer -> learners -> weights by version."""

    file: ConfigFile = field(default_factory=ConfigFile)
    run: RunOptions = field(default_factory=RunOptions)
    shared: SharedOptions = field(default_factory=SharedOptions)
    batch: BatchOptions = field(default_factory=BatchOptions)
    staleness: StalenessOptions = field(default_factory=StalenessOptions)
    learn: LearnOptions = field(default_factory=LearnOptions)
    prompt: PromptOptions = field(default_factory=PromptOptions)
    generation: TaskOptions = field(default_factory=TaskOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    keep: TopkOptions = field(default_factory=TopkOptions)
    selection: SelectionOptions = field(default_factory=SelectionOptions)
    storage: StorageOptions = field(default_factory=StorageOptions)
    warm_start: WarmStartOptions = field(default_factory=WarmStartOptions)
    train: TrainOptions = field(default_factory=TrainOptions)

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir


@dataclass
class LearnEndpoints:
    """Where `distrl learn`'s rank 0 binds its weight endpoints."""

    weights_pub_bind: str = DEFAULT_WEIGHTS_PUB
    """Where rank 0 announces versions (ZMQ PUB); actors connect to it with `--weights_pub`."""
    weights_endpoint_bind: str = DEFAULT_WEIGHTS_ENDPOINT
    """Where rank 0 answers LATEST and FETCH (ZMQ ROUTER); actors connect with `--weights_endpoint`."""


@composed(actors_exist, learners_share_the_batch, learner_options_agree, groups_give_advantages, env_fits,
          settle=settle_roles)
@dataclass
class LearnConfig:
    """One learner rank as a plain process (`distrl learn`), wired to the buffer by ZMQ address only.

    Several ranks run under `torchrun --nproc_per_node N -m distrl learn ...` (rank and world size
    come from torchrun's environment; `--number_of_learners` must equal N). Rank 0 binds the weight
    endpoints. Writes weights/, tb/learner<rank>/ and logs/ under `<log_dir>/<run_name>/`. The task's
    options are read with --learner_generates.
    """

    file: ConfigFile = field(default_factory=ConfigFile)
    run: RunOptions = field(default_factory=RunOptions)
    shared: SharedOptions = field(default_factory=SharedOptions)
    batch: BatchOptions = field(default_factory=BatchOptions)
    staleness: StalenessOptions = field(default_factory=StalenessOptions)
    learn: LearnOptions = field(default_factory=LearnOptions)
    prompt: PromptOptions = field(default_factory=PromptOptions)
    generation: TaskOptions = field(default_factory=TaskOptions)
    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""
    endpoints: LearnEndpoints = field(default_factory=LearnEndpoints)

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir


@dataclass
class RolloutEndpoints:
    """Which actor `distrl rollout` is and where it finds the learner's weights (or the run it joins)."""

    actor_id: int = 0
    """This actor's index (its seed offset, log and TensorBoard names); with --join the buffer picks a fresh one."""
    join: Optional[str] = None
    """Join a running run: its run directory or its `join.json` (written by `distrl train` and `distrl buffer`;
    copy it to this host if the directory is not shared). The run's options (addresses, weight transport, model,
    task, sampling, CURVE keys) come first and the flags given here win over them; the buffer gives a
    fresh --actor_id; the actor starts at the current policy version. Stopped cleanly (SIGTERM, Ctrl-C) it tells
    the buffer, which returns its unused credits (docs/multinode.md, "Actors that join and leave")."""
    weights_pub: str = DEFAULT_WEIGHTS_PUB
    """The learner's announcement socket (`distrl learn --weights_pub_bind`)."""
    weights_endpoint: str = DEFAULT_WEIGHTS_ENDPOINT
    """The learner's LATEST/FETCH endpoint (`distrl learn --weights_endpoint_bind`)."""

    def check(self) -> None:
        if self.actor_id < 0:
            raise ValueError(f"--actor_id must be >= 0, got {self.actor_id}")


def prepare_join(cfg) -> None:
    """--join: where it writes and what cannot be joined (distrl.cmd.join.apply_join; `distrl rollout` put the
    run's options before the command line's flags), before each section's derived values."""
    if cfg.actor.join is not None:
        from distrl.cmd.join import apply_join

        apply_join(cfg)


@composed(actors_exist, env_fits, settle=settle_roles, prepare=prepare_join)
@dataclass
class RolloutConfig:
    """One rollout actor as a plain process (`distrl rollout`), wired by ZMQ addresses only.

    Writes its weight cache, tb/actor<id>/ and logs/ under `<log_dir>/<run_name>/`.
    """

    file: ConfigFile = field(default_factory=ConfigFile)
    run: RunOptions = field(default_factory=RunOptions)
    shared: SharedOptions = field(default_factory=SharedOptions)
    batch: BatchOptions = field(default_factory=BatchOptions)
    prompt: PromptOptions = field(default_factory=PromptOptions)
    generation: TaskOptions = field(default_factory=TaskOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""
    actor: RolloutEndpoints = field(default_factory=RolloutEndpoints)

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir


@composed(topk_fits_group)
@dataclass
class BufferConfig:
    """The replay buffer alone as a plain process (`distrl buffer`), for `distrl learn|rollout` and
    multi-host runs. It serves until SHUTDOWN, SIGTERM or SIGINT; `--resume` restarts it where it was."""

    file: ConfigFile = field(default_factory=ConfigFile)
    endpoint: BufferEndpoint = field(default_factory=BufferEndpoint)
    batch: BatchOptions = field(default_factory=BatchOptions)
    staleness: StalenessOptions = field(default_factory=StalenessOptions)
    keep: TopkOptions = field(default_factory=TopkOptions)
    selection: SelectionOptions = field(default_factory=SelectionOptions)
    storage: StorageOptions = field(default_factory=StorageOptions)
