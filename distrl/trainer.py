"""`distrl train`: buffer, rollout actors and learners on a Ray cluster (a local one by default).

The roles are thin Ray actors around the plain classes (`buffer.server.BufferServer`,
`rollout.actor.RolloutActor`, `learn.learner.Learner`); they talk only over ZMQ:

    driver: run dir + model -> BufferRole (address) -> LearnerRole x L (weight endpoints, rank 0)
            -> RolloutRole x A -> run all -> learners finish max_steps -> STOP -> actors exit
            -> SHUTDOWN buffer -> summary

Any role that raises ends the run: the driver re-raises its error after shutting the others down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path

from distrl.config import TrainConfig, buffer_options

log = logging.getLogger("distrl.trainer")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def setup_logging(log_file: Path | None = None) -> None:
    """INFO to stderr (Ray forwards it to the driver) and, if given, to a per-role log file."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=handlers, force=True)


def prepare_run_dir(cfg: TrainConfig) -> tuple[Path, str]:
    """Create the run directory, write the resolved config, build the tiny model if asked.

    Returns (run_dir, model_dir). Raises FileExistsError if the run directory exists.
    """
    run_dir = cfg.run_dir
    if run_dir.exists():
        raise FileExistsError(f"run directory {run_dir} exists: pick another --run_name or remove it")
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    model_dir = cfg.model
    if cfg.model == "tiny":
        from distrl.tiny import build_tiny_model

        model_dir = str(build_tiny_model(run_dir / "model", seed=cfg.seed))
    return run_dir, model_dir


