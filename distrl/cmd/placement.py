"""Where `distrl train` puts its roles on the Ray cluster: GPUs per role, one placement group.

Each learner and each rollout actor that asks for GPUs gets one bundle ``{"GPU": g}`` of a single Ray
placement group (learners first, then actors), created with ``--placement_strategy`` (PACK by default:
as few nodes as possible, so learners and actors of one machine talk over loopback). Fractional ``g``
lets roles share a GPU (Ray packs 0.5 + 0.5 onto one device). The buffer asks for nothing. The group
is reserved *before* any role starts; if the cluster cannot hold it within ``--placement_timeout_s``
the run fails with what was asked and what the cluster has, instead of waiting in Ray's pending
state forever.

Defaults (``--gpus_per_actor``/``--gpus_per_learner`` unset): with G GPUs in the cluster and
N = actors + learners roles, each role gets ``1 / ceil(N / G)`` GPUs (1 when N <= G, 0.5 when up to two
roles must share a GPU, ...); with no GPU, 0 (CPU roles, no placement group, as on a laptop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distrl.cmd.config import TrainConfig


def default_gpus(roles: int, cluster_gpus: float) -> float:
    """GPUs per role when unset: 1 / ceil(roles / GPUs), or 0 without GPUs. roles >= 0, cluster_gpus >= 0."""
    whole = math.floor(cluster_gpus)
    if whole < 1 or roles < 1:
        return 0.0
    return 1.0 / math.ceil(roles / whole)


def role_gpus(cfg: TrainConfig, cluster_gpus: float) -> tuple[float, float]:
    """(GPUs per actor, GPUs per learner): the flags, or :func:`default_gpus` for an unset one."""
    auto = default_gpus(cfg.number_of_actors + cfg.number_of_learners, cluster_gpus)
    actor = auto if cfg.gpus_per_actor is None else float(cfg.gpus_per_actor)
    learner = auto if cfg.gpus_per_learner is None else float(cfg.gpus_per_learner)
    return actor, learner


@dataclass
class Placement:
    """The roles' Ray options. ``group`` is None when no role asks for a GPU.

    ``bundles``: role name (``learner0``, ``actor2``) -> bundle index in ``group``.
    """

    gpus_per_actor: float
    gpus_per_learner: float
    group: object = None
    bundles: dict[str, int] = field(default_factory=dict)

    def options(self, role: str) -> dict:
        """Keyword arguments of ``RoleClass.options(...)`` for ``role`` (``learner<r>`` or ``actor<i>``)."""
        gpus = self.gpus_per_learner if role.startswith("learner") else self.gpus_per_actor
        if self.group is None or role not in self.bundles:
            return {"num_gpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.bundles[role])
        return {"num_gpus": gpus, "scheduling_strategy": strategy}

    def release(self) -> None:
        """Remove the placement group (idempotent)."""
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def reserve(cfg: TrainConfig) -> Placement:
    """Reserve the roles' GPUs on the connected Ray cluster (``ray.init`` done).

    Raises RuntimeError naming what was asked (per role and in total) and what the cluster has, when
    the total exceeds the cluster's GPUs (at once) or the group is not placed in --placement_timeout_s
    (e.g. no node holds a bundle; the group is then removed).
    """
    import ray
    from ray.util.placement_group import placement_group

    total_gpus = float(ray.cluster_resources().get("GPU", 0.0))
    per_actor, per_learner = role_gpus(cfg, total_gpus)
    placement = Placement(per_actor, per_learner)
    roles = [(f"learner{r}", per_learner) for r in range(cfg.number_of_learners)]
    roles += [(f"actor{i}", per_actor) for i in range(cfg.number_of_actors)]
    roles = [(name, g) for name, g in roles if g > 0]
    if not roles:
        return placement
    asked = sum(g for _, g in roles)
    what = (f"asked {cfg.number_of_actors} actors x {per_actor:g} GPU + {cfg.number_of_learners} learners x "
            f"{per_learner:g} GPU = {asked:g} GPUs ({cfg.placement_strategy})")
    if asked > total_gpus + 1e-9:
        raise RuntimeError(f"{what}, but the Ray cluster has {total_gpus:g} GPUs: lower --number_of_actors, "
                           f"--number_of_learners or --gpus_per_actor/--gpus_per_learner, or use a larger cluster")
    group = placement_group([{"GPU": g} for _, g in roles], strategy=cfg.placement_strategy, name="")
    try:
        ray.get(group.ready(), timeout=cfg.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        nodes = [n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
        raise RuntimeError(f"{what}, not placed within --placement_timeout_s {cfg.placement_timeout_s:g}: the "
                           f"cluster has {total_gpus:g} GPUs, {ray.available_resources().get('GPU', 0):g} free, "
                           f"per node {nodes}") from None
    placement.group = group
    placement.bundles = {name: i for i, (name, _) in enumerate(roles)}
    return placement
