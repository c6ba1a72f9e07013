"""`distrl train`: buffer, rollout actors and learners on a Ray cluster (a local one by default).

The roles are thin Ray actors (`distrl/cmd/roles.py`) around the plain classes (`distrl.buffer.server.BufferServer`,
`distrl.rollout.actor.RolloutActor`, `distrl.learn.learner.Learner`); they talk only over ZMQ:

    driver: run dir + model -> BufferRole, LearnerRole x L and RolloutRole x A, started together
            (the learners and actors load their models while the buffer binds; each actor loads and warms up its
            engine, then waits for learner 0's weight endpoints)
            -> run all -> learners finish max_steps -> STOP -> actors exit -> SHUTDOWN buffer -> summary

Any role that raises ends the run: after shutting the others down the driver raises its error as
`faults.RoleFailed` (the message, the last frames, its log file). Roles log to `<run_dir>/logs/<role>.log`
only (`distrl.core.logs`); the terminal shows the driver's start-up lines and its live view or progress lines.
Faults (docs/faults.md): Ray restarts a dead rollout actor (--max_actor_restarts), on a node with room when
its node is lost, and it rejoins; an actor whose restarts are used up is gone and the run goes on with the
others (distrl.cmd.actor_runs); a watchdog reads the buffer's last-seen times and restarts a stuck actor
or ends the run on a stuck learner or buffer (--heartbeat_timeout_s); SIGINT/SIGTERM flush the buffer,
write summary.json saying so and stop every process (exit 130/143).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from distrl.cmd.actor_runs import ActorRuns
from distrl.cmd.buffer_log import close_replica, prepare_buffer_log
from distrl.cmd.compose import flat_fields
from distrl.cmd.config import RolloutConfig, TrainConfig
from distrl.cmd.console import start_console
from distrl.cmd.faults import (
    as_interrupted,
    end_early,
    raise_on_signals,
    resumable,
    role_failed,
    watch_roles,
)
from distrl.cmd.join import joined_actors, write_train_join_file
from distrl.cmd.placement import reserve
from distrl.cmd.report import write_report
from distrl.cmd.roles import learner_endpoints, ray_roles
from distrl.cmd.run_dir import checkpoint_version, prepare_run_dir, resume_run_dir, resumed_config
from distrl.cmd.stacks import needed, probe_here, probe_on_nodes, settle_stacks
from distrl.core.compile_cache import use_compile_caches
from distrl.core.errors import PreflightError
from distrl.core.logs import quiet_libraries, ray_errors_to_log, set_stderr_level, setup_logging
from distrl.core.security import use_run_keys
from distrl.core.startup import mark, process_start, record_to, startup_summary
from distrl.weights import transport

log = logging.getLogger("distrl.cmd.trainer")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_all(main_refs: list, side_refs: list, actors, timeout_s: float | None = None, watch=None) -> list:
    """Wait for `main_refs` (empty: for every actor of `actors`, a distrl.cmd.actor_runs.ActorRuns, to finish or
    be gone); re-raise at once the error of any ref that fails (an actor gone is no error: `actors.settle`);
    call `watch()` (the liveness check) every few seconds meanwhile. Returns the results of `main_refs`."""
    import ray

    waiting, deadline = [*main_refs, *side_refs], None if timeout_s is None else time.time() + timeout_s
    while any(r in waiting for r in main_refs) if main_refs else actors.running():
        refs = waiting + actors.pending()
        done = ray.wait(refs, num_returns=1, timeout=5.0)[0] if refs else time.sleep(1.0) or []
        for ref in done:
            if not actors.settle(ref):
                waiting.remove(ref)
                ray.get(ref)  # raises the role's exception
        if watch is not None:
            watch()
        if deadline is not None and time.time() > deadline:
            raise TimeoutError(f"roles did not finish within {timeout_s}s")
    return ray.get(main_refs)


# ray.init of a local cluster. address="local": always a new one, never a cluster that RAY_ADDRESS or the last
# `ray start`'s /tmp/ray/ray_current_cluster names (joining one is --ray_address; a stale file made ray.init fail).
LOCAL_RAY = dict(address="local", include_dashboard=False, object_store_memory=256 * 2**20)


def _connect_ray(cfg: TrainConfig) -> bool:
    """Join --ray_address, reuse a Ray this process already started, or start a local cluster.

    Returns True when this call started (and so must shut down) the connection.
    """
    import ray

    if ray.is_initialized():  # e.g. a test or a notebook that called ray.init(num_gpus=...) itself
        return False
    # roles log to <run_dir>/logs/<role>.log only (distrl.core.logs); a role's error reaches the driver as its
    # exception (RoleFailed), so Ray forwards no output and prints no "Unhandled error" dumps at exit
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    quiet = dict(log_to_driver=False, logging_level=logging.WARNING)
    env = {"TOKENIZERS_PARALLELISM": "false"}  # every role's
    if cfg.ray_address is None:
        # a local cluster's workers inherit this process's environment: no job runtime_env, whose setup before each
        # worker start made the roles' processes ~2 s later to start (measured on the 2-core VM)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.update(env)
        ray.init(**LOCAL_RAY, **quiet)
    else:
        ray.init(address=cfg.ray_address, runtime_env={"env_vars": env}, **quiet)
    ray_errors_to_log()
    return True


@dataclasses.dataclass
class _Run:
    """What a run started, recorded as each part starts, so a failure part-way shuts down just that."""

    placement: object = None
    buffer: object = None
    buffer_address: str | None = None
    buffer_address_ref: object = None  # the Ray reference to it (the learners and actors resolve it)
    buffer_ref: object = None
    console: object = None
    watchdog: object = None
    learners: list = dataclasses.field(default_factory=list)
    actors: list = dataclasses.field(default_factory=list)
    learner_refs: list = dataclasses.field(default_factory=list)
    weights: object = None  # the Ray reference to learner 0's weight endpoints (the actors resolve it)
    actor_runs: object = None  # distrl.cmd.actor_runs.ActorRuns: the actors' run calls, results, those gone
    gpu_ids: dict = dataclasses.field(default_factory=dict)
    plan: object = None  # distrl.cmd.nodes.NodePlan: each role's node, address, model; the outputs gathered
    hosts: dict = dataclasses.field(default_factory=dict)  # role -> the address of its node, as it reported it

    def handles(self) -> dict:
        """Role name -> Ray actor handle (None for one not started)."""
        return {"buffer0": self.buffer, **{f"learner{r}": h for r, h in enumerate(self.learners)},
                **{f"actor{i}": h for i, h in enumerate(self.actors)}}


def _prepare(cfg: TrainConfig) -> tuple[TrainConfig, Path, str, bool]:
    """The run directory (new or resumed), driver logging, the warm start, Ray; returns
    ``(cfg, run_dir, model_dir, owns_ray)``. A new run's directory is removed if this fails."""
    if cfg.resume:
        run_dir, model_dir = resume_run_dir(cfg)
    else:
        run_dir, model_dir = prepare_run_dir(cfg)
    if transport(cfg.weights_transport).needs_broadcast_port:  # its group meets on a free port of this host
        cfg = dataclasses.replace(cfg, weights_broadcast_port=_free_port(cfg.host))
    setup_logging(run_dir / "logs" / "driver.log")
    _print_start(run_dir, 0 if cfg.resume else cfg.warm_start_steps)
    if cfg.console and sys.stderr.isatty():  # the terminal is the live view's: driver INFO lines to driver.log
        set_stderr_level(logging.WARNING)
    try:
        if cfg.warm_start_steps and not cfg.resume:  # before any role: every role's base model is the result
            from distrl.cmd.warm_start import warm_start_run

            model_dir = warm_start_run(cfg, run_dir, model_dir)
        owns_ray = _connect_ray(cfg)
    except Exception:  # no role ran: a new run's directory would only block the corrected command
        if not cfg.resume:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return cfg, run_dir, model_dir, owns_ray


