"""`distrl train`: where the buffer's log lives across nodes, its replica, and what `--resume` needs of it.

The buffer writes its segment log and consumption log under the run directory's path on *its* node. When that
node does not see the driver's run directory (another node, no shared filesystem), losing the node would lose
the log, so the driver serves a replica of it (:class:`distrl.buffer.replica.ReplicaServer`, a thread of the
driver's process, bound on the driver's node address, CURVE with the run's keys) into its own run directory,
with the buffer's layout (``segments/``, ``consumed.jsonl``): the buffer acknowledges a group only once the
replica holds it too. On one node (or a shared filesystem) the buffer's log already is in the driver's run
directory and no replica runs: losing that node loses the driver as well.

At ``--resume`` the log must be found on the buffer's node, or in the replica (the buffer, on a node without
it, fetches the replica's copy before it starts); with neither, the resume is refused (exit 2) instead of a
buffer that starts empty and a run that silently re-serves its prompts from the start.
"""

from __future__ import annotations

import logging
from pathlib import Path

from distrl.buffer.replica import ReplicaServer
from distrl.buffer.segments import segment_paths
from distrl.core.errors import PreflightError

log = logging.getLogger("distrl.cmd.buffer_log")


def prepare_buffer_log(cfg, run_dir: Path, plan) -> str | None:
    """Before buffer0 starts: the replica of its log when it needs one (:func:`start_replica`, kept as
    ``plan.replica`` for :func:`close_replica`), and under ``--resume`` :func:`check_resume_log`. Returns the
    replica's address for buffer0, or None. Raises PreflightError, RunDirLocked."""
    plan.replica = start_replica(run_dir, plan)
    if cfg.resume:
        check_resume_log(run_dir, plan, plan.replica)
    return None if plan.replica is None else plan.replica.address


def close_replica(plan) -> None:
    """Stop the replica of ``plan`` (a NodePlan, or None), if one runs: its files synced, the lock released."""
    replica = getattr(plan, "replica", None)
    if replica is not None:
        plan.replica = None
        replica.close()
        log.info("replica of buffer0's log closed: %d records written", replica.records)


def start_replica(run_dir: Path, plan) -> ReplicaServer | None:
    """A replica of the buffer's log in ``run_dir``, served from this process, when ``plan`` (a
    distrl.cmd.nodes.NodePlan) puts buffer0 on a node that does not see the driver's run directory; else None.
    Raises RunDirLocked when a buffer on this host holds ``run_dir``."""
    if not plan.apart or "buffer0" not in plan.apart:
        return None
    import ray

    replica = ReplicaServer(run_dir, f"tcp://{ray.util.get_node_ip_address()}:0",
                            role="distrl train's replica of buffer0").start()
    log.info("buffer0 runs on %s, which does not see this run directory: its log is replicated here (%s)",
             plan.hosts["buffer0"], replica.address)
    return replica


def check_resume_log(run_dir: Path, plan, replica: ReplicaServer | None) -> None:
    """`--resume`: buffer0's node holds the segment log, or this run directory holds the replica of it.
    Raises PreflightError (exit 2) when neither does: a buffer that started empty would lose every group."""
    if plan.where("buffer0", segment_paths, run_dir):
        return
    if replica is not None and segment_paths(run_dir):
        log.info("buffer0's node (%s) has no segment log: it fetches the replica's from %s", plan.hosts["buffer0"],
                 run_dir)
        return
    raise PreflightError("--resume", f"{run_dir}: no segment log on buffer0's node ({plan.hosts['buffer0']}) "
                         "nor a replica of it in the driver's run directory",
                         "resume with buffer0 on the node that holds its log (--buffer_resources), or start a new "
                         "run (docs/multinode.md, \"Losing a node\")")
