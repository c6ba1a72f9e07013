"""`--config FILE` (YAML or TOML): the file's flags, overridden by the command line; bad files refused."""

from __future__ import annotations

import re

import pytest
import tyro

from distrl.cmd.cli import COMMANDS, SHARED_CONFIG_FILE, main
from distrl.cmd.configfile import ConfigFileError, expand_config

CONFIGS = {name: cls for name, (cls, _) in COMMANDS.items()}


def parse(argv: list[str]):
    return tyro.extras.subcommand_cli_from_dict(CONFIGS, args=expand_config(argv, CONFIGS, SHARED_CONFIG_FILE),
                                                prog="distrl", use_underscores=True)


YAML = """
max_steps: 20
learning_rate: 3.0e-4
filter_zero_variance: true
learner_generates: false
tokenizer: null
lora_target_modules: [q_proj, v_proj]
gpu_split: "3:1"
run_name: from-file
"""

TOML = """
max_steps = 20
learning_rate = 3.0e-4
filter_zero_variance = true
learner_generates = false
lora_target_modules = ["q_proj", "v_proj"]
gpu_split = "3:1"
run_name = "from-file"
"""


@pytest.mark.parametrize("name,text", [("run.yaml", YAML), ("run.toml", TOML)])
def test_file_values_and_command_line_override(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    cfg = parse(["train", "--config", str(path), "--max_steps", "5", "--no_filter_zero_variance"])
    assert cfg.max_steps == 5 and cfg.filter_zero_variance is False  # the command line wins
    assert cfg.learning_rate == 3e-4 and cfg.tokenizer is None and cfg.learner_generates is False
    assert cfg.lora_target_modules == ("q_proj", "v_proj")
    assert (cfg.number_of_actors, cfg.number_of_learners, cfg.gpus_per_actor) == (3, 1, 1.0)  # from gpu_split
    assert cfg.run_name == "from-file" and cfg.config == str(path)
    assert parse(["train", f"--config={path}"]).max_steps == 20  # the file alone


def test_unknown_key_names_key_and_file(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("max_steps = 3\nmax_step = 4\n")
    with pytest.raises(ConfigFileError, match=r"bad.toml: unknown key 'max_step'"):
        parse(["train", "--config", str(path)])
    assert main(["train", "--config", str(path)]) == 2
    assert "unknown key 'max_step'" in capsys.readouterr().err


def test_bad_files_are_refused(tmp_path):
    with pytest.raises(ConfigFileError, match="no such file"):
        parse(["train", "--config", str(tmp_path / "missing.yaml")])
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ConfigFileError, match=r"must end in \.yaml, \.yml or \.toml"):
        parse(["train", "--config", str(tmp_path / "run.json")])
    (tmp_path / "list.yaml").write_text("- max_steps\n")
    with pytest.raises(ConfigFileError, match="expected a mapping"):
        parse(["train", "--config", str(tmp_path / "list.yaml")])
    (tmp_path / "nested.yaml").write_text("max_steps:\n  a: 1\n")
    with pytest.raises(ConfigFileError, match="holds a mapping"):
        parse(["train", "--config", str(tmp_path / "nested.yaml")])
    (tmp_path / "broken.toml").write_text("max_steps = = 3\n")
    with pytest.raises(ConfigFileError, match="cannot parse"):
        parse(["train", "--config", str(tmp_path / "broken.toml")])


def test_other_commands_take_config_files(tmp_path):
    (tmp_path / "buffer.yaml").write_text(f"run_dir: {tmp_path}\nbatch_size: 8\ngroup_size: 2\n")
    cfg = parse(["buffer", "--config", str(tmp_path / "buffer.yaml"), "--group_size", "4"])
    assert (cfg.batch_size, cfg.group_size, cfg.run_dir) == (8, 4, str(tmp_path))
    (tmp_path / "rollout.toml").write_text('actor_id = 2\nbuffer_address = "tcp://10.0.0.1:5555"\n')
    cfg = parse(["rollout", "--config", str(tmp_path / "rollout.toml")])
    assert (cfg.actor_id, cfg.buffer_address) == (2, "tcp://10.0.0.1:5555")


def test_values_are_validated_like_flags(tmp_path):
    (tmp_path / "run.yaml").write_text("max_staleness: -1\n")
    with pytest.raises(SystemExit):  # tyro reports the config's ValueError naming --max_staleness
        parse(["train", "--config", str(tmp_path / "run.yaml")])


def test_a_file_shared_by_the_roles_gives_each_its_own_keys(tmp_path, capsys):
    """One file for every role (docs/multihost.md): learn, rollout and buffer leave out the keys only other
    commands take, named on one stderr line; a key no command knows is still an error; train stays strict."""
    path = tmp_path / "common.yaml"
    path.write_text("model: tiny\nbatch_size: 8\nmax_steps: 5\nmax_staleness: 0\nfsync: always\n"
                    f"run_dir: {tmp_path}\n")
    cfg = parse(["rollout", "--config", str(path)])
    assert (cfg.model, cfg.batch_size) == ("tiny", 8) and not hasattr(cfg, "max_steps")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"distrl rollout: --config {path}: ignoring 4 keys that other commands take: max_steps, "
                   "max_staleness, fsync, run_dir"]
    cfg = parse(["learn", "--config", str(path)])
    assert (cfg.max_steps, cfg.max_staleness, cfg.batch_size) == (5, 0, 8)
    assert "ignoring 2 keys that other commands take: fsync, run_dir" in capsys.readouterr().err
    cfg = parse(["buffer", "--config", str(path)])
    assert (cfg.fsync, cfg.max_staleness, cfg.run_dir) == ("always", 0, str(tmp_path))
    assert "ignoring 2 keys that other commands take: model, max_steps" in capsys.readouterr().err
    with pytest.raises(ConfigFileError, match="unknown key 'run_dir'"):  # train: every key must be its own
        parse(["train", "--config", str(path)])
    path.write_text("model: tiny\nmax_step: 5\n")
    with pytest.raises(ConfigFileError, match="unknown key 'max_step'"):
        parse(["rollout", "--config", str(path)])


