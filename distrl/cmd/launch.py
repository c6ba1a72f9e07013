"""Separate launchers: `distrl learn` and `distrl rollout` run one role each as a plain process.

Roles are wired only by ZMQ addresses (with `distrl buffer`), so they can run on different hosts
without Ray or a shared filesystem (`--weights_transport zmq`). Each role writes under its own
`<log_dir>/<run_name>/`; with `--model tiny` each builds the same tiny model from the seed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from distrl.cmd.config import LearnConfig, RolloutConfig, TrainConfig
from distrl.cmd.faults import read_role_file, write_role_file
from distrl.cmd.roles import set_torch_threads
from distrl.core.logs import setup_logging

log = logging.getLogger("distrl.cmd.launch")


def role_dir(cfg: TrainConfig, role: str) -> tuple[Path, str]:
    """Create (if needed) the role's run directory and log file; return (run_dir, model_dir)."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"config.{role}.json").write_text(cfg.to_json())
    setup_logging(run_dir / "logs" / f"{role}.log")
    set_torch_threads(cfg.torch_threads)
    model_dir = cfg.model
    if cfg.model == "tiny":
        from distrl.core.tiny import build_tiny_model

        model_dir = str(build_tiny_model(run_dir / "model", seed=cfg.seed))
    return run_dir, model_dir


def run_learn(cfg: LearnConfig) -> dict:
    """Run one learner rank to `max_steps` versions (rank/world from torchrun's env when present)."""
    from learn.learner import init_distributed_from_env

    rank, world, _ = init_distributed_from_env()
    if world != cfg.number_of_learners:
        raise ValueError(f"--number_of_learners {cfg.number_of_learners} but WORLD_SIZE is {world}: start "
                         f"N learners with `torchrun --nproc_per_node N` and pass --number_of_learners N")
    run_dir, model_dir = role_dir(cfg, f"learner{rank}")
    write_role_file(run_dir, f"learner{rank}")
    from distrl.weights import DirectoryTransport, WeightPublisher
    from distrl.weights.base import endpoint_host
    from learn.learner import Learner

    publisher = transport = None
    if rank == 0:
        publisher = WeightPublisher(cfg.weights_pub_bind, cfg.weights_endpoint_bind)
        transport = DirectoryTransport(run_dir / "weights", keep=cfg.max_staleness + 4)
        log.info("learner0: announcing weights on %s, serving LATEST/FETCH on %s", *publisher.addresses)
    learner = Learner(cfg, rank, world, cfg.buffer_address, model_dir, publisher, transport,
                      tb_dir=str(run_dir / "tb" / f"learner{rank}"),
                      broadcast_host=endpoint_host(cfg.weights_endpoint_bind), run_dir=run_dir)
    if cfg.resume:
        learner.resume()
    generator = None  # --learner_generates: rollouts from this learner's model while its GET waits
    if cfg.learner_generates:
        from rollout.colocated import LearnerGenerator

        generator = LearnerGenerator(cfg, rank, learner.model, cfg.buffer_address, model_dir,
                                     tb_dir=str(run_dir / "tb" / f"learner{rank}gen"))
        learner.while_waiting = generator.generate_once
    try:
        result = learner.run()
        if generator is not None:
            result["generated"] = generator.summary()
        if publisher is not None and not publisher.linger(cfg.number_of_actors):  # actors fetch the last version
            log.warning("learner0: not every actor came for the final version within the time limit")
    finally:
        learner.close()
        if generator is not None:
            generator.close()
        if publisher is not None:
            publisher.close()
    log.info("learner%d: done at version %d", rank, result["version"])
    return result


def run_rollout(cfg: RolloutConfig) -> dict:
    """Run one rollout actor until the buffer says stop. Started again in the same run directory (its
    role file is there) it rejoins: fresh sampling seeds, the latest weights (docs/faults.md)."""
    run_dir, model_dir = role_dir(cfg, f"actor{cfg.actor_id}")
    rejoin = read_role_file(run_dir, f"actor{cfg.actor_id}") is not None  # this actor ran here before
    write_role_file(run_dir, f"actor{cfg.actor_id}")
    from rollout.actor import ActorEndpoints, RolloutActor
    from rollout.engines import cpu_engine_env

    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except ImportError:
        on_gpu = False
    if not on_gpu:
        for key, value in cpu_engine_env(cfg.actor_id).items():
            os.environ.setdefault(key, value)
    endpoints = ActorEndpoints(cfg.buffer_address, cfg.weights_pub, cfg.weights_endpoint)
    actor = RolloutActor(cfg, cfg.actor_id, endpoints, model_dir, work_dir=str(run_dir),
                         tb_dir=str(run_dir / "tb" / f"actor{cfg.actor_id}"), rejoin=rejoin and not cfg.resume)
    try:
        return actor.run()
    finally:
        actor.close()