def resume_run_dir(cfg: TrainConfig) -> tuple[TrainConfig, Path, str]:
    """`--resume <run_dir>`: the run's saved config with this command's --max_steps (and resume set).

    Returns (config, run_dir, model_dir). Raises FileNotFoundError if the directory holds no config.json.
    """
    run_dir = Path(cfg.resume).resolve()
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.json there (not a distrl run directory)")
    saved = json.loads((run_dir / "config.json").read_text())
    saved.update(max_steps=cfg.max_steps, resume=str(run_dir), log_dir=str(run_dir.parent), run_name=run_dir.name)
    resumed = TrainConfig(**saved)
    (run_dir / "config.json").write_text(resumed.to_json())
    model_dir = str(run_dir / "model") if resumed.model == "tiny" else resumed.model
    return resumed, run_dir, model_dir


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _roles():
    """Define the Ray actor classes (lazily, so importing this module does not import Ray)."""
    import ray

    @ray.remote(num_cpus=0)
    class BufferRole:
        def __init__(self, cfg: TrainConfig, run_dir: str):
            from buffer.server import BufferServer

            setup_logging(Path(run_dir) / "logs" / "buffer0.log")
            self.server = BufferServer(f"tcp://{cfg.host}:0", run_dir, batch_size=cfg.batch_size,
                                       max_staleness=cfg.max_staleness, topk=cfg.k, group_size=cfg.group_size,
                                       tb_dir=str(Path(run_dir) / "tb" / "buffer0"), resume=bool(cfg.resume),
                                       **buffer_options(cfg))

        def address(self) -> str:
            return self.server.address

        def serve(self) -> dict:
            self.server.serve()
            return self.server.store.stats()

    @ray.remote(num_cpus=0)
    class LearnerRole:
        def __init__(self, cfg: TrainConfig, rank: int, buffer_address: str, model_dir: str, run_dir: str,
                     dist_address: str):
            setup_logging(Path(run_dir) / "logs" / f"learner{rank}.log")
            if cfg.number_of_learners > 1:
                import torch.distributed as dist

                dist.init_process_group("nccl" if _cuda() else "gloo", init_method=dist_address, rank=rank,
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

        def weight_addresses(self) -> tuple[str, str] | None:
            return self.publisher.addresses if self.publisher else None

        def run(self) -> dict:
            return self.learner.run()

    @ray.remote(num_cpus=0)
    class RolloutRole:
        def __init__(self, cfg: TrainConfig, actor_id: int, endpoints, model_dir: str, run_dir: str):
            setup_logging(Path(run_dir) / "logs" / f"actor{actor_id}.log")
            if not _cuda():
                from rollout.engines import cpu_engine_env

                os.environ.update(cpu_engine_env(actor_id))
            from rollout.actor import RolloutActor

            self.actor = RolloutActor(cfg, actor_id, endpoints, model_dir, work_dir=run_dir,
                                      tb_dir=str(Path(run_dir) / "tb" / f"actor{actor_id}"))

        def run(self) -> dict:
            return self.actor.run()

    return BufferRole, LearnerRole, RolloutRole


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _wait_all(main_refs: list, side_refs: list, timeout_s: float | None = None) -> list:
    """Wait for `main_refs`; re-raise at once the error of any ref (main or side) that fails."""
    import ray

    pending, deadline = list(main_refs) + list(side_refs), None if timeout_s is None else time.time() + timeout_s
    while any(r in pending for r in main_refs):
        done, pending = ray.wait(pending, num_returns=1, timeout=5.0)
        for ref in done:
            ray.get(ref)  # raises the role's exception
        if deadline is not None and time.time() > deadline:
            raise TimeoutError(f"roles did not finish within {timeout_s}s")
    return ray.get(main_refs)


def train(cfg: TrainConfig) -> dict:
    """Run one training job to `cfg.max_steps` policy versions; returns a summary dict."""
    import ray

    from buffer.client import BufferClient
    from rollout.actor import ActorEndpoints

    if cfg.resume:
        cfg, run_dir, model_dir = resume_run_dir(cfg)
    else:
        run_dir, model_dir = prepare_run_dir(cfg)
    if cfg.weights_transport == "nccl":  # the broadcast group meets on a free port of this host
        cfg = dataclasses.replace(cfg, weights_broadcast_port=_free_port(cfg.host))
    setup_logging(run_dir / "logs" / "driver.log")
    if cfg.ray_address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=True,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    else:
        ray.init(address=cfg.ray_address)
    start = time.time()
    try:
        BufferRole, LearnerRole, RolloutRole = _roles()
        buffer = BufferRole.remote(cfg, str(run_dir))
        buffer_address = ray.get(buffer.address.remote())
        buffer_ref = buffer.serve.remote()
        dist_address = f"tcp://{cfg.host}:{_free_port(cfg.host)}"
        learners = [LearnerRole.remote(cfg, r, buffer_address, model_dir, str(run_dir), dist_address)
                    for r in range(cfg.number_of_learners)]
        pub, latest = ray.get(learners[0].weight_addresses.remote())
        endpoints = ActorEndpoints(buffer_address, pub, latest)
        actors = [RolloutRole.remote(cfg, i, endpoints, model_dir, str(run_dir)) for i in range(cfg.number_of_actors)]
        actor_refs = [a.run.remote() for a in actors]
        learner_results = _wait_all([lr.run.remote() for lr in learners], actor_refs + [buffer_ref])
        actor_results = _wait_all(actor_refs, [buffer_ref], timeout_s=600)
        client = BufferClient(buffer_address, "driver", timeout_s=10)
        client.shutdown()
        client.close()
        buffer_stats = ray.get(buffer_ref, timeout=60)
    finally:
        ray.shutdown()
    summary = {"run_dir": str(run_dir), "versions": learner_results[0]["version"], "wall_s": time.time() - start,
               "actors": actor_results, "buffer": buffer_stats,
               "reward_by_version": [h["learner/reward_mean"] for h in learner_results[0]["history"]]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary)
    return summary


def _print_summary(s: dict) -> None:
    rewards = s["reward_by_version"]
    print(f"\ndistrl: {s['versions']} policy versions in {s['wall_s']:.1f}s")
    print(f"  groups put: {s['buffer'].get('groups_put')}  evicted stale: {s['buffer'].get('evicted_stale')}  "
          f"duplicates: {s['buffer'].get('duplicates')}")
    for a in s["actors"]:
        print(f"  actor{a['actor_id']}: {a['groups']} groups, last policy version {a['last_version']}")
    if rewards:
        print(f"  reward: first version {rewards[0]:.3f}, last version {rewards[-1]:.3f}")
    print(f"  run directory: {s['run_dir']}")
    print(f"  TensorBoard:   tensorboard --logdir {s['run_dir']}/tb")
