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

Ray resources (``--actor_resources``/``--learner_resources``/``--buffer_resources``, e.g. ``{"node2": 1}``)
join the role's bundle, which pins it to the nodes that have them. A role with no bundle (no GPU, no
resource) runs on the driver's node. ``Placement.nodes`` says on which node each role runs, before any starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distrl.cmd.config import TrainConfig, ray_resources


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

    ``bundles``: role name (``learner0``, ``actor2``, ``buffer0``) -> (bundle index in ``group``, its resources).
    ``home``: the driver's node id (roles without a bundle run there); ``nodes``: role name -> node id.
    """

    gpus_per_actor: float
    gpus_per_learner: float
    group: object = None
    bundles: dict[str, tuple[int, dict]] = field(default_factory=dict)
    home: str | None = None
    nodes: dict[str, str] = field(default_factory=dict)

    def options(self, role: str) -> dict:
        """Keyword arguments of ``RoleClass.options(...)`` for ``role`` (``learner<r>``, ``actor<i>``, ``buffer0``)."""
        if self.group is None or role not in self.bundles:
            if self.home is None:
                return {"num_gpus": 0}
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            return {"num_gpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(self.home, soft=False)}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index, bundle = self.bundles[role]
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        resources = {k: v for k, v in bundle.items() if k not in ("GPU", "CPU")}  # Ray takes those two apart
        return {"num_gpus": bundle.get("GPU", 0), "scheduling_strategy": strategy,
                **({"num_cpus": bundle["CPU"]} if "CPU" in bundle else {}),
                **({"resources": resources} if resources else {})}

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
    placement = Placement(per_actor, per_learner, home=ray.get_runtime_context().get_node_id())
    bundles = _bundles(cfg, per_actor, per_learner)
    roles = list(bundles.items())
    placement.nodes = {name: placement.home for name in _role_names(cfg)}
    if not roles:
        return placement
    asked = sum(b.get("GPU", 0) for _, b in roles)
    what = (f"asked {cfg.number_of_actors} actors x {per_actor:g} GPU + {cfg.number_of_learners} learners x "
            f"{per_learner:g} GPU = {asked:g} GPUs ({cfg.placement_strategy})")
    what += "".join(f", {flag} {getattr(cfg, flag[2:])}" for flag in ("--actor_resources", "--learner_resources",
                                                                    "--buffer_resources") if getattr(cfg, flag[2:]))
    if asked > total_gpus + 1e-9:
        raise RuntimeError(f"{what}, but the Ray cluster has {total_gpus:g} GPUs: lower --number_of_actors, "
                           f"--number_of_learners or --gpus_per_actor/--gpus_per_learner, or use a larger cluster")
    free = ray.available_resources().get("GPU", 0)  # before this request (a pending group holds some for a while)
    group = placement_group([b for _, b in roles], strategy=cfg.placement_strategy, name="")
    try:
        ray.get(group.ready(), timeout=cfg.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        nodes = [n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
        raise RuntimeError(f"{what}, not placed within --placement_timeout_s {cfg.placement_timeout_s:g}: the "
                           f"cluster has {total_gpus:g} GPUs, {free:g} free before this request, per node "
                           f"{nodes}") from None
    placement.group = group
    placement.bundles = {name: (i, b) for i, (name, b) in enumerate(roles)}
    on = ray.util.placement_group_table(group)["bundles_to_node_id"]
    placement.nodes.update({name: on[i] for name, (i, _) in placement.bundles.items()})
    return placement


def _role_names(cfg: TrainConfig) -> list[str]:
    return ["buffer0", *(f"learner{r}" for r in range(cfg.number_of_learners)),
            *(f"actor{i}" for i in range(cfg.number_of_actors))]


def _bundles(cfg: TrainConfig, per_actor: float, per_learner: float) -> dict[str, dict[str, float]]:
    """Role name -> its bundle (``GPU`` and the role's --*_resources) for each role that asks for anything."""
    bundles = {}
    for name in _role_names(cfg):
        kind = name.rstrip("0123456789")
        gpus = {"actor": per_actor, "learner": per_learner}.get(kind, 0.0)
        bundle = {**({"GPU": gpus} if gpus > 0 else {}), **ray_resources(getattr(cfg, f"{kind}_resources"), kind)}
        if bundle:
            bundles[name] = bundle
    return bundles
