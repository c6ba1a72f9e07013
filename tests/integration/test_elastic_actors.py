"""Elastic actors (issue 21): in one `distrl train` run an actor joins with `distrl rollout --join` at version k
and another leaves (SIGTERM) at version m; versions go on, the joiner's groups are trained on, the credits
never exceed AReaL's rule over the changing set (the buffer's counters), and the leaver's unused credits
return at once.

The run: `distrl train` with one Ray actor (actor0) on the tiny model, every actor on the HF engine; actor A joins
at the start (actor1), B (actor2) once the learners reached version k, both with `--torch_threads 1` (a host-local
flag overrides the run's); A gets SIGTERM once B's groups arrive, while it holds credits (mid-generation). The
numbers are printed (`pytest -s`). `--max_staleness 128`: actor0 may feed the learner so fast that a joiner's
groups (a busy 2-core machine) would be stale by the time they arrive at a small bound (at 32, with actor0 on vLLM,
CI once saw B start generating at version 125, having joined at 3, and every group it PUT evicted as stale); the
run then waits until some of B's groups were trained on before B leaves.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from distrl.buffer.segments import lineage
from distrl.core.buffer_client import BufferClient
from tests.integration.test_faults import TINY, learner_version, start, stop_group, wait_until

K = 1  # B joins once the learners reached this version
MORE = 3  # versions the run must make after A left


def joined_id(log: Path) -> int | None:
    """The actor id a `distrl rollout --join` process printed, or None yet."""
    found = re.search(r"joined the run at \S+ as actor(\d+)", log.read_text()) if log.exists() else None
    return int(found.group(1)) if found else None


def trained_rows(run_dir: Path, actor_id: int) -> int:
    """Completions of ``actor_id`` that a learner version trained on so far (0 while a log line is half written)."""
    try:
        rows = lineage(run_dir).to_pylist()
    except (ValueError, OSError):
        return 0
    return sum(1 for r in rows if r["actor_id"] == actor_id and r["trained_versions"])


def test_an_actor_joins_and_another_leaves(tmp_path):
    run_dir = tmp_path / "elastic"
    logs = {name: tmp_path / f"{name}.out" for name in ("train", "a", "b")}
    train = start(["train", *TINY, "--engine", "hf", "--max_steps", "2000", "--max_staleness", "128", "--no_console",
                   "--run_name", run_dir.name, "--log_dir", str(tmp_path)], logs["train"])
    procs = {"train": train}
    try:
        wait_until(lambda: (run_dir / "join.json").exists(), 180, "the join file", train, logs["train"])
        assert (run_dir / "join.json").stat().st_mode & 0o777 == 0o600
        address = json.loads((run_dir / "join.json").read_text())["config"]["buffer_address"]
        procs["a"] = start(["rollout", "--join", str(run_dir), "--torch_threads", "1"], logs["a"])
        a_id = wait_until(lambda: joined_id(logs["a"]), 120, "A to join", procs["a"], logs["a"])
        wait_until(lambda: learner_version(run_dir) >= K, 180, f"version {K}", train, logs["train"])
        k = learner_version(run_dir)
        procs["b"] = start(["rollout", "--join", str(run_dir / "join.json"), "--torch_threads", "1"], logs["b"])
        with BufferClient(address, "test", timeout_s=10) as client:
            b_id = wait_until(lambda: joined_id(logs["b"]), 120, "B to join", procs["b"], logs["b"])
            wait_until(lambda: client.acked_groups(b_id) > 0, 120, "B's first group", procs["b"], logs["b"])
            wait_until(lambda: client.stats()["owed"].get(f"actor{a_id}"), 60, "A holding credits", procs["a"])
            m = learner_version(run_dir)
            procs["a"].send_signal(signal.SIGTERM)
            assert procs["a"].wait(timeout=60) == 128 + signal.SIGTERM
            left = client.stats()
            wait_until(lambda: learner_version(run_dir) >= m + MORE, 180, f"version {m + MORE}", train, logs["train"])
            wait_until(lambda: trained_rows(run_dir, b_id), 180, "B's groups trained on", procs["b"], logs["b"])
            procs["b"].send_signal(signal.SIGTERM)
            assert procs["b"].wait(timeout=60) == 128 + signal.SIGTERM
            end = client.stats()
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=120)
    finally:
        for proc in procs.values():
            stop_group(proc)

    a_log = (run_dir / "logs" / f"actor{a_id}.log").read_text()
    returned = int(re.search(r"left the run; the buffer returned (\d+) unused credits", a_log).group(1))
    rows = lineage(run_dir).to_pylist()
    b_rows = [r for r in rows if r["actor_id"] == b_id]
    b_trained = [r for r in b_rows if r["trained_versions"]]
    print(f"\nB (actor{b_id}) joined at version {k}; A (actor{a_id}) left at version {m}; the run reached "
          f"{end['learner_version']}; A's unused credits returned on LEAVE: {returned}; credits granted "
          f"{end['credits_granted']}, refunded {end['credits_refunded']}, allowed {end['credits_allowed']}, "
          f"groups put {end['groups_put']}; credit_violations {end['credit_violations']}, credit_excess_max "
          f"{end['credit_excess_max']}; B's completions {len(b_rows)}, trained {len(b_trained)}, first policy "
          f"version {min(r['policy_version'] for r in b_rows)}")
    assert a_id != b_id and a_id >= 1 and b_id >= 1  # fresh ids, above the launcher's actor0
    assert json.loads((run_dir / f"config.actor{b_id}.json").read_text())["torch_threads"] == 1  # host-local
    assert json.loads((run_dir / "config.json").read_text())["torch_threads"] is None
    assert left["left"] >= 1 and f"actor{a_id}" not in left["owed"]
    # A's LEAVE gave back what it held unused (none when its SIGTERM came as its last credits were in flight, which
    # a loaded machine showed once: the return itself is tests/unit/test_elastic_credits.py's)
    assert left["credits_returned_on_leave"] >= returned >= 0
    assert end["learner_version"] >= m + MORE  # versions went on without A
    assert b_trained and min(r["policy_version"] for r in b_rows) >= k - 1  # B started from a current version
    assert end["credit_violations"] == 0 and end["credit_excess_max"] <= 0
    assert end["credits_granted"] - end["credits_refunded"] <= end["credits_allowed"]
    assert end["lost"] == 0  # nobody was taken for dead
