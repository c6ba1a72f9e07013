"""Placement of `distrl train`'s roles by GPU resources, on a real local Ray cluster with 4 declared GPUs.

This CPU machine has no GPU, but Ray schedules by declared resources: `ray.init(num_gpus=4)` makes a
cluster with GPU ids 0-3, and each role reads the ids Ray gave it from its runtime context. One
split runs end to end (the real roles, tiny model, 2 versions); the others are placed and torn down.
`--learner_generates` and `--config` run through the real CLI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.buffer.segments import read_segments
from distrl.cmd.config import TrainConfig
from distrl.cmd.placement import default_gpus, reserve

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
       "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def ray4(tmp_path_factory):
    """A local Ray cluster that declares 4 GPUs (ids 0-3) and 2 CPUs."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp = Path("/tmp") / f"ray-placement-{os.getpid()}"  # short: Ray's socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as env:  # the workers inherit it, as distrl train's local cluster does
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        ray.init(num_gpus=4, num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
                 _temp_dir=str(temp))
        yield ray
        ray.shutdown()


def _probe_class(ray):
    @ray.remote(num_cpus=0)
    class Probe:
        def gpu_ids(self) -> list[str]:
            return list(ray.get_runtime_context().get_accelerator_ids()["GPU"])

    return Probe


def place(ray, cfg: TrainConfig) -> dict[str, list[str]]:
    """Reserve cfg's placement, start one probe per role with the role's options, return its GPU ids."""
    placement = reserve(cfg)
    probe = _probe_class(ray)
    roles = [f"learner{r}" for r in range(cfg.number_of_learners)] + [f"actor{i}" for i in range(cfg.number_of_actors)]
    probes = {role: probe.options(**placement.options(role)).remote() for role in roles}
    try:
        return {role: ray.get(p.gpu_ids.remote()) for role, p in probes.items()}
    finally:
        for p in probes.values():
            ray.kill(p)
        placement.release()


@pytest.mark.parametrize("split,actors,learners", [("3:1", 3, 1), ("2:2", 2, 2), ("1:3", 1, 3)])
def test_gpu_split_places_one_gpu_per_role(ray4, split, actors, learners, tmp_path):
    cfg = TrainConfig(gpu_split=split, batch_size=6, log_dir=str(tmp_path))
    assert (cfg.number_of_actors, cfg.number_of_learners) == (actors, learners)
    ids = place(ray4, cfg)
    assert sorted(ids) == sorted([f"actor{i}" for i in range(actors)] + [f"learner{r}" for r in range(learners)])
    assert all(len(v) == 1 for v in ids.values()), ids
    assert sorted(i for v in ids.values() for i in v) == ["0", "1", "2", "3"], ids  # distinct, all 4 used


def test_fractional_gpus_share_a_device(ray4, tmp_path):
    cfg = TrainConfig(number_of_actors=2, gpus_per_actor=0.5, gpus_per_learner=1, log_dir=str(tmp_path))
    ids = place(ray4, cfg)
    assert ids["actor0"] == ids["actor1"] and len(ids["actor0"]) == 1  # two halves of one GPU
    assert len(ids["learner0"]) == 1 and ids["learner0"] != ids["actor0"]


def test_default_gpus_per_role():
    assert default_gpus(roles=4, cluster_gpus=4) == 1.0
    assert default_gpus(roles=2, cluster_gpus=8) == 1.0
    assert default_gpus(roles=3, cluster_gpus=2) == 0.5  # ceil(3/2) = 2 roles per GPU
    assert default_gpus(roles=5, cluster_gpus=4) == 0.5
    assert default_gpus(roles=2, cluster_gpus=0) == 0.0  # no GPU: CPU roles, no placement group


def test_too_many_gpus_fails_at_once(ray4, tmp_path):
    with pytest.raises(RuntimeError, match=r"= 5 GPUs .* the Ray cluster has 4 GPUs"):
        reserve(TrainConfig(gpu_split="4:1", log_dir=str(tmp_path)))


