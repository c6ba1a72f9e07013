"""Acceptance: `distrl buffer` killed with SIGKILL in the middle of a stream of PUTs from several clients,
then restarted with `--resume` on the same address. Every acknowledged group is in the log exactly once,
unacknowledged ones are re-sent by the clients (BufferClient's retries) and also end up there once,
and consumed groups are not served again."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from distrl.buffer.segments import read_groups, read_segments
from distrl.core.buffer_client import BufferClient
from tests.helpers import make_group

ROOT = Path(__file__).resolve().parents[2]
CLIENTS, GROUPS_EACH = 3, 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_buffer(run_dir: Path, address: str, resume: bool, fsync: str) -> subprocess.Popen:
    """`python -m distrl buffer` as a real process; returns once it says it is serving."""
    where = ["--resume", str(run_dir)] if resume else ["--run_dir", str(run_dir)]
    proc = subprocess.Popen([sys.executable, "-m", "distrl", "buffer", "--address", address, *where,
                             "--batch_size", "4", "--group_size", "4", "--max_staleness", "100", "--fsync", fsync],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while not lines or "distrl buffer: serving at" not in lines[-1]:
        lines.append(proc.stdout.readline())
        assert lines[-1], "buffer exited before serving:\n" + "".join(lines)
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its log
    return proc


def producer(address: str, index: int, acked: dict, errors: list, clients: list) -> None:
    """PUT GROUPS_EACH groups, recording each acknowledged seq_no: one group a PUT, except the last
    client, which PUTs two groups a message (put_many)."""
    per_put = 2 if index == CLIENTS - 1 else 1
    try:
        with BufferClient(address, f"actor{index}", timeout_s=0.5, retries=60) as c:
            clients.append(c)
            for i in range(0, GROUPS_EACH, per_put):
                ids = [f"a{index}-g{j}" for j in range(i, i + per_put)]
                acked.update(zip(ids, c.put_many([make_group(g, actor_id=index) for g in ids])))
                time.sleep(0.01)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_sigkill_mid_stream_then_resume_loses_nothing_and_duplicates_nothing(tmp_path, fsync):
    run_dir, address = tmp_path / "run", f"tcp://127.0.0.1:{free_port()}"
    first = start_buffer(run_dir, address, resume=False, fsync=fsync)
    acked: dict[str, int] = {}
    errors: list[Exception] = []
    clients: list[BufferClient] = []
    threads = [threading.Thread(target=producer, args=(address, i, acked, errors, clients)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    learner = BufferClient(address, "learner0", timeout_s=0.5, retries=60)
    while len(acked) < 8:
        time.sleep(0.005)
    batch0 = learner.get(0)  # consumed before the crash
    while len(acked) < 30:
        time.sleep(0.005)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    acked_at_kill = dict(acked)
    time.sleep(0.5)  # clients time out and re-send into the void meanwhile
    second = start_buffer(run_dir, address, resume=True, fsync=fsync)
    try:
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert len(acked_at_kill) < CLIENTS * GROUPS_EACH  # the kill really was mid-stream
        assert len(acked) == CLIENTS * GROUPS_EACH
        assert all(acked[g] == s for g, s in acked_at_kill.items())  # an ack never changes meaning
        assert sum(c.resends for c in clients) >= 1  # unacknowledged PUTs were re-sent
        # A re-sent PUT of an acknowledged group is dropped as a duplicate and answered with its seq_no.
        assert learner.put(make_group("a0-g0", actor_id=0)) == acked["a0-g0"]
        # Every acknowledged group is in the segment log exactly once, at the position of its seq_no.
        table = read_segments(run_dir)
        ids = table.column("group_id").to_pylist()
        assert table.num_rows == 4 * len(acked) and len(set(ids)) == len(acked) and set(ids) == set(acked)
        assert {g.column("group_id")[0].as_py(): seq for seq, g in read_groups(run_dir)} == acked
        stats = learner.stats()
        assert stats["groups_put"] == len(acked) and stats["duplicates"] >= 1
        # Consumed groups are not served again; a retried GET of the last version gets the same batch.
        assert learner.get(0).equals(batch0)
        batch1 = learner.get(1)
        assert not set(batch0.column("group_id").to_pylist()) & set(batch1.column("group_id").to_pylist())
        assert stats["groups"] == len(acked) - 4
        print(f"\n--fsync {fsync}: acked before SIGKILL: {len(acked_at_kill)}, acked in all: {len(acked)}, "
              f"groups in the log: {len(set(ids))}, re-sent requests: {sum(c.resends for c in clients)}, "
              f"duplicates dropped: {stats['duplicates']}, held after resume: {stats['groups']}")
        learner.shutdown()
        assert second.wait(timeout=10) == 0
    finally:
        learner.close()
        for proc in (first, second):
            if proc.poll() is None:
                proc.kill()


def learner_polls(client: BufferClient) -> bool:
    """True when the buffer holds less than a batch and learner0 sent a request in the last 0.2 s (a
    waiting learner GETs every 20 ms), checked 0.5 s apart by the caller."""
    time.sleep(0.5)
    stats = client.stats()
    return stats["groups"] < 4 and stats["last_seen_s"].get("learner0", 1e9) < 0.2


def test_learner_hears_a_restarted_buffer_within_get_resend_s_and_the_run_finishes(tmp_path):
    """Separate launchers: `distrl buffer` killed (SIGKILL, by pid) while the learner waits in its GET (the
    actor is paused meanwhile), then restarted with `--resume` on its address. The learner re-sends its GET
    every 2 s (BufferClient.get_resend_s), logs
    "buffer at ADDR answered again after N s" once, and `distrl learn` and `distrl rollout` finish
    their --max_steps and exit 0. The stall (buffer restart -> the learner's next reply) is printed."""
    from tests.integration.test_faults import TINY, TINY_ACTOR, learner_version, start, stop_group, wait_until
    from tests.integration.test_weight_transports import free_ports

    buf, pub, endpoint = (f"tcp://127.0.0.1:{p}" for p in free_ports(3))
    run_dir, learner_dir, actor_dir = tmp_path / "buffer", tmp_path / "learner" / "run", tmp_path / "actor" / "run"
    common = ["--run_name", "run", "--buffer_address", buf, "--weights_transport", "zmq"]
    buffer = ["buffer", "--address", buf, "--batch_size", "4", "--group_size", "4", "--max_staleness", "1",
              "--prefault_bytes", "0"]
    procs = {"buffer": start([*buffer, "--run_dir", str(run_dir)], tmp_path / "buffer.out")}
    procs["learner"] = start(["learn", *TINY, *common, "--max_steps", "8", "--torch_threads", "1", "--log_dir",
                              str(learner_dir.parent), "--weights_pub_bind", pub, "--weights_endpoint_bind", endpoint],
                             tmp_path / "learner.out")
    procs["actor"] = start(["rollout", *TINY_ACTOR, "--engine", "hf", "--torch_threads", "1", *common, "--log_dir",
                            str(actor_dir.parent), "--weights_pub", pub, "--weights_endpoint", endpoint],
                           tmp_path / "actor.out")
    try:
        wait_until(lambda: learner_version(learner_dir) >= 2, 300, "learner version 2", procs["learner"],
                   tmp_path / "learner.out")
        os.killpg(procs["actor"].pid, signal.SIGSTOP)  # no new groups: the learner soon waits in its GET
        with BufferClient(buf, "test", timeout_s=10) as client:
            wait_until(lambda: learner_polls(client) and learner_polls(client), 120, "the learner waiting in GET")
        os.kill(procs["buffer"].pid, signal.SIGKILL)  # with the learner's last GET: it is never answered
        assert procs["buffer"].wait(timeout=30) == -signal.SIGKILL
        at_kill = learner_version(learner_dir)
        time.sleep(3)  # the learner's GETs go unanswered meanwhile
        procs["buffer"] = start([*buffer, "--resume", str(run_dir)], tmp_path / "buffer2.out")
        os.killpg(procs["actor"].pid, signal.SIGCONT)
        assert procs["learner"].wait(timeout=300) == 0, (tmp_path / "learner.out").read_text()[-4000:]
        assert procs["actor"].wait(timeout=120) == 0, (tmp_path / "actor.out").read_text()[-4000:]
        assert learner_version(learner_dir) == 8 > at_kill
    finally:
        for p in procs.values():
            stop_group(p)
    learner_log = (learner_dir / "logs" / "learner0.log").read_text()
    (answered,) = re.findall(rf"^(\S+ \S+) distrl\.core\.buffer_client INFO buffer at {re.escape(buf)} answered "
                             rf"again after ([\d.]+) s \(GET sent (\d+) times\)$", learner_log, re.M)
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    served = re.findall(r"^(\S+ \S+) distrl\.buffer\.server INFO buffer serving at", buffer_log, re.M)
    assert len(served) == 2  # the first buffer and the restarted one
    stamp = lambda text: datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    stall = (stamp(answered[0]) - stamp(served[1])).total_seconds()
    print(f"\nbuffer killed at learner version {at_kill}; the learner's GET went unanswered {answered[1]} s "
          f"({answered[2]} sends); its next reply came {stall:.2f} s after the restarted buffer served")
    assert "no reply from buffer" not in learner_log  # under timeout_s (60 s): no warning, one info line
