"""The join file (issue 21): what `distrl train` writes, what `distrl rollout --join` makes of it (options left
at their default come from the run, host-local flags win, what cannot be joined is refused naming the flag to
pass), and the run's CURVE keys it carries, over a real authenticated buffer socket."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import tyro

from distrl.cmd.cli import COMMANDS
from distrl.cmd.compose import flat_fields
from distrl.cmd.config import RolloutConfig, TrainConfig
from distrl.cmd.join import expand_join, join_keys, train_join_info
from distrl.core.buffer_client import BufferClient
from distrl.core.join import read_join_file, write_join_file
from distrl.core.security import RunKeys, use_run_keys
from tests.unit.test_buffer_server import serving

ENDPOINTS = SimpleNamespace(buffer="tcp://127.0.0.1:7001", weights_pub="tcp://127.0.0.1:7002",
                            weights_latest="tcp://127.0.0.1:7003")
FLAGS = [f.name for f in flat_fields(RolloutConfig)]


def rollout(*flags: str) -> RolloutConfig:
    """`distrl rollout FLAGS` parsed as the command parses it (the join file's options expanded first)."""
    argv = expand_join(["rollout", *flags], RolloutConfig)
    return tyro.extras.subcommand_cli_from_dict({name: cls for name, (cls, _) in COMMANDS.items()}, args=argv,
                                                prog="distrl", use_underscores=True)


def train_run(tmp_path: Path, keys=None, **flags) -> Path:
    """A run directory holding the join file of a `distrl train` with ``flags``."""
    cfg = TrainConfig(run_name="run", log_dir=str(tmp_path), task="half_vocab", max_new_tokens=8, temperature=0.7,
                      engine="hf", **flags)
    cfg.run_dir.mkdir(parents=True)
    write_join_file(cfg.run_dir, train_join_info(cfg, cfg.run_dir, cfg.model, ENDPOINTS, keys, FLAGS))
    return cfg.run_dir


def test_a_joining_actor_takes_the_runs_options_and_keeps_its_own(tmp_path):
    run_dir = train_run(tmp_path)
    assert (run_dir / "join.json").stat().st_mode & 0o777 == 0o600
    cfg = rollout("--join", str(run_dir), "--max_new_tokens", "16")
    assert (cfg.buffer_address, cfg.weights_pub, cfg.weights_endpoint) == ("tcp://127.0.0.1:7001",
                                                                           "tcp://127.0.0.1:7002",
                                                                           "tcp://127.0.0.1:7003")
    assert (cfg.task, cfg.temperature, cfg.model, cfg.weights_transport) == ("half_vocab", 0.7, "tiny", "fs")
    assert (cfg.engine, cfg.max_new_tokens) == ("hf", 16)  # the run's engine; the command line's length
    assert cfg.run_dir == run_dir and cfg.join == str(run_dir / "join.json")  # the run's directory, here
    assert rollout("--engine", "vllm", "--join", str(run_dir / "join.json")).engine == "vllm"  # even a default wins


def refused(capsys, *flags: str) -> str:
    """What `distrl rollout FLAGS` says when it refuses them (one line, the box's borders dropped)."""
    with pytest.raises(SystemExit):
        rollout(*flags)
    return " ".join(line.strip("│ ") for line in capsys.readouterr().err.splitlines())


def test_what_cannot_be_joined_is_refused_naming_the_flag(tmp_path, capsys):
    assert "no join.json there" in refused(capsys, "--join", str(tmp_path))
    info = read_join_file(train_run(tmp_path))
    info["config"].update(model="/nowhere/models/qwen", weights_transport="zmq")
    write_join_file(tmp_path, info)
    assert "is not on this host (no shared filesystem): pass --model" in refused(capsys, "--join", str(tmp_path))
    assert rollout("--join", str(tmp_path), "--model", "tiny").model == "tiny"
    info["config"].update(model="tiny", weights_transport="nccl")
    write_join_file(tmp_path, info)
    assert "weights travel by nccl" in refused(capsys, "--join", str(tmp_path))


def test_the_join_files_keys_open_the_runs_buffer(tmp_path):
    keys = RunKeys.make()
    run_dir = train_run(tmp_path, keys)
    assert json.loads((run_dir / "join.json").read_text())["keys"]["client"][1] == keys.client[1].decode()
    use_run_keys(keys)  # the buffer's side, as the driver keys its roles
    try:
        with serving(tmp_path / "buffer") as server:
            use_run_keys(join_keys(str(run_dir)))  # the joining actor's side: public keys and the client pair
            with BufferClient(server.address, "joiner", timeout_s=5.0, retries=0) as client:
                assert client.join(first_id=1) == 1
            use_run_keys(None)
            with BufferClient(server.address, "stranger", timeout_s=1.0, retries=0) as client:
                with pytest.raises(TimeoutError):
                    client.join()
    finally:
        use_run_keys(None)