def _start_roles(cfg: TrainConfig, run_dir: Path, model_dir: str, run: _Run) -> None:
    """Buffer (then the live view), learners, rollout actors, each recorded in `run` as it starts. The three are
    created together: the learners and actors start their processes and load their models while the buffer binds;
    each resolves the buffer's address (``run.buffer_address_ref``) where it first needs it."""
    import ray

    from distrl.rollout.actor import ActorEndpoints

    plan = run.plan
    BufferRole, LearnerRole, RolloutRole = ray_roles()
    replica = prepare_buffer_log(cfg, run_dir, plan)  # buffer0 on a node apart: its log's replica here
    # one malloc arena from the process start: received messages then use the prefaulted heap (distrl.buffer.memory)
    run.buffer = BufferRole.options(runtime_env={"env_vars": {"MALLOC_ARENA_MAX": "1"}},
                                    **run.placement.options("buffer0")).remote(
        plan.role_cfg["buffer0"], str(run_dir),
        plan.where("learner0", checkpoint_version, run_dir) if cfg.resume else None, plan.keys,  # learner 0's node
        replica)
    run.buffer_address_ref = run.buffer.address.remote()
    buffer_host = run.buffer.node_address.remote()  # before serve() holds its thread (a Ray actor's calls run in order)
    run.buffer_ref = run.buffer.serve.remote()
    buffer = [run.buffer_address_ref]  # in a list: Ray does not wait for it before a role's constructor starts
    dist_address = plan.dist_address or f"tcp://{cfg.host}:{_free_port(cfg.host)}"
    run.learners = [LearnerRole.options(**run.placement.options(f"learner{r}")).remote(
                        plan.role_cfg[f"learner{r}"], r, buffer, plan.model_dirs[f"learner{r}"],
                        str(run_dir), dist_address, plan.keys)
                    for r in range(cfg.number_of_learners)]
    run.weights = run.learners[0].weight_addresses.remote()  # kept: a restarted actor resolves it again
    # the actors load and warm up their engines while the learners load; they ask for learner 0's weight endpoints
    # after that (a vLLM engine's first start on a GPU asks before: distrl.rollout.engines.vllm_plan)
    late = functools.partial(learner_endpoints, buffer, [run.weights])
    restarts = dict(max_restarts=cfg.max_actor_restarts, max_task_retries=cfg.max_actor_restarts)
    mark("actors_created")
    run.actors = [RolloutRole.options(**restarts, **run.placement.options(f"actor{i}")).remote(
                      plan.role_cfg[f"actor{i}"], i, late, plan.model_dirs[f"actor{i}"], str(run_dir), plan.keys)
                  for i in range(cfg.number_of_actors)]
    run.buffer_address = ray.get(run.buffer_address_ref)
    mark("buffer_ready")
    run.hosts["buffer0"] = ray.get(buffer_host)
    run.console = start_console(cfg.console, run.buffer_address, run_dir, cfg.max_steps, cfg.max_rows)
    pub, latest = ray.get(run.weights)
    write_train_join_file(cfg, run_dir, model_dir, ActorEndpoints(run.buffer_address, pub, latest), plan.keys,
                          [f.name for f in flat_fields(RolloutConfig)])  # `distrl rollout --join`
    run.gpu_ids = {name: ray.get(h.accelerator_ids.remote()) for name, h in run.handles().items() if name != "buffer0"}
    log.info("placement (GPUs per actor %g, per learner %g): %s", run.placement.gpus_per_actor,
             run.placement.gpus_per_learner, run.gpu_ids)
    run.hosts.update({name: ray.get(h.node_address.remote()) for name, h in run.handles().items() if name != "buffer0"})
    log.info("roles' addresses: %s; buffer %s, weights %s", run.hosts, run.buffer_address, pub)
    run.actor_runs = ActorRuns({f"actor{i}": a for i, a in enumerate(run.actors)},
                               getattr(cfg, "learner_generates", False),
                               unavailable_s=max(120.0, cfg.heartbeat_timeout_s),
                               joined=lambda: joined_actors(run.buffer_address))
    run.learner_refs = [lr.run.remote() for lr in run.learners]