def test_unplaceable_bundles_fail_after_the_timeout(ray4, tmp_path):
    """5 roles x 0.75 GPU = 3.75 <= 4 GPUs in total, but one GPU holds only one 0.75 bundle."""
    assert wait_for_free_gpus(ray4, polls=300) == 4.0  # the tests before: Ray frees their GPUs a while later
    cfg = TrainConfig(number_of_actors=4, gpus_per_actor=0.75, gpus_per_learner=0.75, placement_timeout_s=2,
                      log_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"not placed within --placement_timeout_s 2.*4 free"):
        reserve(cfg)
    assert wait_for_free_gpus(ray4) == 4.0  # the pending group was removed


def test_gpu_split_conflicting_counts_name_the_flags():
    with pytest.raises(ValueError, match="--gpu_split 3:1 means --number_of_actors 3, but --number_of_actors 2"):
        TrainConfig(gpu_split="3:1", number_of_actors=2)
    with pytest.raises(ValueError, match="--gpus_per_learner"):
        TrainConfig(gpu_split="3:1", gpus_per_learner=0.5)
    with pytest.raises(ValueError, match="--gpu_split must be A:L"):
        TrainConfig(gpu_split="3-1")
    assert TrainConfig(gpu_split="3:1", number_of_actors=3).number_of_learners == 1  # agreeing is fine
    with pytest.raises(ValueError, match="--number_of_actors must be >= 1"):
        TrainConfig(number_of_actors=0)


def test_split_3_1_end_to_end(ray4, tmp_path):
    """The real roles on the 4-GPU cluster: each reports the GPU id Ray gave it; 2 versions train."""
    from distrl.cmd.trainer import train

    cfg = TrainConfig(gpu_split="3:1", model="tiny", task="half_vocab", engine="hf", torch_threads=1, max_steps=2,
                      batch_size=3, group_size=2, max_new_tokens=8, log_dir=str(tmp_path), run_name="split31")
    summary = train(cfg)
    assert summary["versions"] == 2
    ids = summary["gpu_ids"]
    assert sorted(ids) == ["actor0", "actor1", "actor2", "learner0"]
    assert sorted(i for v in ids.values() for i in v) == ["0", "1", "2", "3"], ids
    assert ray4.is_initialized()  # train() used this cluster and left it running
    assert wait_for_free_gpus(ray4) == 4.0  # and gave the GPUs back (Ray frees them asynchronously)


def wait_for_free_gpus(ray, polls: int = 100) -> float:
    """Free GPUs once they stop changing or all 4 are free (Ray releases killed actors' resources soon after)."""
    import time

    for _ in range(polls):
        free = ray.available_resources().get("GPU", 0.0)
        if free == 4.0:
            break
        time.sleep(0.1)
    return free


def distrl_train(*flags: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "distrl", "train", *flags], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_learner_generates_without_actors_from_a_yaml_config(tmp_path):
    """0 actors: every group in the segment log was made by learner0 (actor_id -1, its host in the
    group id) with the learner's own model, and the versions go up. The flags come from a YAML file;
    --max_steps on the command line overrides the file's."""
    (tmp_path / "run.yaml").write_text(
        f"model: tiny\ntask: half_vocab\nnumber_of_actors: 0\nlearner_generates: true\nmax_steps: 9\n"
        f"batch_size: 2\ngroup_size: 4\nmax_new_tokens: 8\nlog_dir: {tmp_path}\nrun_name: lg\n")
    distrl_train("--config", str(tmp_path / "run.yaml"), "--max_steps", "3", cwd=ROOT)
    run_dir = tmp_path / "lg"
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["max_steps"] == 3 and saved["learner_generates"] is True and saved["config"].endswith("run.yaml")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 3 and summary["actors"] == []
    assert summary["learner_generated"][0]["groups"] == summary["buffer"]["groups_put"] >= 3 * 2
    rows = read_segments(run_dir).to_pylist()
    assert {r["actor_id"] for r in rows} == {-1}
    assert all(r["group_id"].startswith(f"learner0@{socket.gethostname()}-") for r in rows)
    versions = sorted({r["policy_version"] for r in rows})
    assert versions[:3] == [0, 1, 2], versions  # generated at each version the learner reached
    # Behavior logprobs came from the learner's own weights: the learner reproduces them (fp32, same model).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tb" / "learner0"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("learner/policy_version")] == [1, 2, 3]
    assert [e.step for e in ea.Scalars("learner/weight_publish_s")] == [3]  # no subscriber: the last version only
    assert max(e.value for e in ea.Scalars("learner/logprob_mismatch_max_abs")) < 1e-3
