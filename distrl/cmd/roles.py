"""The Ray actor classes of `distrl train`'s roles: thin wrappers that build the plain classes in their own
processes (`distrl.buffer.server.BufferServer`, `distrl.learn.learner.Learner` with its weight publisher,
`distrl.rollout.actor.RolloutActor`), each logging to `<run_dir>/logs/<role>.log`. Each gets the run's CURVE keys
(`distrl.core.security.RunKeys`, or None: plain TCP) as an argument from the driver, never from a file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from distrl.cmd.assemble import buffer_sections, build_actor, build_learner, cuda_available, set_torch_threads
from distrl.cmd.config import TrainConfig
from distrl.cmd.faults import write_role_file
from distrl.core.heap import steady_heap
from distrl.core.logs import role_logging
from distrl.core.startup import mark, record_to


def begin_role(run_dir: str, name: str, keys=None) -> None:
    """First steps of every role process: its role file, its log file, a steady C heap (distrl.core.heap), the
    run's CURVE keys for every socket it makes (``keys``: a distrl.core.security.RunKeys, or None), compile
    caches kept across runs (distrl.core.compile_cache)."""
    from distrl.core.compile_cache import use_compile_caches
    from distrl.core.security import use_run_keys

    use_compile_caches()
    write_role_file(run_dir, name)
    role_logging(Path(run_dir) / "logs" / f"{name}.log")
    record_to(run_dir, name)  # start-up marks (distrl.core.startup)
    mark("role_started")
    steady_heap()
    use_run_keys(keys)
    if keys is not None:
        logging.getLogger("distrl.cmd.roles").info("%s: CURVE on: sockets use the run's keys %r", name, keys)


class _Role:
    """What the driver asks every role: where it runs and which GPUs Ray gave it."""

    def accelerator_ids(self) -> list[str]:
        return accelerator_ids()

    def node_address(self) -> str:
        return node_address()


class BufferRole(_Role):
    """The buffer's Ray actor: a BufferServer on this node's --host; `serve` runs until SHUTDOWN."""

    def __init__(self, cfg: TrainConfig, run_dir: str, resume_version: int | None = None, keys=None,
                 replica: str | None = None):
        from distrl.buffer.assemble import build_buffer

        begin_role(run_dir, "buffer0", keys)
        self.server = build_buffer(*buffer_sections(cfg), run_dir, address=f"tcp://{cfg.host}:0",
                                   resume=bool(cfg.resume), resume_version=resume_version,
                                   role="distrl train's buffer0", replica=replica)

    def address(self) -> str:
        return self.server.address

    def serve(self) -> dict:
        try:
            self.server.serve()
            return self.server.store.stats()
        finally:  # segment and consumption logs, metrics: closed (flushed) however serving ends
            self.server.close()


class LearnerRole(_Role):
    """One learner rank's Ray actor (distrl.cmd.assemble.build_learner); rank 0 also publishes weights.
    ``run`` closes everything on error; after a finished run the driver calls ``close`` once the actors
    are done (until then rank 0 serves the final version to them)."""

    def __init__(self, cfg: TrainConfig, rank: int, buffer_address: str | list, model_dir: str, run_dir: str,
                 dist_address: str, keys=None):
        """``buffer_address``: the buffer's address, or a list holding the Ray reference to it (the buffer may
        still be binding): then it is resolved when the learner makes its buffer client, after its model loaded."""
        begin_role(run_dir, f"learner{rank}", keys)
        set_torch_threads(cfg.torch_threads)
        if cfg.number_of_learners > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if cuda_available() else "gloo", init_method=dist_address, rank=rank,
                                    world_size=cfg.number_of_learners)
        bind = f"tcp://{cfg.host}:0"
        model_dir = local_model(model_dir, run_dir)
        buffer = buffer_address if isinstance(buffer_address, str) else lambda: resolved(buffer_address)
        self.parts = build_learner(cfg, rank, cfg.number_of_learners, run_dir, model_dir, buffer,
                                   weights_bind=(bind, bind), resume=bool(cfg.resume))
        mark("ready")

    def weight_addresses(self) -> tuple[str, str] | None:
        return self.parts.weight_addresses

    def run(self) -> dict:
        try:
            result = self.parts.run()
            mark("finished")  # with what it compiled since its warm-up (distrl.core.startup)
            return result
        except BaseException:
            self.parts.close(linger=False)
            raise

    def close(self) -> None:
        """The actors are done (the driver saw them return): close without waiting for them."""
        self.parts.close(linger=False)


def resolved(ref: list):
    """The value of the Ray reference in ``ref`` (a list of one: passed that way, Ray does not wait for it before
    the constructor that receives it starts)."""
    import ray

    return ray.get(ref[0])


def learner_endpoints(buffer: str | list, weights: list):
    """The actor's endpoints once learner 0 is up: ``weights`` holds the Ray reference to its
    ``weight_addresses()``; ``buffer`` is the buffer's address or holds the reference to it (:func:`resolved`)."""
    from distrl.rollout.actor import ActorEndpoints

    return ActorEndpoints(buffer if isinstance(buffer, str) else resolved(buffer), *resolved(weights))


class RolloutRole(_Role):
    """One rollout actor's Ray actor (distrl.cmd.assemble.build_actor); Ray restarts it
    (--max_actor_restarts) and it rejoins the run. ``run`` closes the actor however it ends."""

    def __init__(self, cfg: TrainConfig, actor_id: int, endpoints, model_dir: str, run_dir: str, keys=None):
        import ray

        begin_role(run_dir, f"actor{actor_id}", keys)
        set_torch_threads(cfg.torch_threads)
        rejoin = ray.get_runtime_context().was_current_actor_reconstructed  # restarted by Ray
        if rejoin:
            logging.getLogger("distrl.actor").warning("actor%d: restarted (pid %d): rejoining the run",
                                                      actor_id, os.getpid())
        model_dir = local_model(model_dir, run_dir)
        self.parts = build_actor(cfg, actor_id, endpoints, model_dir, run_dir, rejoin=rejoin)

    def run(self) -> dict:
        try:
            result = {**self.parts.run(), "host": node_address()}  # where it finished (Ray may have moved it)
            mark("finished")
            return result
        finally:
            self.parts.close()


def ray_roles() -> tuple:
    """``(BufferRole, LearnerRole, RolloutRole)`` as Ray actor classes (Ray is imported only here, so
    importing this module does not import it)."""
    import ray

    return tuple(ray.remote(num_cpus=0)(cls) for cls in (BufferRole, LearnerRole, RolloutRole))


def accelerator_ids() -> list[str]:
    """The GPU ids Ray assigned to the calling role (empty without GPUs)."""
    import ray

    return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))


def node_address() -> str:
    """The address of the Ray node the calling role runs on (where it binds when a run spans nodes)."""
    import ray

    return ray.util.get_node_ip_address()


def local_model(model_dir, run_dir: str) -> str:
    """The model directory on this node: a path as given, or where a shipped ``nodes.ModelFiles`` lands here."""
    return model_dir if isinstance(model_dir, str) else model_dir.here(run_dir)