def _place(cfg: TrainConfig, run_dir: Path, model_dir: str, run: _Run, probe_nodes: bool) -> TrainConfig:
    """Reserve the roles' placement and plan what each node needs (distrl.cmd.nodes); returns the config
    with its weight transport settled and, with ``probe_nodes``, its stacks settled by probes on the roles'
    nodes (distrl.cmd.stacks). Raises PreflightError for a flag the placement makes unworkable."""
    from distrl.cmd.nodes import plan_nodes

    run.placement = reserve(cfg)
    if probe_nodes:  # a cluster joined or started before: each role's own node says what imports there
        cfg = settle_stacks(cfg, probe_on_nodes(needed(cfg), run.placement.nodes))
    run.plan = plan_nodes(cfg, run_dir, model_dir, run.placement)
    use_run_keys(run.plan.keys)  # the driver's own buffer clients (shutdown, watchdog, live view, early end)
    log.info("endpoints: %s", "CURVE with this run's keys (--no_auth: plain TCP)" if run.plan.keys else "plain TCP")
    if run.plan.gatherer is not None:
        log.info("roles on nodes without this run directory: %s (their logs and events are copied here)",
                 run.plan.gatherer.globs and sorted(run.plan.gatherer.globs))
    return run.plan.cfg


def _with_gathering(watch, gatherer):
    """The liveness check `watch` (or None), also copying other nodes' role outputs every so often."""
    if gatherer is None:
        return watch

    def both() -> None:
        if watch is not None:
            watch()
        gatherer.maybe_gather()

    return both


