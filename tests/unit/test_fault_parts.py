"""Pure parts of fault handling: which roles are quiet, role files, rolling back the consumption log."""

from __future__ import annotations

import json
import os
import signal

import pytest

from distrl.buffer.recovery import roll_back_consumed
from distrl.buffer.segments import read_consumed
from distrl.cmd.faults import (
    Interrupted,
    as_interrupted,
    quiet_roles,
    raise_on_signals,
    read_role_file,
    write_role_file,
)


def test_quiet_roles_skips_unseen_and_restarted_roles():
    now = 1000.0
    last_seen = {"actor0": 2.0, "actor1": 50.0, "learner0": 61.0, "actor2": 70.0}
    started = {"actor2": now - 10.0}  # restarted 10 s ago, last request 70 s ago: still loading
    quiet = quiet_roles(last_seen, ["actor0", "actor1", "learner0", "actor2", "actor3"], started, now, 60.0)
    assert quiet == [("learner0", 61.0)]  # actor3 never seen: still starting
    assert quiet_roles(last_seen, ["actor1"], {}, now, 49.0) == [("actor1", 50.0)]


def test_role_file_round_trip(tmp_path):
    assert read_role_file(tmp_path, "actor0") is None
    info = write_role_file(tmp_path, "actor0")
    assert read_role_file(tmp_path, "actor0") == info and info["pid"] == os.getpid()
    assert [p.name for p in (tmp_path / "roles").iterdir()] == ["actor0.json"]  # no temp file left


def test_first_signal_raises_interrupted_later_ones_are_ignored():
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        raise_on_signals()
        with pytest.raises(Interrupted) as exc:
            os.kill(os.getpid(), signal.SIGTERM)
        assert exc.value.signum == signal.SIGTERM and str(exc.value) == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # ignored now: the cleanup is not cut short
        assert as_interrupted(KeyboardInterrupt()).signum == signal.SIGTERM  # what Ray hands back
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_roll_back_consumed_keeps_versions_up_to_the_checkpoint(tmp_path):
    records = [{"learner_version": v, "rank": 0, "world_size": 1, "group_ids": [f"g{v}"], "sample_ids": [],
                "policy_versions": [], "time": 0.0} for v in range(5)]
    (tmp_path / "consumed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert roll_back_consumed(tmp_path, 4) == 0
    assert roll_back_consumed(tmp_path, 2) == 2
    assert [r["learner_version"] for r in read_consumed(tmp_path)] == [0, 1, 2]
    dropped = [json.loads(x) for x in (tmp_path / "consumed.rolled_back.jsonl").read_text().splitlines()]
    assert [r["group_ids"] for r in dropped] == [["g3"], ["g4"]]


def test_unused_credits_come_back_when_the_same_sender_asks_again(tmp_path):
    """An actor PUTs its whole grant before asking again; a restarted one asks with its grant unused."""
    from distrl.core.buffer_client import BufferClient
    from tests.helpers import make_group
    from tests.unit.test_buffer_server import serving

    with serving(tmp_path, batch_size=2, max_staleness=0) as server:  # at most 2 groups in play at version 0
        with BufferClient(server.address, "actor0", timeout_s=5.0) as dead, \
                BufferClient(server.address, "actor1", timeout_s=5.0) as other:
            assert dead.credits(2)["granted"] == 2  # ... and the process dies before PUTting
            assert other.credits(2)["granted"] == 0
        with BufferClient(server.address, "actor0", timeout_s=5.0) as again:  # the restarted actor0
            assert again.credits(2)["granted"] == 2
            again.put_many([make_group("g0"), make_group("g1")])
            assert again.credits(2)["granted"] == 0  # a used grant is not returned
            stats = again.stats()
        assert stats["credits_granted"] - stats["credits_refunded"] == 2
        assert set(stats["last_seen_s"]) == {"actor0", "actor1"} and max(stats["last_seen_s"].values()) < 5


def test_resume_version_rolls_back_later_selections_and_serves_their_groups_again(tmp_path):
    """A learner killed at version 3 resumes from its checkpoint of version 1: the buffer hands out the
    same batch for version 1 again, and version 2 gets a new selection from the rolled-back groups."""
    from distrl.core.buffer_client import BufferClient
    from tests.helpers import make_group
    from tests.unit.test_buffer_server import serving

    ids = lambda table: sorted(set(table.column("group_id").to_pylist()))  # noqa: E731
    with serving(tmp_path, batch_size=2, max_staleness=100) as server:
        with BufferClient(server.address, "learner0", timeout_s=5.0) as c:
            c.put_many([make_group(f"g{i}") for i in range(8)])
            batches = [ids(c.get(v)) for v in range(3)]  # versions 0, 1, 2 handed out
    with serving(tmp_path, batch_size=2, max_staleness=100, resume=True, resume_version=1) as server:
        with BufferClient(server.address, "learner0", timeout_s=5.0) as c:
            assert ids(c.get(1)) == batches[1]  # the checkpoint's batch, again (without the roll-back:
            # ValueError "version 1 is not newer than version 2")
            again = ids(c.get(2))
    assert [r["learner_version"] for r in read_consumed(tmp_path)] == [0, 1, 2]
    assert set(again) <= {f"g{i}" for i in range(8)} - set(batches[0]) - set(batches[1])
    assert len(again) == 2
    rolled_back = (tmp_path / "consumed.rolled_back.jsonl").read_text().splitlines()
    assert [json.loads(x)["learner_version"] for x in rolled_back] == [2]
