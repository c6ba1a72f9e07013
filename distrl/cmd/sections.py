"""The commands' own config sections: the --config file, the run directory, what only `distrl train` reads.

Torch-free; composed into the commands' configs by ``distrl/cmd/config.py`` (as ``file``, ``run``, ``train``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional


@dataclass
class RunOptions:
    """Where a command writes: the run directory, or the one it resumes."""

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
class TrainOptions:
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
    `auto` or `10.0.0.1:6379`); unset: start a local one, whatever RAY_ADDRESS says (or use the one this process
    already started)."""
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
    unless you need other hosts; IPv4 or a host name: an IPv6 address is refused); when `distrl train`'s roles span
    Ray nodes, each binds on its node's address."""
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
        if ":" in self.host or not self.host.strip():
            raise ValueError(f"--host must be an IPv4 address or a host name (IPv6 is not supported), got "
                             f"{self.host!r}")
        for role in ("actor", "learner", "buffer"):
            ray_resources(getattr(self, f"{role}_resources"), f"--{role}_resources")


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


@dataclass
class ConfigFile:
    """The command's --config file (its keys are read as flags before the command line's)."""

    config: Optional[str] = None
    """YAML (.yaml/.yml) or TOML (.toml) file whose keys are flag names, e.g. max_steps; flags given on
    the command line override it. A key that is another command's flag is ignored by `distrl
    learn|rollout|buffer` (one line on stderr names them), so one file can serve every role; a key no
    command knows is an error (docs/placement.md, docs/multihost.md)."""