def _gather(run: _Run) -> None:
    """Copy the outputs of roles on other nodes into the run directory (none: nothing to do; never raises)."""
    if run.plan is not None and run.plan.gatherer is not None:
        try:
            run.plan.gatherer.gather()
        except Exception as exc:  # the run's own outcome matters more than a missing log
            log.warning("gathering the roles' logs failed: %s", exc)


def _running(run: _Run) -> list[str]:
    """Names of the roles whose run call is in flight (the watchdog judges only those)."""
    import ray

    fixed = {"buffer0": run.buffer_ref, **{f"learner{r}": ref for r, ref in enumerate(run.learner_refs)}}
    return [name for name, ref in fixed.items() if not ray.wait([ref], timeout=0)[0]] + run.actor_runs.running()


def _stop(run: _Run, owns_ray: bool) -> None:
    """The live view, the watchdog, our roles (on a cluster we joined), the placement group, Ray."""
    import ray

    if run.console is not None:
        run.console.stop()
    if run.watchdog is not None:
        run.watchdog.close()
    if not owns_ray:  # a cluster we joined lives on: end our roles so their GPUs are free again
        for handle in run.handles().values():
            if handle is not None:
                ray.kill(handle)
    if run.placement is not None:
        run.placement.release()
    if owns_ray:
        ray.shutdown()
    close_replica(run.plan)  # once the buffer is gone: its last records are in
    use_run_keys(None)


def _settle(cfg: TrainConfig, ray_started: bool) -> tuple[TrainConfig, bool, dict | None]:
    """Before anything starts: a resumed run's saved config (and, when its checkpoint already reached --max_steps,
    the summary of a run with nothing to do: no file changed), then the stacks probed here when every role runs on
    this host. Returns ``(cfg, probed_here, finished)``."""
    if cfg.resume:
        cfg = resumed_config(cfg)
        done = checkpoint_version(cfg.run_dir)
        if done >= cfg.max_steps:
            print(f"distrl train: nothing to do: run finished at version {done} (--max_steps {cfg.max_steps}); "
                  f"pass a larger --max_steps to train on", flush=True)
            return cfg, False, {"run_dir": str(cfg.run_dir), "versions": done, "nothing_to_do": True}
    here = not cfg.ray_address and not ray_started
    if here:  # every role on this host: probe before Ray starts (a ray cluster's nodes: in _place)
        cfg = settle_stacks(cfg, probe_here(needed(cfg)))
    return cfg, here, None


def train(cfg: TrainConfig) -> dict:
    """Run one training job to `cfg.max_steps` policy versions; returns a summary dict."""
    quiet_libraries()  # before the imports below load torch (and torchao)
    use_compile_caches()  # before Ray starts: its workers inherit the variables
    import ray

    from distrl.buffer.segments import groups_by_actor
    from distrl.core.buffer_client import BufferClient

    began = time.time()  # the whole command, warm start included (report's wall_s)
    cfg, here, finished = _settle(cfg, ray.is_initialized())
    if finished is not None:
        return finished
    cfg, run_dir, model_dir, owns_ray = _prepare(cfg)
    raise_on_signals()  # after ray.init, which sets its own SIGTERM handler
    record_to(run_dir, "driver")  # start-up marks (distrl.core.startup): summary.json's startup
    mark("launch", process_start())
    mark("train", began)
    mark("ray_started")
    start, run = time.time(), _Run()
    try:
        cfg = _place(cfg, run_dir, model_dir, run, probe_nodes=not here)
        _start_roles(cfg, run_dir, model_dir, run)
        run.watchdog, watch = watch_roles(cfg, run_dir, run.buffer_address, run.handles(), lambda: _running(run))
        watch = _with_gathering(watch, run.plan.gatherer)
        learner_results = _wait_all(run.learner_refs, [run.buffer_ref], run.actor_runs, watch=watch)
        _wait_all([], [run.buffer_ref], run.actor_runs, timeout_s=600, watch=watch)
        actor_results = run.actor_runs.outcomes()
        run.console.finish()  # its last poll while the buffer answers
        closed = [learner.close.remote() for learner in run.learners]  # the actors have the final version
        client = BufferClient(run.buffer_address, "driver", timeout_s=10)
        client.shutdown()
        client.close()
        buffer_stats = ray.get(run.buffer_ref, timeout=60)
        ray.get(closed, timeout=60)
        _gather(run)
        logged = run.plan.where("buffer0", groups_by_actor, run_dir)  # the segment log stays on the buffer's node
    except PreflightError:  # the placement makes a flag unworkable (distrl.cmd.nodes): no role started
        if not cfg.resume:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    except (Exception, KeyboardInterrupt) as exc:  # a signal, a stuck or a failed role: flush the buffer, say why
        _gather(run)
        reason = as_interrupted(exc) if isinstance(exc, KeyboardInterrupt) else role_failed(exc, run.handles(), run_dir)
        if run.console is not None:  # the last view stays; what follows is printed below it
            run.console.stop()
        end_early(reason, run_dir, start, run.buffer_address, run.buffer_ref, can_resume=resumable(exc))
        if reason is not exc:  # the signal Ray turned into a plain KeyboardInterrupt, or a role's RoleFailed
            raise reason from None
        raise
    finally:
        _stop(run, owns_ray)
    summary = _summary(run_dir, began, start, run.gpu_ids, learner_results, actor_results, buffer_stats, logged)
    summary["hosts"], summary["authenticated"] = run.hosts, run.plan.keys is not None
    summary["startup"] = startup_summary(run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary)
    summary.update(write_report(run_dir, summary))  # curve.png, table, summary.json; last stdout line: JSON
    return summary


