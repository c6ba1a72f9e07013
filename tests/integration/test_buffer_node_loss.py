"""Losing the buffer's node loses nothing acknowledged (issue 41, docs/multinode.md "Losing a node").

Two Ray nodes on this machine, as in test_multinode.py (node 2 in its own mount namespace with tmpfs over the log
directory: its run directory is its own disk). The buffer is pinned to node 2 (``--buffer_resources``), the
learner and the actor run on node 1, the driver's node, which gets the replica of the buffer's log. Node 2 is
lost after learner version 3: the run ends naming buffer0. With a fresh node 2 whose disk is empty and the
replica moved away, ``--resume`` exits 2 with one line; with the replica back it finishes: every group of the
replica at the loss (a superset of the acknowledged ones) is in the final log exactly once (acked_lost 0), the
kept consumption log's versions never go backwards, and the actor continues its prompt stream after its
logged groups instead of from the start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.integration.test_multinode import (
    ENV,
    NODE2,
    RAY,
    ROOT,
    _cluster_pids,
    _cmdline,
    _consumed,
    _lose_node,
    cluster,  # noqa: F401 - the module's two-node fixture
    distrl_train_async,
)

pytestmark = pytest.mark.slow
FLAGS = ("--number_of_actors", "1", "--buffer_resources", '{"node2": 1}', "--checkpoint_every", "2")
STEPS = 8


def _start_node2(cluster) -> None:  # noqa: F811
    """A fresh node 2 (new mount namespace, empty tmpfs over its temp dir, the log and model directories)."""
    hidden = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in (cluster.temp2, cluster.log_dir, cluster.model_dir))
    node2 = (f"{RAY} start --address {cluster.address} --node-ip-address {NODE2} --temp-dir {cluster.temp2} "
             f"--num-cpus 2 --disable-usage-stats --resources '{{\"node2\": 2}}'")
    subprocess.run(["unshare", "-m", "bash", "-c", f"{hidden} && {node2}"], env=getattr(cluster, "env", ENV),
                   check=True, capture_output=True, timeout=120)
    for _ in range(120):
        if NODE2 in cluster._alive_nodes():
            return
        time.sleep(0.5)
    raise RuntimeError("the fresh node 2 did not join")


def _resume(cluster, run_dir) -> subprocess.CompletedProcess:  # noqa: F811
    """`distrl train --resume` (the run's config.json names the cluster, the flags, the buffer's resource)."""
    return subprocess.run([sys.executable, "-m", "distrl", "train", "--resume", str(run_dir), "--max_steps",
                           str(STEPS)], cwd=ROOT, env=getattr(cluster, "env", ENV), capture_output=True, text=True,
                          timeout=600)


def _groups(run_dir) -> list[str]:
    from distrl.buffer.segments import read_segments

    return read_segments(run_dir).column("group_id").to_pylist()


def test_buffer_node_lost_then_resumed_with_a_fresh_node(cluster):  # noqa: F811
    run_dir = cluster.log_dir / "buffer-loss"
    proc = distrl_train_async(cluster, "buffer-loss", "--max_steps", str(STEPS), *FLAGS)
    try:
        while proc.poll() is None and max([r["learner_version"] for r in _consumed(run_dir)] or [0]) < 3:
            time.sleep(0.5)  # consumed.jsonl here is the replica's: the buffer writes its own on node 2
        raylets = [pid for pid in _cluster_pids([str(cluster.temp2)]) if "raylet" in _cmdline(pid)]
        assert proc.poll() is None and len(raylets) == 1, (proc.poll(), raylets)
        _lose_node(raylets[0])
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "buffer0" in err, out[-2000:] + err[-4000:]
    assert "its log is replicated here" in (run_dir / "logs" / "driver.log").read_text()
    at_loss = Counter(_groups(run_dir))  # the replica: every acknowledged group, maybe a few unacknowledged
    assert at_loss and set(at_loss.values()) == {2}, at_loss  # --group_size 2, whole groups only
    actor0_at_loss = sum(1 for g in at_loss if g.startswith("actor0-"))

    _start_node2(cluster)
    (run_dir / "segments").rename(run_dir / "segments.aside")  # neither log (fresh node 2) nor replica
    refused = _resume(cluster, run_dir)
    (run_dir / "segments.aside").rename(run_dir / "segments")
    errors = [line for line in refused.stderr.splitlines() if "error" in line]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-4000:]
    assert "--resume:" in errors[0] and f"no segment log on buffer0's node ({NODE2})" in errors[0], errors
    assert "Traceback" not in refused.stderr

    resumed = _resume(cluster, run_dir)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == STEPS and summary["hosts"]["buffer0"] == NODE2
    final = Counter(_groups(run_dir))  # the replica again, which the resumed buffer (on the new node 2) fed
    acked_lost = set(at_loss) - set(final)
    assert not acked_lost and set(final.values()) == {2}, (acked_lost, final)
    assert len(final) == summary["buffer"]["groups_put"] > len(at_loss)
    versions = [r["learner_version"] for r in _consumed(run_dir) if r["rank"] == 0]
    assert versions == sorted(set(versions)) and versions[-1] == STEPS - 1, versions  # never backwards
    actor_log = (run_dir / "logs" / "actor0.log").read_text()
    assert f"resuming after the {actor0_at_loss} problems" in actor_log, actor_log[-3000:]  # not from the start
    buffer_log = (run_dir / "logs" / "buffer0.log").read_text()
    assert "fetched the log's" in buffer_log, buffer_log[-3000:]
    print("buffer node loss:", {"at_loss": len(at_loss), "final": len(final), "acked_lost": len(acked_lost),
                                "versions": versions}, file=sys.stderr)
