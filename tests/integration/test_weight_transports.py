"""Weights by version through the whole stack: separate launchers over ZMQ, and the collective transport.

`test_separate_launchers_without_shared_filesystem` starts `distrl buffer`, `distrl learn` and two
`distrl rollout` as plain processes, each in its own working directory (nothing shared but loopback
addresses), with weights downloaded from the learner's endpoint (`--weights_transport zmq`).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from tests.integration.test_train import ENV, check_run, distrl, run, scalars

ROOT = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_separate_launchers_without_shared_filesystem(tmp_path):
    buf, pub, endpoint = (f"tcp://127.0.0.1:{p}" for p in free_ports(3))
    steps = 4
    common = ["--model", "tiny", "--task", "half_vocab", "--batch_size", "4", "--group_size", "4", "--max_new_tokens",
              "8", "--number_of_actors", "2", "--run_name", "xhost", "--weights_transport", "zmq"]
    learner_only = ["--max_steps", str(steps), "--learning_rate", "1e-3", "--max_staleness", "0",
                    "--torch_threads", "1"]
    dirs = {name: tmp_path / name for name in ("buffer", "learner", "actor0", "actor1")}
    for d in dirs.values():
        d.mkdir()
    cli = [sys.executable, "-m", "distrl"]
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    procs = {"buffer": subprocess.Popen(cli + ["buffer", "--address", buf, "--run_dir", "run", "--batch_size", "4",
                                               "--group_size", "4", "--max_staleness", "0"],
                                        cwd=dirs["buffer"], env=env)}
    procs["learner"] = subprocess.Popen(cli + ["learn", *common, *learner_only, "--buffer_address", buf,
                                               "--weights_pub_bind", pub, "--weights_endpoint_bind", endpoint],
                                        cwd=dirs["learner"], env=env)
    for i in range(2):
        procs[f"actor{i}"] = subprocess.Popen(
            cli + ["rollout", *common, "--actor_id", str(i), "--buffer_address", buf, "--weights_pub", pub,
                   "--weights_endpoint", endpoint, "--engine", "hf", "--torch_threads", "1"],
            cwd=dirs[f"actor{i}"], env=env)
    try:
        for name in ("learner", "actor0", "actor1"):
            assert procs[name].wait(timeout=420) == 0, name
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    learner_run = dirs["learner"] / "runs" / "xhost"
    assert sorted(scalars(learner_run, "learner0", "learner/policy_version")) == list(range(1, steps + 1))
    served_by = []
    for i in range(2):
        actor_run = dirs[f"actor{i}"] / "runs" / "xhost"
        log = (actor_run / "logs" / f"actor{i}.log").read_text()
        served = [int(v) for v in re.findall(r"switched from policy version \d+ to (\d+)", log)]
        # on-policy: from its first version on, every announced version served; an actor whose start ran late (the
        # other one's groups made version 1) joins at the version the learner had reached
        assert served and served == list(range(served[0], steps + 1)), served
        served_by.append(set(served))
        # The payloads came over ZMQ into this actor's own cache, not from the learner's directory.
        assert list((actor_run / "weights_cache" / f"actor{i}").glob("v*"))
        assert not (actor_run / "weights").exists()
    assert set.union(*served_by) == set(range(1, steps + 1))  # each version reached an actor
    assert (dirs["buffer"] / "run" / "segments").is_dir()


@pytest.mark.parametrize("transport,engine", [("nccl", "hf"), ("shm", "vllm")])
def test_full_weights_as_tensors_are_on_policy(tmp_path, transport, engine):
    """--finetune full, max_staleness 0, weights broadcast (`nccl`: gloo on CPU) into the HF engine or copied
    through /dev/shm (`shm`) into vLLM (either engine takes either transport's tensors): what the actors recorded
    at version v equals the learner's logprobs at version v, so the weights they received are exactly the
    learner's; nothing goes through the weight directory, and `shm`'s slots are removed when the run ends."""
    run_dir = tmp_path / transport
    # only this run's slots (make test runs other files' runs beside this one under pytest-xdist): the names
    # start with a hash of the run's weight directory (distrl.weights.shm.SharedMemoryPublisher)
    ours = f"distrl-weights-{xxhash.xxh64_hexdigest(str((run_dir / 'weights').resolve()).encode())}-*"
    assert not list(Path("/dev/shm").glob(ours))
    run(distrl("--model", "tiny", "--task", "half_vocab", "--finetune", "full", "--weights_transport", transport,
               "--number_of_actors", "2", "--max_staleness", "0", "--max_steps", "4", "--batch_size", "4",
               "--group_size", "4", "--max_new_tokens", "8", "--learning_rate", "1e-4", "--engine", engine,
               "--run_name", transport),
        tmp_path)
    check_run(run_dir, versions=4, max_staleness=0, actors=2)
    mismatch = scalars(run_dir, "learner0", "learner/logprob_mismatch_max_abs")
    assert all(mismatch[step] < 1e-3 for step in range(2, 5)), mismatch
    for actor in ("actor0", "actor1"):
        assert scalars(run_dir, actor, "actor/weight_mb_fetched")[4] > 0  # bytes came through the transport
        assert "full, digest sum64:" in (run_dir / "logs" / f"{actor}.log").read_text()
    assert not list((run_dir / "weights").glob("v*"))
    assert not list(Path("/dev/shm").glob(ours))


# slow: in-flight loads are test_engines.py::test_hf_inflight_update_switches_weights_between_decode_steps and
# test_hf_fast.py::test_weight_loads_and_inflight_updates_match_the_engine_loop (tests/integration); the HF engine
# through the whole stack is test_progress_guard.py, test_terminal.py and test_multinode.py (--engine hf).
@pytest.mark.slow
def test_hf_engine_with_inflight_updates(tmp_path):
    """The HF engine through the whole stack, loading versions between decode steps (`finish`)."""
    from distrl.buffer.segments import read_segments

    run(distrl("--model", "tiny", "--task", "half_vocab", "--engine", "hf", "--inflight_update", "finish",
               "--max_staleness", "2", "--max_steps", "4", "--batch_size", "4", "--group_size", "4",
               "--max_new_tokens", "32", "--learning_rate", "1e-3", "--run_name", "inflight"), tmp_path)
    run_dir = tmp_path / "inflight"
    check_run(run_dir, versions=4, max_staleness=2, actors=1)
    rows = read_segments(run_dir).to_pylist()
    assert all(r["last_policy_version"] >= r["policy_version"] for r in rows)
    assert len(scalars(run_dir, "actor0", "actor/inflight_versions")) > 0
