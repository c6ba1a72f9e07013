"""`distrl train` on a two-node Ray cluster with no shared filesystem (issue 20, docs/multinode.md).

Both nodes run on this machine: node 1 is a head node at 127.0.0.1, node 2 a second `ray start` at
127.0.0.2 (a loopback address of its own) with the custom resource ``node2``. Node 2's processes live in
a private mount namespace (``unshare -m``) with a tmpfs over its Ray temp dir, over the log directory and
over the ``--model`` directory: what a role on node 2 writes there is invisible on node 1, and node 1's
model and run directory are invisible on node 2, as on two machines without a shared filesystem.

Node 1's Python processes find a stand-in ``unsloth`` package first on their path (under the log directory, which
node 2 does not see) that kills its importer by SIGILL, as the real one does on a CPU without AVX-512: the
learners on node 1 fall back to --backend hf after the probe on their node (distrl/cmd/stacks.py).

Each cluster has its own temp dirs and ports (other Ray clusters on this machine are left alone); the
fixture ends it by the pids of the processes whose command line names its temp dirs (never `ray stop`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrl.core.probe import sigill_hint

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
       "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
NODE2 = "127.0.0.2"
# The GCS health-checks each raylet every second instead of every 3 s (Ray's default): a killed raylet refuses
# the check at once, so node 2 is marked dead after 5 failed checks in ~5 s, not ~15 s (test_node_loss...). A
# live but slow raylet is judged as before: 5 checks in a row must each go unanswered for 10 s (the default
# health_check_timeout_ms and failure_threshold are kept).
HEAD_ENV = {"RAY_health_check_period_ms": "1000"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_pids(marks: list[str]) -> list[int]:
    """Pids of the processes whose command line names one of ``marks`` (this cluster's temp dirs)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in cmdline for mark in marks):
            pids.append(int(proc.name))
    return pids


def _end_cluster(marks: list[str]) -> None:
    """SIGTERM, then SIGKILL after 2 s, to this cluster's processes (by pid). Ray's gcs_server, raylet and
    autoscaler monitor outlive a SIGTERM by more than 10 s; the cluster is thrown away, so they need no longer."""
    for sig, polls in ((signal.SIGTERM, 20), (signal.SIGKILL, 100)):
        pids = _cluster_pids(marks)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for _ in range(polls):
            if not _cluster_pids(marks):
                return
            time.sleep(0.1)


class Cluster:
    """A head node (127.0.0.1) and node 2 (127.0.0.2, resource ``node2``, private tmpfs mounts)."""

    def __init__(self, base: Path):
        self.base = base
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp1, self.temp2 = Path(f"/tmp/rmn1-{self.port}"), Path(f"/tmp/rmn2-{self.port}")  # short: socket paths
        self.log_dir, self.model_dir = base / "runs", base / "model"
        for d in (self.temp1, self.temp2, self.log_dir, self.model_dir):
            d.mkdir(parents=True, exist_ok=True)
        from tests.unit.test_probe import SIGILL_INIT, stand_in

        self.env = {**ENV, "PYTHONPATH": str(stand_in(self.log_dir / "sigill", SIGILL_INIT)),
                    "DISTRL_CACHE_DIR": str(base / "cache")}  # node 2: no such directory there

    def start(self) -> None:
        common = ["--num-cpus", "2", "--disable-usage-stats"]
        subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
                        "--temp-dir", str(self.temp1), "--include-dashboard", "false", *common],
                       env={**self.env, **HEAD_ENV}, check=True, capture_output=True, timeout=120)
        hidden = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in (self.temp2, self.log_dir, self.model_dir))
        node2 = (f"{RAY} start --address {self.address} --node-ip-address {NODE2} --temp-dir {self.temp2} "
                 f"{' '.join(common)} --resources '{{\"node2\": 2}}'")
        subprocess.run(["unshare", "-m", "bash", "-c", f"{hidden} && {node2}"], env=self.env, check=True,
                       capture_output=True, timeout=120)
        for _ in range(100):
            addresses = self._alive_nodes()
            if len(addresses) == 2:  # Ray gives the head the machine's address, not 127.0.0.1
                self.node1 = next(a for a in addresses if a != NODE2)
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster at {self.address} has the nodes {addresses}, expected 2")

    def _alive_nodes(self) -> list[str]:
        """The addresses of the cluster's live nodes, as Ray reports them."""
        out = subprocess.run([sys.executable, "-c", "import ray, json; ray.init(address='%s', logging_level=40); "
                              "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
                              % self.address], env=ENV, capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []

    def stop(self) -> None:
        _end_cluster([str(self.temp1), str(self.temp2)])
        for d in (self.temp1, self.temp2):
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The two-node cluster, and a tiny model directory on node 1 (node 2 sees an empty tmpfs there)."""
    from distrl.core.tiny import build_tiny_model

    c = Cluster(tmp_path_factory.mktemp("multinode"))
    build_tiny_model(c.model_dir, seed=0)  # before node 2 mounts over it: node 1's files only
    try:
        c.start()
        yield c
    finally:
        c.stop()


def distrl_train(cluster: Cluster, run_name: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(_train_args(cluster, run_name, *flags), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def _train_args(cluster: Cluster, run_name: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "distrl", "train", "--ray_address", cluster.address, "--model",
            str(cluster.model_dir), "--task", "half_vocab", "--engine", "hf", "--batch_size", "4", "--group_size", "2",
            "--max_new_tokens", "8", "--torch_threads", "1", "--no_console", "--log_dir", str(cluster.log_dir),
            "--run_name", run_name, *flags]


def test_actors_on_node2_buffer_and_learner_on_node1(cluster):
    """Acceptance 1: buffer and learner on node 1, two actors on node 2 (pinned by a Ray resource), 6
    versions: each actor loaded an early version and the final one; each role reports its node's address;
    the driver's run directory holds every role's TensorBoard events and log."""
    proc = distrl_train(cluster, "two-nodes", "--max_steps", "6", "--number_of_actors", "2",
                        "--actor_resources", '{"node2": 1}')
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    run_dir = cluster.log_dir / "two-nodes"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 6
    hosts = summary["hosts"]
    node1 = cluster.node1
    assert hosts == {"buffer0": node1, "learner0": node1, "actor0": NODE2, "actor1": NODE2}, hosts
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert f"buffer tcp://{node1}:" in driver_log and f"weights tcp://{node1}:" in driver_log  # bound there
    assert summary["authenticated"] is True and "endpoints: CURVE with this run's keys" in driver_log  # off loopback
    for role in ("buffer0", "learner0", "actor0", "actor1"):  # each got the run's keys through Ray
        assert f"{role}: CURVE on" in (run_dir / "logs" / f"{role}.log").read_text(), role
    assert json.loads((run_dir / "config.json").read_text())["weights_transport"] == "zmq"  # chosen: no shared fs
    # the learner's node (1) was probed in a Ray task there: its stand-in unsloth died, so --backend auto chose hf
    fallback = (f"distrl train: unsloth unusable on {socket.gethostname()} ({node1}) (SIGILL importing unsloth: "
                f"{sigill_hint()}); using --backend hf")
    assert proc.stderr.splitlines().count(fallback) == 1, proc.stderr[-3000:]
    assert json.loads((run_dir / "config.json").read_text())["backend"] == "hf"
    for role in ("driver", "buffer0", "learner0", "actor0", "actor1"):
        assert (run_dir / "logs" / f"{role}.log").stat().st_size > 0, role
    for role in ("learner0", "actor0", "actor1"):
        assert list((run_dir / "tb" / role).glob("events.out.tfevents.*")), role
        assert scalar_steps(run_dir, role, "learner/policy_version" if role == "learner0" else "actor/policy_version")
    for actor in ("actor0", "actor1"):
        loaded = scalar_steps(run_dir, actor, "actor/policy_version")
        # how many versions an actor loads between its calls depends on timing (the other actor may feed the
        # learner meanwhile): it once loaded only [1, 6]; it must follow the learner from an early version to the last
        assert len(loaded) >= 2 and loaded[0] < 6 and loaded[-1] == 6, (actor, loaded)
        assert "switched from policy version" in (run_dir / "logs" / f"{actor}.log").read_text()


def test_fs_transport_across_nodes_is_refused(cluster):
    """Acceptance 3: --weights_transport fs with the actors on node 2 fails before any role starts."""
    proc = distrl_train(cluster, "fs-refused", "--max_steps", "2", "--weights_transport", "fs",
                        "--actor_resources", '{"node2": 1}')
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--weights_transport: fs reads" in errors[0] and NODE2 in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (cluster.log_dir / "fs-refused").exists()  # nothing started: the corrected command can reuse the name


def test_explicit_unsloth_unusable_on_the_learners_node_is_refused(cluster):
    """--backend unsloth with the learner on node 1, whose Unsloth dies by SIGILL: exit 2 naming that node, before
    any role starts."""
    proc = distrl_train(cluster, "unsloth-refused", "--max_steps", "2", "--backend", "unsloth")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("distrl train: error: --backend: unsloth: unsloth unusable on "
                                                     f"{socket.gethostname()} ({cluster.node1}) (SIGILL"), errors
    assert "Traceback" not in proc.stderr and not (cluster.log_dir / "unsloth-refused").exists()


def test_node_loss_costs_only_its_in_flight_groups(cluster):
    """Acceptance 2 (runs last: node 2 does not come back): one actor per node (SPREAD, a CPU each), node 2's
    raylet SIGKILLed after learner version 3. Ray marks node 2 dead (~5 s: HEAD_ENV), moves its bundle to node 1 (a CPU
    free there) and restarts the actor there, which loads the model from node 1's own copy (ModelFiles.here);
    meanwhile the run goes on with the other actor (distrl.cmd.actor_runs). The run finishes; the learner's
    versions never go backwards; every acknowledged group is in the segment log exactly once and no actor's
    policy versions go backwards in it."""
    from distrl.buffer.segments import read_consumed, read_segments

    run_dir, steps = cluster.log_dir / "node-loss", 10
    proc = distrl_train_async(cluster, "node-loss", "--max_steps", str(steps), "--number_of_actors", "2",
                              "--actor_resources", '{"CPU": 1}', "--placement_strategy", "SPREAD")
    try:
        while proc.poll() is None and max([r["learner_version"] for r in _consumed(run_dir)] or [0]) < 3:
            time.sleep(0.5)
        raylets = [pid for pid in _cluster_pids([str(cluster.temp2)]) if "raylet" in _cmdline(pid)]
        assert proc.poll() is None and len(raylets) == 1, (proc.poll(), raylets)
        _lose_node(raylets[0])
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == steps
    lost = [name for name, host in summary["hosts"].items() if host == NODE2]
    assert len(lost) == 1 and lost[0].startswith("actor"), summary["hosts"]
    moved = summary["actors"][int(lost[0][len("actor"):])]  # restarted on node 1, where its bundle went
    lost_log = (run_dir / "logs" / f"{lost[0]}.log").read_text()
    assert "restarted" in lost_log, lost_log[-3000:]
    assert moved["host"] == cluster.node1 and moved["last_version"] == steps, (summary["actors"], lost_log[-3000:])
    versions = [r["learner_version"] for r in read_consumed(run_dir) if r["rank"] == 0]
    assert versions == sorted(versions) and versions[-1] == steps - 1, versions  # selections for versions 0..9
    table = read_segments(run_dir)
    groups = table.column("group_id").to_pylist()
    counts = {g: groups.count(g) for g in set(groups)}
    assert set(counts.values()) == {2}, counts  # --group_size 2: no group logged twice, none cut
    assert len(counts) == summary["buffer"]["groups_put"] == sum(a["groups"] for a in summary["actors"])
    for actor in {0, 1}:
        mine = [v for a, v in zip(table.column("actor_id").to_pylist(), table.column("policy_version").to_pylist())
                if a == actor]
        assert mine and mine == sorted(mine), (actor, mine)
    print("node loss:", lost[0], summary["actors"], file=sys.stderr)


def _consumed(run_dir: Path) -> list[dict]:
    from distrl.buffer.segments import read_consumed

    try:
        return read_consumed(run_dir)
    except ValueError:  # a line being written
        return []


def _lose_node(raylet: int) -> None:
    """Node 2 is gone, as a machine that lost power: its raylet SIGKILLed, then every process in its
    private mount namespace, again until none is left (one forked meanwhile, a worker that outlives its
    raylet for a while, would keep node 2's actor running: not a lost node)."""
    namespace = os.readlink(f"/proc/{raylet}/ns/mnt")
    assert namespace != os.readlink("/proc/self/ns/mnt"), "node 2 shares this test's mount namespace"
    os.kill(raylet, signal.SIGKILL)
    deadline = time.time() + 30
    while (left := _in_namespace(namespace)) and time.time() < deadline:
        for pid in left:
            _kill(pid)
        time.sleep(0.2)
    assert not _in_namespace(namespace), f"node 2's processes outlived SIGKILL: {left}"


def _in_namespace(namespace: str) -> list[int]:
    """Pids of the processes in the mount namespace ``namespace`` (``readlink /proc/<pid>/ns/mnt``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns" / "mnt") == namespace:
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def distrl_train_async(cluster: Cluster, run_name: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(_train_args(cluster, run_name, *flags), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def scalar_steps(run_dir: Path, role: str, tag: str) -> list[int]:
    """The steps at which ``role``'s TensorBoard events in the driver's run directory logged ``tag``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb" / role), size_guidance={"scalars": 0})
    ea.Reload()
    return sorted(e.step for e in ea.Scalars(tag)) if tag in ea.Tags()["scalars"] else []
