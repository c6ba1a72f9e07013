"""`distrl buffer` and `distrl replay` flags: validation before anything heavy is imported, and the
options shared with `distrl train`."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.cmd.config import BufferConfig, ReplayConfig, SelectionOptions, StorageOptions, TrainConfig, buffer_options

ROOT = Path(__file__).resolve().parents[2]


def test_buffer_config_needs_a_run_directory_and_resume_sets_it(tmp_path):
    with pytest.raises(ValueError, match="--run_dir"):
        BufferConfig()
    with pytest.raises(ValueError, match="no such run directory"):
        BufferConfig(resume=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="differs from --resume"):
        BufferConfig(run_dir=str(tmp_path / "a"), resume=str(tmp_path))
    assert BufferConfig(resume=str(tmp_path)).run_dir == str(tmp_path)


@pytest.mark.parametrize("kw, match", [
    ({"topk": 5}, "--topk"), ({"batch_size": 0}, "--batch_size"), ({"max_staleness": -1}, "--max_staleness"),
    ({"replay_ratio": 0}, "--replay_ratio"), ({"max_rows": 0}, "--max_rows"), ({"retention_s": -1.0}, "--retention_s"),
    ({"fsync": "sometimes"}, "--fsync"), ({"order": "random"}, "--order"), ({"curve_secret_key": "k"}, "go together"),
    ({"prefault_bytes": -1}, "--prefault_bytes"),
])
def test_buffer_config_names_the_bad_flag(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        BufferConfig(run_dir=str(tmp_path), **kw)


def test_train_config_shares_the_buffer_options_with_the_same_names_and_defaults(tmp_path):
    shared = {f.name for cls in (SelectionOptions, StorageOptions) for f in dataclasses.fields(cls)}
    train, buf = TrainConfig(), BufferConfig(run_dir=str(tmp_path))
    assert set(buffer_options(train.selection, train.storage)) == shared
    assert set(buffer_options(buf.selection, buf.storage)) == shared
    assert buffer_options(train.selection, train.storage) == buffer_options(buf.selection, buf.storage)
    assert TrainConfig.from_json(train.to_json()).fsync == "batch"
    with pytest.raises(ValueError, match="--order"):
        TrainConfig(order="lifo")


def test_cli_refuses_bad_buffer_flags_before_importing_arrow_or_zmq(tmp_path):
    code = ("import sys\nfrom distrl.cmd.cli import main\n"
            "try:\n    main(['buffer', '--run_dir', sys.argv[1], '--topk', '9'])\n"
            "except SystemExit as e:\n    assert e.code != 0\n"
            "heavy = [m for m in ('pyarrow', 'zmq', 'torch', 'distrl.buffer.server') if m in sys.modules]\n"
            "assert not heavy, heavy\nprint('refused')")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stderr[-2000:]
    assert "--topk must be in [1, --group_size=4], got 9" in proc.stderr


def test_replay_config_takes_the_source_run_options_and_the_given_overrides(tmp_path):
    from distrl.cmd.replay import train_config

    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({**json.loads(TrainConfig(run_name="src").to_json()),
                                                    "temperature": 0.7, "batch_size": 8, "learner": "pg",
                                                    "not_a_field_any_more": 1}))
    cfg = ReplayConfig(source=str(source), run_name="rep", log_dir=str(tmp_path), batch_size=2, replay_ratio=3,
                       order="variance")
    train = train_config(cfg, group_size=4)
    assert (train.temperature, train.learner, train.batch_size, train.replay_ratio, train.order) == (
        0.7, "pg", 2, 3, "variance")
    assert (train.run_name, train.number_of_learners, train.group_size) == ("rep", 1, 4)
    with pytest.raises(ValueError, match="no such directory"):
        ReplayConfig(source=str(tmp_path / "missing"))
