"""`distrl replay --sweep FLAG=V1,V2,...`: the spec's parsing and refusals (exit 2, the flag or value named,
nothing written), and the table. The replays themselves: tests/integration/test_replay.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.cmd.config import ReplayConfig
from distrl.cmd.config_offline import ReplayLossOptions
from distrl.cmd.replay_sweep import write_table
from distrl.cmd.sweep_spec import SWEEPABLE, parse_sweep, value_configs

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "data" / "run_944c626"  # a logged run (test_old_run_dir.py); only read here


def test_values_take_the_flags_types():
    assert parse_sweep("max_staleness=0,1,2,4", ReplayConfig) == ("max_staleness", ["0", "1", "2", "4"], [0, 1, 2, 4])
    assert parse_sweep("--learning_rate=1e-5, 3e-5", ReplayConfig)[2] == [1e-5, 3e-5]
    assert parse_sweep("staleness_model=recorded,restamp", ReplayConfig)[2] == ["recorded", "restamp"]
    assert parse_sweep("filter_zero_variance=True,false", ReplayConfig)[2] == [True, False]


def test_every_flag_replay_overrides_can_be_swept():
    from distrl.cmd.replay import OVERRIDES

    loss = {f.name for f in dataclasses.fields(ReplayLossOptions)}
    assert loss <= set(OVERRIDES) and set(OVERRIDES) <= set(SWEEPABLE)
    assert parse_sweep("kl_coef=0,0.1", ReplayConfig)[2] == [0.0, 0.1]
    assert parse_sweep("off_policy=none,tis", ReplayConfig)[2] == ["none", "tis"]


def test_loss_overrides_reach_the_learners_config(tmp_path):
    from distrl.cmd.replay import train_config

    cfg = ReplayConfig(source=str(SOURCE), log_dir=str(tmp_path), run_name="r", kl_coef=0.05, off_policy="tis",
                       is_cap=3.0)
    train = train_config(cfg, group_size=4)
    assert (train.kl_coef, train.off_policy, train.is_cap, train.clip_eps) == (0.05, "tis", 3.0, 0.2)  # 0.2: source's


def test_each_value_is_the_plain_replays_config(tmp_path):
    cfg = ReplayConfig(source=str(SOURCE), log_dir=str(tmp_path), run_name="sw", sweep="max_staleness=0,2",
                       learning_rate=3e-5)
    (zero, a), (two, b) = value_configs(cfg)
    plain = ReplayConfig(source=str(SOURCE), log_dir=str(tmp_path / "sw"), run_name="max_staleness-0",
                         max_staleness=0, learning_rate=3e-5, eval_size=32)
    assert (zero, two, b.max_staleness, b.out_dir) == ("0", "2", 2, tmp_path / "sw" / "max_staleness-2")
    assert a.to_flat() == plain.to_flat()


@pytest.mark.parametrize("spec,message", [
    ("max_staleness", "give FLAG=V1,V2"),
    ("nope=1,2", "distrl replay has no flag --nope"),
    ("model=a,b", "--model is not one a replay can sweep"),
    ("credit_timeout_s=1,2", "--credit_timeout_s is not one a replay can sweep"),
    ("max_staleness=", "--max_staleness needs values"),
    ("max_staleness=0,,1", "--max_staleness needs values"),
    ("max_staleness=0,0", "--max_staleness has a value twice"),
    ("max_staleness=x", "'x' is not an int"),
    ("learning_rate=nan", "'nan' is not a finite number"),
    ("learner=foo", "'foo' is not one of pg, grpo, dr_grpo"),
    ("max_staleness=0,-1", "--sweep max_staleness=-1: --max_staleness must be >= 0"),
    ("clip_eps=0.2,1.5", "--sweep clip_eps=1.5: --clip_eps must be in (0, 1)"),
    ("off_policy=tis,bogus", "'bogus' is not one of none, tis, decoupled"),
])
def test_bad_specs_are_refused_naming_the_flag(spec, message, tmp_path):
    with pytest.raises(ValueError) as exc:
        ReplayConfig(source=str(SOURCE), log_dir=str(tmp_path), run_name="sw", sweep=spec)
    assert message in str(exc.value)


def test_the_cli_exits_2_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "distrl", "replay", str(SOURCE), "--log_dir", str(tmp_path),
                           "--sweep", "model=a,b"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is not one a replay" in " ".join(done.stderr.split()), done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_table_has_a_row_per_version_and_a_column_per_value(tmp_path):
    result = {"flag": "max_staleness", "values": ["0", "1"], "eval_size": 8, "runs": {
        "0": {"heldout_versions": [0, 1], "heldout_accuracy_by_version": [0.125, 0.25]},
        "1": {"heldout_versions": [0, 1, 2], "heldout_accuracy_by_version": [0.125, 0.5, 0.75]}}}
    markdown = write_table(tmp_path, result)
    assert (tmp_path / "sweep.csv").read_text().splitlines() == [
        "version,max_staleness=0,max_staleness=1", "0,0.1250,0.1250", "1,0.2500,0.5000", "2,,0.7500"]
    assert "| 2 |  | 0.7500 |" in markdown and (tmp_path / "sweep.md").read_text() == markdown


def test_versions_evaluated_by_only_some_values_leave_blanks(tmp_path):
    """--eval_every 2: versions 0, 2 and the last (3); another value evaluated 0 and 1 only."""
    result = {"flag": "max_staleness", "values": ["0", "1"], "eval_size": 8, "runs": {
        "0": {"heldout_versions": [0, 1], "heldout_accuracy_by_version": [0.125, 0.25]},
        "1": {"heldout_versions": [0, 2, 3], "heldout_accuracy_by_version": [0.125, 0.5, 0.75]}}}
    write_table(tmp_path, result)
    assert (tmp_path / "sweep.csv").read_text().splitlines()[1:] == [
        "0,0.1250,0.1250", "1,0.2500,", "2,,0.5000", "3,,0.7500"]
