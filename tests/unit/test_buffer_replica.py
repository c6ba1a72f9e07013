"""The replica of the buffer's log (issue 41, distrl.buffer.replica and distrl.buffer.mirrored), over real ZeroMQ
and real Arrow files: the replica's files are byte for byte the buffer's; a buffer whose run directory is lost
resumes from the replica with every acknowledged group, the consumption log and each actor's position; with
neither a log nor a replica, resume refuses instead of starting empty."""

from __future__ import annotations

import contextlib
import threading

import pytest

from distrl.buffer.replica import ReplicaServer
from distrl.buffer.segments import groups_by_actor, read_consumed, read_groups
from distrl.core.buffer_client import BufferClient
from distrl.core.errors import BindError
from tests.helpers import make_group, new_buffer


@contextlib.contextmanager
def serving(run_dir, **kw):
    server = new_buffer(run_dir, **kw)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def log_bytes(run_dir) -> dict[str, bytes]:
    files = sorted((run_dir / "segments").glob("segment-*.arrow")) + [run_dir / "consumed.jsonl"]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_replica_holds_the_log_byte_for_byte(tmp_path, fsync):
    replica = ReplicaServer(tmp_path / "replica", "tcp://127.0.0.1:0").start()
    try:
        # segment_max_bytes small: the log rotates, so closed segments (end-of-stream marker) are mirrored too
        with serving(tmp_path / "run", replica=replica.address, fsync=fsync, segment_max_bytes=4096) as server:
            with BufferClient(server.address, "actor0", timeout_s=5.0, retries=1) as c:
                seqs = [c.put(make_group(f"g{i}", actor_id=0)) for i in range(12)]
                c.put_many([make_group(f"m{i}", actor_id=1) for i in range(3)])
                batch = c.get(0)
        assert seqs == list(range(12)) and batch.num_rows == 4
        assert replica.error is None and replica.records > 0
    finally:
        replica.close()
    local, mirrored = log_bytes(tmp_path / "run"), log_bytes(tmp_path / "replica")
    assert len(local) >= 3 and local == mirrored  # several segments and consumed.jsonl, identical
    assert [s for s, _ in read_groups(tmp_path / "replica")] == list(range(15))
    assert groups_by_actor(tmp_path / "replica") == {0: 12, 1: 3}
    assert read_consumed(tmp_path / "replica")[0]["group_ids"] == ["g0", "g1"]


def test_a_lost_run_directory_resumes_from_the_replica(tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    replica = ReplicaServer(tmp_path / "replica", "tcp://127.0.0.1:0").start()
    try:
        with serving(run_dir, replica=replica.address) as server:
            with BufferClient(server.address, "actor0", timeout_s=5.0, retries=1) as c:
                for i in range(6):
                    c.put(make_group(f"g{i}", actor_id=i % 2))
                assert c.get(0).column("group_id").unique().to_pylist() == ["g0", "g1"]
        shutil.rmtree(run_dir)  # the buffer's node and its disk are gone
        with serving(run_dir, replica=replica.address, resume=True) as server:
            with BufferClient(server.address, "learner0", timeout_s=5.0, retries=1) as c:
                stats = c.stats()
                assert (stats["groups_put"], stats["groups"], stats["learner_version"]) == (6, 4, 0)
                assert c.get(0).column("group_id").unique().to_pylist() == ["g0", "g1"]  # the same batch again
                assert c.get(1).column("group_id").unique().to_pylist() == ["g2", "g3"]  # never g0, g1 again
                assert c.acked_groups(1) == 3  # each actor's place in its prompt stream
                assert c.put(make_group("g6")) == 6  # the log goes on where it was
        assert [s for s, _ in read_groups(run_dir)] == list(range(7))
        assert [r["learner_version"] for r in read_consumed(run_dir)] == [0, 1]
        assert log_bytes(run_dir) == log_bytes(tmp_path / "replica")  # caught up and mirrored again
    finally:
        replica.close()


def test_resume_without_log_or_replica_refuses(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="no segment log to resume from here"):
        new_buffer(tmp_path / "run", resume=True)
    replica = ReplicaServer(tmp_path / "empty-replica", "tcp://127.0.0.1:0").start()
    try:
        with pytest.raises(FileNotFoundError, match="nor in the replica at tcp://127.0.0.1:"):
            new_buffer(tmp_path / "run", resume=True, replica=replica.address)
    finally:
        replica.close()
    assert not list((tmp_path / "run").glob("segments/*"))  # nothing started, nothing written


def test_a_replica_that_cannot_bind_raises_bind_error_and_releases_its_lock(tmp_path):
    """It raised AttributeError from close() (its state was set after the bind) and kept the lock."""
    first = ReplicaServer(tmp_path / "first", "tcp://127.0.0.1:0")
    try:
        with pytest.raises(BindError, match="replica cannot bind"):
            ReplicaServer(tmp_path / "second", first.address)
        ReplicaServer(tmp_path / "second", "tcp://127.0.0.1:0").close()  # the lock was released
    finally:
        first.close()
