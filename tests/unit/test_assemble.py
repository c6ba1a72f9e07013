"""distrl.cmd.assemble: `--model tiny` resolved in one place; what a builder opened is closed, the last
opened first, each part even when another's close raises, and also when the builder itself fails."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import zmq

from distrl.cmd.assemble import AssembledLearner, _Parts, build_learner, resolve_model
from distrl.cmd.config import TrainConfig


def test_resolve_model_builds_tiny_once_and_passes_anything_else_through(tmp_path):
    assert resolve_model("Qwen/Qwen2.5-0.5B", tmp_path, seed=0) == "Qwen/Qwen2.5-0.5B"
    assert resolve_model("/some/dir", tmp_path) == "/some/dir"
    assert resolve_model("tiny", tmp_path) == str(tmp_path / "model")  # no seed: the path only
    assert not (tmp_path / "model").exists()
    built = resolve_model("tiny", tmp_path, seed=0)
    assert built == str(tmp_path / "model") and (Path(built) / "config.json").is_file()


class Part:
    """A part that records its close in ``log`` (and raises if ``fails``)."""

    def __init__(self, name: str, log: list, fails: bool = False):
        self.name, self.log, self.fails = name, log, fails

    def close(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} failed to close")


def test_parts_close_last_opened_first_and_every_part_even_when_one_raises():
    log = []
    parts = _Parts()
    for name, fails in (("publisher", False), ("learner", True), ("generator", False)):
        parts.opened(Part(name, log, fails))
    with pytest.raises(RuntimeError, match="learner failed to close"):
        parts.close()
    assert log == ["generator", "learner", "publisher"]


def test_unfinished_learner_closes_without_lingering():
    """A run that did not finish (an error) closes at once: no wait for actors that will not come."""
    log = []
    parts = AssembledLearner(rank=0, actors=2)
    parts.publisher = parts.opened(Part("publisher", log))  # a linger() call would raise AttributeError
    parts.close()
    assert log == ["publisher"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_builder_that_fails_closes_what_it_opened(tmp_path):
    """The Learner cannot load its model: the weight endpoints rank 0 bound before are released."""
    pub, latest = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    cfg = TrainConfig(model="tiny", backend="hf", dtype="float32", weights_transport="fs")
    with pytest.raises(OSError):
        build_learner(cfg, 0, 1, tmp_path, str(tmp_path / "no-model"), "tcp://127.0.0.1:9",
                      weights_bind=(pub, latest))
    for address in (pub, latest):  # bindable again: the builder closed its sockets
        assert _bindable_soon(address), address


def _bindable_soon(address: str, tries: int = 100) -> bool:
    """Whether a socket can bind ``address`` within ``tries`` attempts 50 ms apart (ZeroMQ's I/O thread
    unbinds a closed socket's port shortly after ``close`` returns; a port still held is never freed)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    try:
        for _ in range(tries):
            try:
                sock.bind(address)
                return True
            except zmq.ZMQError:
                time.sleep(0.05)
        return False
    finally:
        sock.close()


def test_replay_builds_a_plain_learner_whatever_the_source_run_was(tmp_path):
    """A source run with an nccl broadcast, --learner_generates and --resume: the replay's learner has no
    actors to broadcast to, no generator and nothing to resume (distrl.cmd.replay.train_config)."""
    import json

    from distrl.cmd.config import ReplayConfig
    from distrl.cmd.replay import train_config

    source = tmp_path / "src"
    source.mkdir()
    saved = TrainConfig(run_name="src", weights_transport="nccl", finetune="full", learner_generates=True,
                        resume=str(source))
    (source / "config.json").write_text(saved.to_json())
    train = train_config(ReplayConfig(source=str(source), run_name="rep", log_dir=str(tmp_path)), group_size=8)
    assert (train.weights_transport, train.learner_generates, train.resume, train.finetune) == ("fs", False, None,
                                                                                                 "full")
    assert json.loads(train.to_json())["weights_transport"] == "fs"
