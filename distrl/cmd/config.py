"""Each command's config, composed from the sections the roles own; only rules that join two sections here.

Sections (every option declared once, with its unit and default, in the package that reads it):

| section | module | read by |
|---|---|---|
| SharedOptions, BatchOptions, StalenessOptions | distrl/core/run_options.py | actors and learners (and the buffer) |
| PromptOptions, TaskOptions, RolloutOptions | distrl/rollout/config.py | generators (and eval: prompts); actors |
| LearnOptions, WarmStartOptions | distrl/learn/config.py | learners; `distrl train`'s warm start |
| SelectionOptions, StorageOptions, TopkOptions, BufferEndpoint | distrl/buffer/config.py | the buffer |
| _ConfigFile, _RunDir, _TrainOptions, the addresses | here | the commands |
| ReplayConfig, EvalConfig | distrl/cmd/config_offline.py | `distrl replay`, `distrl eval` |

`distrl train` takes every section; `distrl learn|rollout|buffer` only what that role reads, so their
`--help` lists only those. Building a config resolves each section's derived values once (``resolve``:
the default --run_name, --gpu_split's role counts, absolute paths), then ``validate`` runs each section's
``check`` and this module's cross-section rules; neither ``check`` nor ``validate`` changes the config.
Nothing here imports torch or vLLM, so a bad flag fails in a fraction of a second with a message naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Optional

from distrl.buffer.config import (
    DEFAULT_BUFFER_ADDRESS,
    BufferEndpoint,
    SelectionOptions,
    StorageOptions,
    TopkOptions,
    buffer_options,
)
from distrl.cmd.config_offline import EvalConfig, ReplayConfig
from distrl.core.run_options import BatchOptions, SharedOptions, StalenessOptions
from distrl.learn.config import LearnOptions, WarmStartOptions, aggregation_in_effect
from distrl.rollout.config import PromptOptions, RolloutOptions, TaskOptions
from distrl.weights import transport

__all__ = ["BufferConfig", "EvalConfig", "LearnConfig", "ReplayConfig", "RolloutConfig", "TrainConfig",
           "SelectionOptions", "StorageOptions", "buffer_options"]

DEFAULT_WEIGHTS_PUB = "tcp://127.0.0.1:5556"
DEFAULT_WEIGHTS_ENDPOINT = "tcp://127.0.0.1:5557"


@dataclass
class _ConfigFile:
    config: Optional[str] = None
    """YAML (.yaml/.yml) or TOML (.toml) file whose keys are flag names, e.g. max_steps; flags given on
    the command line override it. A key that is another command's flag is ignored by `distrl
    learn|rollout|buffer` (one line on stderr names them), so one file can serve every role; a key no
    command knows is an error (docs/placement.md, docs/multihost.md)."""


@dataclass
class _RunDir:
    run_name: str = ""
    """Name of the run; its directory is `<log_dir>/<run_name>/` and must not exist yet
    (unset: `distrl-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of run directories (config, segments/, weights/, tb/<role><index>/)."""
    resume: Optional[str] = None
    """Continue the run in this directory: its config.json gives every option except --max_steps; the
    learners restart from the newest checkpoint in ckpt/, the buffer from its segment log (unconsumed
    groups are served again), each actor after the prompts it already used."""

    def resolve(self) -> None:
        """Unset --run_name: `distrl-<date>-<time>` (now)."""
        if not self.run_name:
            self.run_name = time.strftime("distrl-%Y%m%d-%H%M%S")

    def check(self) -> None:
        if os.sep in self.run_name or self.run_name in ("", ".", ".."):
            raise ValueError(f"--run_name must be a plain name, got {self.run_name!r}")

    @property
    def run_dir(self) -> Path:
        return Path(self.log_dir).resolve() / self.run_name


@dataclass
class _TrainOptions:
    """What only `distrl train` reads: the live view, the watchdog, Ray and GPU placement, its bind host."""

    console: bool = True
    """`distrl train`: a live view on stderr (policy version, reward, staleness, tokens/s, buffer fill),
    refreshed twice a second from the buffer's STATS and the learners' TensorBoard events; role logs go to
    `<run_dir>/logs/<role>.log` only. With `--no_console`, and whenever stderr is not a terminal, a plain
    progress line instead, at most one per 10 s."""
    heartbeat_timeout_s: float = 300.0
    """`distrl train`: seconds an actor or learner may go without a request to the buffer (or the buffer
    without answering the driver) before it counts as stuck: a stuck actor is restarted, a stuck learner
    or buffer ends the run with an error naming it (docs/faults.md); 0 turns the watchdog off."""
    max_actor_restarts: int = 3
    """`distrl train`: times Ray restarts each rollout actor after its process dies, is found stuck or its
    node is lost (it rejoins with the latest weights, after the prompts its logged groups used); after
    that the actor is gone and the run goes on with the others (docs/faults.md)."""
    ray_address: Optional[str] = None
    """`distrl train`: address of an existing Ray cluster to join (`ray.init(address=...)`, e.g.
    `auto` or `10.0.0.1:6379`); unset: start a local one (or use the one this process already started)."""
    gpus_per_actor: Optional[float] = None
    """`distrl train`: GPUs each rollout actor reserves in Ray (fractions share a GPU, e.g. 0.5). Unset:
    1 when the cluster has a GPU per role, 1/ceil(roles/GPUs) when it has fewer, 0 when it has none."""
    gpus_per_learner: Optional[float] = None
    """`distrl train`: GPUs each learner reserves in Ray; unset: as --gpus_per_actor."""
    gpu_split: Optional[str] = None
    """`distrl train`: `A:L` splits a GPU machine into A actors and L learners with one GPU each (e.g.
    `3:1`); sets --number_of_actors/--number_of_learners/--gpus_per_*, which may be given only if equal."""
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = "PACK"
    """`distrl train`: Ray placement-group strategy of the GPU roles: PACK (as few nodes as possible),
    STRICT_PACK (one node) or SPREAD (across nodes)."""
    placement_timeout_s: float = 60.0
    """`distrl train`: seconds to wait for Ray to reserve the roles' GPUs; then the run fails, saying what
    was asked and what the cluster has."""
    host: str = "127.0.0.1"
    """Address the buffer and weight endpoints bind to when every role runs on the driver's node (loopback
    unless you need other hosts); when `distrl train`'s roles span Ray nodes, each binds on its node's address."""
    auth: bool = True
    """`distrl train`: when a role binds off loopback (roles on several nodes, or a --host that is not loopback),
    the buffer and weight endpoints are CURVE-authenticated and encrypted with keys the driver makes for the run
    and hands to the roles through Ray (never written to disk): a client without them gets no answer.
    `--no_auth`: plain TCP (a network you trust). A one-host loopback run is plain TCP either way."""
    actor_resources: Optional[str] = None
    """`distrl train`: Ray resources each rollout actor asks for, as a JSON object, e.g. `{"node2": 1}` (a
    custom resource of `ray start --resources`): pins the actors to the nodes that have it (docs/multinode.md)."""
    learner_resources: Optional[str] = None
    """`distrl train`: Ray resources each learner asks for, as a JSON object (as --actor_resources)."""
    buffer_resources: Optional[str] = None
    """`distrl train`: Ray resources the buffer asks for, as a JSON object (as --actor_resources). A role that
    asks for no GPU and no resource runs on the driver's node."""

    def check(self) -> None:
        """Raise ValueError naming the first bad `distrl train` option."""
        for name in ("gpus_per_actor", "gpus_per_learner"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= 1 or float(value).is_integer()):
                raise ValueError(f"--{name} must be a fraction in [0, 1] or a whole number, got {value}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"--placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        if not self.heartbeat_timeout_s >= 0:
            raise ValueError(f"--heartbeat_timeout_s must be >= 0 (0: no watchdog), got {self.heartbeat_timeout_s}")
        if self.max_actor_restarts < 0:
            raise ValueError(f"--max_actor_restarts must be >= 0, got {self.max_actor_restarts}")
        for role in ("actor", "learner", "buffer"):
            ray_resources(getattr(self, f"{role}_resources"), f"--{role}_resources")
        for name in ("buffer_curve_server_key", "buffer_curve_client_key"):
            if getattr(self, name, None) is not None:
                raise ValueError(f"--{name} is for `distrl learn|rollout` against a `distrl buffer` with key files: "
                                 "`distrl train` makes its run's CURVE keys itself (--no_auth turns them off)")


def ray_resources(text: str | None, flag: str) -> dict[str, float]:
    """``text`` (a JSON object of Ray resource name -> amount > 0) as a dict; {} for None. Raises
    ValueError naming ``flag`` for anything else, or for GPU (--gpus_per_actor/--gpus_per_learner say that)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                              and not isinstance(v, bool) and v > 0 for k, v in value.items()):
        raise ValueError(f"{flag} must be a JSON object of Ray resource name -> amount > 0, e.g. "
                         f"'{{\"node2\": 1}}', got {text!r}")
    if "GPU" in value:
        raise ValueError(f"{flag}: give GPUs with --gpus_per_actor/--gpus_per_learner, not as a resource")
    return {k: float(v) for k, v in value.items()}


def gpu_split_counts(cfg) -> dict[str, float]:
    """The flags --gpu_split `A:L` stands for (A actors and L learners, one GPU each); {} when unset.
    Raises ValueError on another form or on a given flag that disagrees."""
    if getattr(cfg, "gpu_split", None) is None:
        return {}
    parts = cfg.gpu_split.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--gpu_split must be A:L (actors:learners, e.g. 3:1), got {cfg.gpu_split!r}")
    split = {"number_of_actors": int(parts[0]), "number_of_learners": int(parts[1]),
             "gpus_per_actor": 1.0, "gpus_per_learner": 1.0}
    for name, value in split.items():
        if getattr(cfg, name) is not None and getattr(cfg, name) != value:
            raise ValueError(f"--gpu_split {cfg.gpu_split} means --{name} {value:g}, but --{name} "
                             f"{getattr(cfg, name):g} was given: drop one of them")
    return split


class _Composed:
    """A command's config: its sections' fields; built, it resolves derived values once, then validates.
    ``rules``: the cross-section rules that apply to it (functions of the config raising ValueError)."""

    rules: ClassVar[tuple] = ()
    places_roles: ClassVar[bool] = False  # distrl train: an unset --weights_transport waits for the placement

    def __post_init__(self) -> None:
        self.resolve()
        self.validate()

    def _sections(self) -> list[type]:
        """The section classes of this config, in field order (this class and _Composed are not sections)."""
        return [cls for cls in reversed(type(self).__mro__) if not issubclass(cls, _Composed)]

    def resolve(self) -> None:
        """Each section's derived values, then the role counts: --gpu_split's, else 1 for an unset count."""
        for cls in self._sections():
            if "resolve" in vars(cls):
                vars(cls)["resolve"](self)
        for name, value in gpu_split_counts(self).items():
            setattr(self, name, value)
        for name in ("number_of_actors", "number_of_learners"):
            if hasattr(self, name) and getattr(self, name) is None:
                setattr(self, name, 1)
        if getattr(self, "weights_transport", "") is None and not self.places_roles:
            self.weights_transport = "fs"  # distrl train picks it once its roles are placed (distrl.cmd.nodes)

    def validate(self) -> None:
        """Raise ValueError naming the first bad option: each section's own check, then the rules joining two."""
        for cls in self._sections():
            if "check" in vars(cls):
                vars(cls)["check"](self)
        for rule in self.rules:
            rule(self)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        return cls(**json.loads(text))


class _LearnerView:
    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect (--loss_aggregation, or the --learner's default)."""
        return aggregation_in_effect(self.learner, self.loss_aggregation)


class _BufferView:
    @property
    def k(self) -> int:
        """Completions kept per group (--topk, or all --group_size)."""
        return self.topk or self.group_size


# The rules joining two sections; each command lists those whose fields it has.
def topk_fits_group(cfg) -> None:
    if cfg.topk is not None and not 1 <= cfg.topk <= cfg.group_size:
        raise ValueError(f"--topk must be in [1, --group_size={cfg.group_size}], got {cfg.topk}")


def learners_share_the_batch(cfg) -> None:
    if cfg.batch_size % cfg.number_of_learners:
        raise ValueError(f"--batch_size {cfg.batch_size} must be a multiple of "
                         f"--number_of_learners {cfg.number_of_learners} (each learner takes a shard)")


def actors_exist(cfg) -> None:
    if cfg.number_of_actors < (0 if getattr(cfg, "learner_generates", False) else 1):
        raise ValueError(f"--number_of_actors must be >= 1 (>= 0 with --learner_generates), "
                         f"got {cfg.number_of_actors}")
    if cfg.number_of_actors == 0 and transport(cfg.weights_transport).needs_actors:
        raise ValueError(f"--weights_transport {cfg.weights_transport} needs at least one actor (--number_of_actors 0)")


def learner_options_agree(cfg) -> None:
    if cfg.pg_baseline == "running_mean" and cfg.learner != "pg":
        raise ValueError(f"--pg_baseline running_mean needs --learner pg, got --learner {cfg.learner}")
    if transport(cfg.weights_transport).full_weights_only and cfg.finetune != "full":
        raise ValueError(f"--weights_transport {cfg.weights_transport} carries full weights: it needs --finetune full "
                         "(LoRA adapters are small: use fs or zmq)")


def groups_give_advantages(cfg) -> None:
    """A group of one completion has advantage 0 under every group-relative estimator (its reward minus its
    own mean, distrl/core/advantages.py): such a run would train nothing and exit 0."""
    group_relative = cfg.learner in ("grpo", "dr_grpo") or cfg.pg_baseline == "group"
    if cfg.group_size == 1 and group_relative and not cfg.kl_coef > 0:
        baseline = " --pg_baseline group" if cfg.learner == "pg" else ""
        raise ValueError(f"--group_size 1 with --learner {cfg.learner}{baseline}: a group's advantages are its rewards "
                         "minus the group's mean, all 0 with one completion a group, so nothing would be trained; "
                         "use --group_size 2 or more, or --learner pg --pg_baseline running_mean, or a KL term "
                         "(--kl_coef > 0)")


@dataclass
class TrainConfig(_Composed, _LearnerView, _BufferView, _TrainOptions, WarmStartOptions, StorageOptions,
                  SelectionOptions, TopkOptions, RolloutOptions, TaskOptions, PromptOptions, LearnOptions,
                  StalenessOptions, BatchOptions, SharedOptions, _RunDir, _ConfigFile):
    """Asynchronous RL fine-tuning: rollout actors -> replay buffer -> learners -> weights by version."""

    rules = (actors_exist, learners_share_the_batch, topk_fits_group, learner_options_agree, groups_give_advantages)
    places_roles = True


@dataclass
class _BufferAddress:
    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""


@dataclass
class _LearnEndpoints:
    weights_pub_bind: str = DEFAULT_WEIGHTS_PUB
    """Where rank 0 announces versions (ZMQ PUB); actors connect to it with `--weights_pub`."""
    weights_endpoint_bind: str = DEFAULT_WEIGHTS_ENDPOINT
    """Where rank 0 answers LATEST and FETCH (ZMQ ROUTER); actors connect with `--weights_endpoint`."""


@dataclass
class LearnConfig(_Composed, _LearnerView, _LearnEndpoints, _BufferAddress, TaskOptions, PromptOptions,
                  LearnOptions, StalenessOptions, BatchOptions, SharedOptions, _RunDir, _ConfigFile):
    """One learner rank as a plain process (`distrl learn`), wired to the buffer by ZMQ address only.

    Several ranks run under `torchrun --nproc_per_node N -m distrl learn ...` (rank and world size
    come from torchrun's environment; `--number_of_learners` must equal N). Rank 0 binds the weight
    endpoints. Writes weights/, tb/learner<rank>/ and logs/ under `<log_dir>/<run_name>/`. The task's
    options are read with --learner_generates.
    """

    rules = (actors_exist, learners_share_the_batch, learner_options_agree, groups_give_advantages)


@dataclass
class _RolloutEndpoints:
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


@dataclass
class RolloutConfig(_Composed, _RolloutEndpoints, _BufferAddress, RolloutOptions, TaskOptions, PromptOptions,
                    BatchOptions, SharedOptions, _RunDir, _ConfigFile):
    """One rollout actor as a plain process (`distrl rollout`), wired by ZMQ addresses only.

    Writes its weight cache, tb/actor<id>/ and logs/ under `<log_dir>/<run_name>/`.
    """

    rules = (actors_exist,)

    def resolve(self) -> None:
        """--join: where it writes and what cannot be joined (distrl.cmd.join.apply_join; `distrl rollout` put
        the run's options before the command line's flags), then each section's derived values."""
        if self.join is not None:
            from distrl.cmd.join import apply_join

            apply_join(self)
        super().resolve()


@dataclass
class BufferConfig(_Composed, _BufferView, StorageOptions, SelectionOptions, TopkOptions, StalenessOptions,
                   BatchOptions, BufferEndpoint, _ConfigFile):
    """The replay buffer alone as a plain process (`distrl buffer`), for `distrl learn|rollout` and
    multi-host runs. It serves until SHUTDOWN, SIGTERM or SIGINT; `--resume` restarts it where it was."""

    rules = (topk_fits_group,)
