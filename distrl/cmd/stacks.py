"""Which heavy stacks the roles may import, settled before any role starts (the probes: distrl/core/probe.py).

A learner with ``--backend auto`` (the default) or ``unsloth`` imports Unsloth (and, for ``--load_in_4bit``,
bitsandbytes); an actor with ``--engine vllm`` imports vLLM and its compiled kernels. Each is first imported
in a child process on the node where the role will run: here, before Ray, when the command runs its roles on
this host (:func:`probe_here`); in a Ray task pinned to each role's node when the run joins a cluster or its
roles span nodes (:func:`probe_on_nodes`). Then :func:`settle_stacks`:

| config | every probe passed | a probe failed |
|---|---|---|
| --backend auto | unsloth | hf, and one line says why |
| --backend unsloth, or --load_in_4bit | unsloth | PreflightError (exit 2) with the probe's reason |
| --engine vllm | vllm | PreflightError (exit 2) with the probe's reason |

The settled config (``--backend unsloth`` or ``hf``) is what the roles receive and config.json keeps.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from distrl.core.errors import PreflightError
from distrl.core.probe import Probe, backend_stacks, probe

log = logging.getLogger("distrl.cmd.stacks")


def needed(cfg, learners: bool = True, actors: bool = True) -> dict[str, list[str]]:
    """Role kind (``learner``, ``actor``) -> the stacks its roles import under ``cfg``; kinds without any left out.
    ``learners``/``actors``: whether this command runs roles of that kind."""
    out = {}
    if learners and getattr(cfg, "backend", "hf") != "hf":
        out["learner"] = backend_stacks(getattr(cfg, "load_in_4bit", False))
    if actors and getattr(cfg, "engine", None) == "vllm" and getattr(cfg, "number_of_actors", 1) > 0:
        out["actor"] = ["vllm"]
    return out


def probe_here(needs: dict[str, list[str]]) -> dict[str, list[Probe]]:
    """Role kind -> the probes of its stacks on this host (cached: distrl.core.probe)."""
    return {kind: [probe(stack) for stack in stacks] for kind, stacks in needs.items()}


def probe_on_nodes(needs: dict[str, list[str]], nodes: dict[str, str]) -> dict[str, list[Probe]]:
    """Role kind -> the probes of its stacks on every node where a role of that kind runs (``nodes``: role
    name, e.g. ``learner0``, -> Ray node id), each in a Ray task pinned to the node (0 CPUs)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from distrl.core.probe import probe_all

    task = ray.remote(num_cpus=0)(probe_all)
    refs = {(kind, node): task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(needs[kind]) for role, node in nodes.items() for kind in needs if role.startswith(kind)}
    ips = {n["NodeID"]: n.get("NodeManagerAddress") for n in ray.nodes()}
    out: dict[str, list[Probe]] = {kind: [] for kind in needs}
    for (kind, node), ref in refs.items():  # the host named by its name and its node's address
        out[kind] += [Probe(**{**p, "host": f"{p['host']} ({ips.get(node)})"}) for p in ray.get(ref, timeout=900)]
    return out


def settle_stacks(cfg, probes: dict[str, list[Probe]], command: str = "train"):
    """``cfg`` with ``--backend auto`` settled (``unsloth`` or ``hf``) by ``probes`` (role kind -> probes, as
    :func:`probe_here` returns). Prints one line on stderr when ``auto`` falls back to ``hf``. Raises
    PreflightError with the probe's reason for an explicit ``--backend unsloth``, ``--load_in_4bit`` or
    ``--engine vllm`` whose stack is unusable on a role's node."""
    failed = {kind: next((p for p in found if not p.ok), None) for kind, found in probes.items()}
    if failed.get("actor"):
        raise PreflightError("--engine", f"vllm is unusable: {failed['actor'].line()}",
                             "use --engine hf (distrl's own engine), or fix the vLLM install there "
                             "(docs/troubleshooting.md)")
    if "learner" not in probes:
        return cfg
    bad = failed["learner"]
    if bad is None:
        return dataclasses.replace(cfg, backend="unsloth")
    if cfg.backend == "unsloth":
        raise PreflightError("--backend", f"unsloth: {bad.line()}",
                             "use --backend hf (transformers + peft) or auto (docs/troubleshooting.md)")
    if getattr(cfg, "load_in_4bit", False):
        raise PreflightError("--load_in_4bit", f"4-bit QLoRA needs Unsloth: {bad.line()}",
                             "drop --load_in_4bit and use --backend hf (docs/troubleshooting.md)")
    line = f"{bad.line()}; using --backend hf"
    print(f"distrl {command}: {line}", file=sys.stderr, flush=True)
    log.info(line)
    return dataclasses.replace(cfg, backend="hf")
