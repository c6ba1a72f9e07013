"""A run directory written by the starting commit of issue 17 (944c626) still resumes and replays.

``tests/data/run_944c626/`` is what 944c626's ``distrl train --model tiny --task arith --max_steps 3
--batch_size 4 --group_size 4 --max_new_tokens 5 --checkpoint_every 1 --no_console`` left, trimmed to what
``--resume`` and ``replay`` read (1.8 MB): ``config.json`` (944c626's flat TrainConfig), the built tiny
``model/``, the segment log and ``consumed.jsonl`` (16 groups, versions 1-3 consumed 12 of them), the
checkpoint ``ckpt/v000003`` (LoRA adapter, optimizer, scheduler, RNG) and the published ``weights/v000003``.
Left out: ``tb/``, ``logs/``, ``roles/``, ``final/``, the older checkpoints and weights, the report.
Its ``adapter_config.json`` names the base model by the path it was written at (``/tmp/oldrun/...``),
which does not exist here: the readers must not depend on it. Each test works on its own copy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.integration.test_train import ENV, ROOT, scalars

FIXTURE = ROOT / "tests" / "data" / "run_944c626"
DISTRL = str(Path(sys.executable).with_name("distrl"))


def distrl(*args: str) -> subprocess.CompletedProcess:
    """The real `distrl` command; asserts it exits 0."""
    proc = subprocess.run([DISTRL, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def copy_fixture(tmp_path: Path) -> Path:
    run_dir = tmp_path / "old"
    shutil.copytree(FIXTURE, run_dir)
    return run_dir


def test_old_run_dir_resumes_from_its_checkpoint(tmp_path):
    """`distrl train --resume` continues the 944c626 run from its checkpoint v3 to version 5."""
    run_dir = copy_fixture(tmp_path)
    proc = distrl("train", "--resume", str(run_dir), "--max_steps", "5")
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 5
    assert sorted(scalars(run_dir, "learner0", "learner/policy_version")) == [4, 5]  # only the new versions
    learner_log = (run_dir / "logs" / "learner0.log").read_text()
    assert f"resumed from {run_dir / 'ckpt' / 'v000003'} at version 3" in learner_log
    buffer_log = (run_dir / "logs" / "buffer0.log").read_text()
    assert "'groups': 16, 'held': 4, 'consumed': 12" in buffer_log  # the old segment and consumption logs
    assert (run_dir / "ckpt" / "v000005" / "state.json").is_file()
    # it stored "unsloth", the default then: resumed as --backend auto, settled by the probe on this host
    settled = json.loads((run_dir / "config.json").read_text())["backend"]
    fell_back = "unsloth unusable on" in proc.stderr
    assert settled == ("hf" if fell_back else "unsloth"), (settled, proc.stderr[-2000:])


def test_resume_of_a_finished_run_starts_nothing_and_changes_no_file(tmp_path):
    """The run finished at version 3: `--resume` with --max_steps 2 (or 3) says so, exits 0, writes nothing."""
    run_dir = copy_fixture(tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}
    for max_steps in ("2", "3"):
        proc = distrl("train", "--resume", str(run_dir), "--max_steps", max_steps)
        assert proc.stdout.strip() == (f"distrl train: nothing to do: run finished at version 3 (--max_steps "
                                       f"{max_steps}); pass a larger --max_steps to train on"), proc.stdout
        assert "run directory" not in proc.stderr  # nothing started
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_old_run_dir_replays(tmp_path):
    """`distrl replay` trains a learner on the 944c626 run's 16 logged groups: 4 versions of 4 groups, with
    the staleness the run recorded (the first version fresh, then one behind)."""
    source = copy_fixture(tmp_path)
    proc = distrl("replay", str(source), "--log_dir", str(tmp_path), "--run_name", "replayed")
    assert "distrl replay: 4 versions from 16 logged groups" in proc.stdout
    summary = json.loads((tmp_path / "replayed" / "summary.json").read_text())
    assert summary["versions"] == 4 and summary["log_groups"] == 16
    assert summary["staleness_max_by_version"] == [0, 1, 1, 1]
    assert summary["model"] == str(source / "model")  # the tiny model the old run built, not a new one
    # the source stored "unsloth": settled again on this host by its probe, as a resume does
    assert json.loads((tmp_path / "replayed" / "config.json").read_text())["backend"] in ("unsloth", "hf")


def test_resume_of_a_finished_run_finds_nothing_to_do_before_ray(tmp_path, monkeypatch):
    """In process: `train` answers "nothing to do" without ray.init (made to fail here) or a run directory write."""
    import ray

    from distrl.cmd.config import TrainConfig
    from distrl.cmd.trainer import train

    def no_ray(*args, **kwargs):
        raise AssertionError("ray.init called for a run with nothing to do")

    monkeypatch.setattr(ray, "init", no_ray)
    run_dir = copy_fixture(tmp_path)
    summary = train(TrainConfig(resume=str(run_dir), max_steps=3))
    assert summary == {"run_dir": str(run_dir.resolve()), "versions": 3, "nothing_to_do": True}
    assert not ray.is_initialized()
