"""The Ray actor classes of `distrl train`'s roles: thin wrappers that build the plain classes in their own
processes (`buffer.server.BufferServer`, `learn.learner.Learner` with its weight publisher,
`rollout.actor.RolloutActor`), each logging to `<run_dir>/logs/<role>.log`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from distrl.cmd.config import TrainConfig, buffer_options
from distrl.cmd.faults import write_role_file
from distrl.core.logs import role_logging


class BufferRole:
    """The buffer's Ray actor: a BufferServer on this node's --host; `serve` runs until SHUTDOWN."""

    def __init__(self, cfg: TrainConfig, run_dir: str, resume_version: int | None = None):
        from buffer.server import BufferServer

        write_role_file(run_dir, "buffer0")
        role_logging(Path(run_dir) / "logs" / "buffer0.log")
        self.server = BufferServer(f"tcp://{cfg.host}:0", run_dir, batch_size=cfg.batch_size,
                                   max_staleness=cfg.max_staleness, topk=cfg.k, group_size=cfg.group_size,
                                   tb_dir=str(Path(run_dir) / "tb" / "buffer0"), resume=bool(cfg.resume),
                                   resume_version=resume_version, **buffer_options(cfg))

    def address(self) -> str:
        return self.server.address

    def serve(self) -> dict:
        try:
            self.server.serve()
            return self.server.store.stats()
        finally:  # segment and consumption logs, metrics: closed (flushed) however serving ends
            self.server.close()


class LearnerRole:
    """One learner rank's Ray actor; rank 0 also publishes weights (and --learner_generates generates)."""

    def __init__(self, cfg: TrainConfig, rank: int, buffer_address: str, model_dir: str, run_dir: str,
                 dist_address: str):
        write_role_file(run_dir, f"learner{rank}")
        role_logging(Path(run_dir) / "logs" / f"learner{rank}.log")
        set_torch_threads(cfg.torch_threads)
        if cfg.number_of_learners > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if cuda_available() else "gloo", init_method=dist_address, rank=rank,
                                    world_size=cfg.number_of_learners)
        from distrl.weights import DirectoryTransport, WeightPublisher
        from learn.learner import Learner

        publisher = transport = None
        if rank == 0:
            publisher = WeightPublisher(f"tcp://{cfg.host}:0", f"tcp://{cfg.host}:0")
            transport = DirectoryTransport(Path(run_dir) / "weights", keep=cfg.max_staleness + 4)
        self.publisher = publisher
        self.learner = Learner(cfg, rank, cfg.number_of_learners, buffer_address, model_dir, publisher,
                               transport, tb_dir=str(Path(run_dir) / "tb" / f"learner{rank}"), run_dir=run_dir)
        if cfg.resume:
            self.learner.resume()

        self.generator = None  # --learner_generates: rollouts from the learner's own model while it waits
        if cfg.learner_generates:
            from rollout.colocated import LearnerGenerator

            self.generator = LearnerGenerator(cfg, rank, self.learner.model, buffer_address, model_dir,
                                              tb_dir=str(Path(run_dir) / "tb" / f"learner{rank}gen"))
            self.learner.while_waiting = self.generator.generate_once

    def weight_addresses(self) -> tuple[str, str] | None:
        return self.publisher.addresses if self.publisher else None

    def accelerator_ids(self) -> list[str]:
        return accelerator_ids()

    def run(self) -> dict:
        result = self.learner.run()
        if self.generator is not None:
            result["generated"] = self.generator.summary()
            self.generator.close()
        self.learner.close()  # the buffer client, and the nccl sender (a round nobody joined is aborted)
        return result


class RolloutRole:
    """One rollout actor's Ray actor; Ray restarts it (--max_actor_restarts) and it rejoins the run."""

    def __init__(self, cfg: TrainConfig, actor_id: int, endpoints, model_dir: str, run_dir: str):
        import ray

        write_role_file(run_dir, f"actor{actor_id}")
        role_logging(Path(run_dir) / "logs" / f"actor{actor_id}.log")
        set_torch_threads(cfg.torch_threads)
        rejoin = ray.get_runtime_context().was_current_actor_reconstructed  # restarted by Ray
        if rejoin:
            logging.getLogger("distrl.actor").warning("actor%d: restarted (pid %d): rejoining the run",
                                                      actor_id, os.getpid())
        if not cuda_available():
            from rollout.engines import cpu_engine_env

            os.environ.update(cpu_engine_env(actor_id))
        from rollout.actor import RolloutActor

        self.actor = RolloutActor(cfg, actor_id, endpoints, model_dir, work_dir=run_dir,
                                  tb_dir=str(Path(run_dir) / "tb" / f"actor{actor_id}"), rejoin=rejoin)

    def accelerator_ids(self) -> list[str]:
        return accelerator_ids()

    def run(self) -> dict:
        return self.actor.run()


def ray_roles() -> tuple:
    """``(BufferRole, LearnerRole, RolloutRole)`` as Ray actor classes (Ray is imported only here, so
    importing this module does not import it)."""
    import ray

    return tuple(ray.remote(num_cpus=0)(cls) for cls in (BufferRole, LearnerRole, RolloutRole))


def accelerator_ids() -> list[str]:
    """The GPU ids Ray assigned to the calling role (empty without GPUs)."""
    import ray

    return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))


def set_torch_threads(threads: int | None) -> None:
    """`--torch_threads`: torch.set_num_threads in this role's process (None: leave torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
