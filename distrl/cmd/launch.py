"""Separate launchers: `distrl learn` and `distrl rollout` run one role each as a plain process.

Roles are wired only by ZMQ addresses (with `distrl buffer`), so they can run on different hosts
without Ray or a shared filesystem (`--weights_transport zmq`). Each role writes under its own
`<log_dir>/<run_name>/`; with `--model tiny` each builds the same tiny model from the seed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from distrl.cmd.assemble import buffer_sections, build_actor, build_learner, resolve_model, set_torch_threads
from distrl.cmd.config import BufferConfig, LearnConfig, RolloutConfig, TrainConfig
from distrl.cmd.faults import read_role_file, write_role_file
from distrl.cmd.stacks import needed, probe_here, settle_stacks
from distrl.core.compile_cache import use_compile_caches
from distrl.core.heap import steady_heap
from distrl.core.logs import setup_logging

log = logging.getLogger("distrl.cmd.launch")


def role_dir(cfg: TrainConfig, role: str) -> tuple[Path, str]:
    """Create (if needed) the role's run directory and log file; return (run_dir, model_dir)."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"config.{role}.json").write_text(cfg.to_json())
    setup_logging(run_dir / "logs" / f"{role}.log")
    steady_heap()
    use_compile_caches()
    set_torch_threads(cfg.torch_threads)
    return run_dir, resolve_model(cfg.model, run_dir, cfg.seed)


def run_learn(cfg: LearnConfig) -> dict:
    """Run one learner rank to `max_steps` versions (rank/world from torchrun's env when present); rank 0
    then serves the final version until every actor asked for it (distrl.cmd.assemble.AssembledLearner.close)."""
    from distrl.learn.learner import init_distributed_from_env

    cfg = settle_stacks(cfg, probe_here(needed(cfg, actors=False)), "learn")  # before the role imports them
    rank, world, _ = init_distributed_from_env()
    if world != cfg.number_of_learners:
        raise ValueError(f"--number_of_learners {cfg.number_of_learners} but WORLD_SIZE is {world}: start "
                         f"N learners with `torchrun --nproc_per_node N` and pass --number_of_learners N")
    run_dir, model_dir = role_dir(cfg, f"learner{rank}")
    write_role_file(run_dir, f"learner{rank}")
    parts = build_learner(cfg, rank, world, run_dir, model_dir, cfg.buffer_address,
                          weights_bind=(cfg.weights_pub_bind, cfg.weights_endpoint_bind), resume=bool(cfg.resume))
    try:
        result = parts.run()
    finally:
        parts.close()
    log.info("learner%d: done at version %d", rank, result["version"])
    return result


def run_buffer(cfg: BufferConfig) -> dict:
    """`distrl buffer`: serve the buffer of ``cfg``'s sections until asked to stop (distrl.buffer.launch.run)."""
    from distrl.buffer.launch import run

    return run(*buffer_sections(cfg), cfg.endpoint)


def run_rollout(cfg: RolloutConfig) -> dict:
    """Run one rollout actor until the buffer says stop. Started again in the same run directory (its
    role file is there) it rejoins: fresh sampling seeds, the latest weights (docs/faults.md). With --join
    it uses the run's CURVE keys (if any) and takes the fresh actor id the buffer hands out (distrl.cmd.join)."""
    cfg = settle_stacks(cfg, probe_here(needed(cfg, learners=False)), "rollout")  # before the role imports them
    if cfg.join is not None:
        from distrl.cmd.join import join_actor_id, join_keys
        from distrl.core.security import use_run_keys

        use_run_keys(join_keys(cfg.join))
        cfg.actor_id = join_actor_id(cfg)
        print(f"distrl rollout: joined the run at {cfg.buffer_address} as actor{cfg.actor_id} "
              f"(logs: {cfg.run_dir}/logs/actor{cfg.actor_id}.log)", flush=True)
    run_dir, model_dir = role_dir(cfg, f"actor{cfg.actor_id}")
    rejoin = read_role_file(run_dir, f"actor{cfg.actor_id}") is not None  # this actor ran here before
    write_role_file(run_dir, f"actor{cfg.actor_id}")
    from distrl.rollout.actor import ActorEndpoints

    endpoints = ActorEndpoints(cfg.buffer_address, cfg.weights_pub, cfg.weights_endpoint)
    parts = build_actor(cfg, cfg.actor_id, endpoints, model_dir, run_dir, rejoin=rejoin and not cfg.resume)
    try:
        return parts.run()
    finally:
        parts.close()