@pytest.mark.parametrize("text,message", [
    ("max_steps: true", "key 'max_steps' must be an integer, got true"),  # tyro: "Missing value for --max_steps"
    ("max_steps: 2.5", "key 'max_steps' must be an integer, got 2.5"),
    ("max_steps: [1, 2]", "key 'max_steps' must be an integer, got [1, 2]"),
    ("learning_rate: fast", "key 'learning_rate' must be a number, got 'fast'"),
    ("filter_zero_variance: 1", "key 'filter_zero_variance' must be true or false, got 1"),
    ("run_name: [a, b]", "key 'run_name' must be a string, got ['a', 'b']"),
    ("learner_chunk_size: yes", "key 'learner_chunk_size' must be an integer or null, got true"),
    ("export_final: off", "key 'export_final' must be one of merged, adapter, off, got false (YAML reads unquoted "
                          "on/off/yes/no as true/false: quote it)"),
    ("lora_target_modules: [q_proj, [v_proj]]",
     "key 'lora_target_modules' must be a list of strings, got ['q_proj', ['v_proj']]"),
])
def test_a_value_of_the_wrong_type_names_file_key_and_type(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigFileError, match=f"^--config {path}: {re.escape(message)}"):
        parse(["train", "--config", str(path)])
    assert main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"distrl: error: --config {path}: {message}\n"  # one line


def test_values_that_fit_their_fields_pass(tmp_path):
    """YAML's `3e-4` (no dot) is a string: taken as the number it reads as, as typed on the command line."""
    (tmp_path / "run.yaml").write_text("learning_rate: 3e-4\nmax_steps: '7'\nlora_target_modules: q_proj\n"
                                       "learner_chunk_size: null\nrun_name: 2024\nexport_final: 'off'\n")
    cfg = parse(["train", "--config", str(tmp_path / "run.yaml")])
    assert (cfg.learning_rate, cfg.max_steps, cfg.lora_target_modules) == (3e-4, 7, ("q_proj",))
    assert (cfg.learner_chunk_size, cfg.run_name, cfg.export_final) == (None, "2024", "off")
    (tmp_path / "run.toml").write_text("max_steps = true\n")
    with pytest.raises(ConfigFileError, match="run.toml: key 'max_steps' must be an integer, got true$"):
        parse(["train", "--config", str(tmp_path / "run.toml")])