def _summary(run_dir: Path, began: float, start: float, gpu_ids: dict, learner_results: list,
             actor_results: list, buffer_stats: dict, logged: dict[int, int]) -> dict:
    """summary.json: versions, wall times, GPU ids, each role's groups as the segment log counts them."""
    from distrl.cmd.report import reward_series

    # logged: groups per role, the segment log's (not a counter a restarted process reset)
    generated = [r.get("generated") for r in learner_results]  # --learner_generates
    return {"run_dir": str(run_dir), "versions": learner_results[0]["version"], "wall_s": time.time() - began,
            "train_wall_s": time.time() - start, "gpu_ids": gpu_ids,
            "learner_generated": [_logged_groups(g, logged) for g in generated],
            "actors": [_logged_groups(a, logged) for a in actor_results], "buffer": buffer_stats,
            "long_prompts_skipped": sum((a or {}).get("long_prompts_skipped", 0) for a in actor_results + generated),
            "reward_timeouts": sum((a or {}).get("reward_timeouts", 0) for a in actor_results + generated),
            "reward_by_version": [reward for _, reward in reward_series(run_dir)]}  # versions 1.., resumes too


def _logged_groups(result: dict | None, logged: dict[int, int]) -> dict | None:
    """A role's result (an actor's, a learner's --learner_generates) with ``groups`` taken from the segment
    log's count for its ``actor_id`` (``logged``): the whole run's, across restarts and --resume."""
    return None if result is None else {**result, "groups": logged.get(result["actor_id"], 0)}


def _print_start(run_dir: Path, warm_start_steps: int) -> None:
    """The driver's start-up lines on stderr: where the run and its logs are (roles print nothing)."""
    print(f"distrl train: run directory {run_dir}\n  role logs:   {run_dir}/logs/<role>.log (driver, buffer0, "
          f"learner0, actor0, ...)\n  TensorBoard: tensorboard --logdir {run_dir}/tb", file=sys.stderr, flush=True)
    if warm_start_steps:
        print(f"  warm start:  up to {warm_start_steps} supervised steps first (progress in logs/driver.log)",
              file=sys.stderr, flush=True)


def _print_summary(s: dict) -> None:
    rewards = s["reward_by_version"]
    print(f"\ndistrl: {s['versions']} policy versions in {s['wall_s']:.1f}s")
    print(f"  groups put: {s['buffer'].get('groups_put')}  evicted stale: {s['buffer'].get('evicted_stale')}  "
          f"duplicates: {s['buffer'].get('duplicates')}")
    for a in s["actors"]:
        print(f"  actor{a['actor_id']}: {a['groups']} groups, " + (f"gone ({a['gone']})" if a.get("gone") else
                                                                   f"last policy version {a['last_version']}"))
    for g in s.get("learner_generated") or []:
        if g:
            print(f"  {g['name']} (--learner_generates): {g['groups']} groups in {g['generate_s']:.1f}s")
    if any(s.get("gpu_ids", {}).values()):
        print(f"  GPU ids: {s['gpu_ids']}")
    if s.get("long_prompts_skipped"):
        print(f"  prompts skipped as too long for --max_model_len: {s['long_prompts_skipped']}")
    if s.get("reward_timeouts"):
        print(f"  rewards that ran past their time limit and scored 0: {s['reward_timeouts']} (actor logs say which)")
    if rewards:
        print(f"  reward: first version {rewards[0]:.3f}, last version {rewards[-1]:.3f}")
    print(f"  run directory: {s['run_dir']}")
    print(f"  TensorBoard:   tensorboard --logdir {s['run_dir']}/tb")
