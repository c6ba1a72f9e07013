"""Preflight checks called directly (distrl/cmd/preflight.py and the role modules): each bad input raises a
PreflightError naming its flag; good inputs (the shipped data, `make demo`'s command) pass."""

from __future__ import annotations

import json
import math
import re
import shlex
import time
from pathlib import Path

import pytest
import tyro

from distrl.cmd.config import BufferConfig, EvalConfig, TrainConfig
from distrl.cmd.faults import RoleStuck, end_early, resumable
from distrl.cmd.preflight import dropped_by_resume, preflight
from distrl.core.errors import PreflightError
from distrl.core.hub import check_model, check_tokenizer, looks_like_path
from distrl.rollout.preflight import VLLM_MIN_TEMPERATURE, check_dataset, check_temperature
from tests.helpers import shared_data

QWEN_TOKENIZER = shared_data() / "tokenizers" / "qwen2.5"


def refused(flag: str, match: str, fn, *args) -> PreflightError:
    """Call fn(*args); assert it raises a PreflightError for `flag` whose problem matches `match`."""
    with pytest.raises(PreflightError) as info:
        fn(*args)
    assert info.value.flag == flag and re.search(match, info.value.problem), str(info.value)
    assert len(str(info.value).splitlines()) == 2
    return info.value


def test_path_or_hub_id():
    assert looks_like_path("/x") and looks_like_path("./x") and looks_like_path("~/x") and looks_like_path("a/b/c")
    assert not looks_like_path("Qwen/Qwen2.5-0.5B") and not looks_like_path("gpt2")


def test_model_locations(tmp_path, monkeypatch):
    refused("--model", "no such directory", check_model, "/nonexistent")
    refused("--model", "no such directory", check_model, str(tmp_path / "missing"))
    refused("--model", r"no config\.json", check_model, str(tmp_path))
    refused("--model", "neither a local directory nor a hub id", check_model, "not a repo")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    check_model(str(tmp_path))  # a GGUF directory is a model
    check_model("tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    refused("--model", "not in the local hub cache", check_model, "distrl-test/no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_model("distrl-test/no-such-model")  # online: left to the hub (never downloaded here)


def test_a_damaged_model_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text("not json")
    refused("--model", r"config.json: not a JSON object \(Expecting value", check_model, str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    refused("--model", r"config.json: not a JSON object$", check_model, str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path))


def test_tokenizer_location_and_vocabulary():
    refused("--tokenizer", "no such directory", check_tokenizer, "/nonexistent/tok")
    check_tokenizer(str(QWEN_TOKENIZER))
    cfg = TrainConfig(run_name="t", tokenizer=str(QWEN_TOKENIZER))  # the tiny model embeds 50 ids, Qwen has 151k
    refused("--tokenizer", r"has 1516\d\d tokens but the model embeds only \d+", preflight, "learn", cfg)


def test_dataset_checks(tmp_path):
    refused("--dataset", "no such file", check_dataset, None, "/nonexistent.jsonl")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1", "gold": "2"}) + "\n")
    error = refused("--dataset", r"columns \['gold', 'prompt'\] match no task", check_dataset, None, str(rows))
    assert "--task" in error.fix
    refused("--dataset", r"columns \['gold', 'prompt'\], but task gsm8k needs \['question', 'answer'\]",
            check_dataset, "gsm8k", str(rows))
    refused("--dataset", r"needs \['problem', 'answer \(or solution\)'\]", check_dataset, "math500", str(rows))
    refused("--dataset", "task arith makes its own problems and would not read", check_dataset, "arith", str(rows))
    check_dataset("arith", None)
    check_dataset(None, str(shared_data() / "math500" / "test.jsonl"))
    check_dataset("gsm8k", str(shared_data() / "gsm8k" / "test.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    refused("--dataset", "cannot be read", check_dataset, None, str(tmp_path / "bad.jsonl"))


def test_parquet_first_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "answer": ["x #### 3"]}), tmp_path / "g.parquet")
    check_dataset(None, str(tmp_path / "g.parquet"))
    refused("--dataset", "but task math500 needs", check_dataset, "math500", str(tmp_path / "g.parquet"))


def test_temperature_floor_is_vllms():
    from vllm.sampling_params import _MAX_TEMP

    assert VLLM_MIN_TEMPERATURE == _MAX_TEMP
    refused("--temperature", "below vLLM's floor of 0.01", check_temperature, "vllm", 0.005)
    refused("--eval_temperature", "below vLLM's floor of 0.01", check_temperature, "vllm", 1.0, 0.001)
    check_temperature("vllm", 0.01, 0.0)  # eval 0 is greedy
    check_temperature("hf", 0.005, 0.001)  # the HF engine samples at the configured temperature
    refused("--temperature", "below vLLM's floor", preflight, "eval", EvalConfig(model="tiny", temperature=0.005))


def test_resume_lists_the_flags_it_would_drop(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    refused("--resume", "no config.json there", preflight, "train", TrainConfig(resume=str(run)))
    (run / "config.json").write_text(TrainConfig(run_name="run", log_dir=str(tmp_path), batch_size=8).to_json())
    preflight("train", TrainConfig(resume=str(run), max_steps=20))
    preflight("train", TrainConfig(resume=str(run), batch_size=8))  # the run's own value: nothing dropped
    error = refused("--resume", "would ignore --batch_size --learning_rate", preflight, "train",
                    TrainConfig(resume=str(run), learning_rate=0.5, batch_size=16, max_steps=3))
    assert "--max_steps" not in error.problem
    assert dropped_by_resume(TrainConfig(resume=str(run), number_of_actors=1), {}) == []  # the resolved default


def test_new_run_directory_must_not_exist(tmp_path):
    (tmp_path / "taken").mkdir()
    refused("--run_name", "run directory .* exists", preflight, "train",
            TrainConfig(run_name="taken", log_dir=str(tmp_path)))


def test_buffer_run_directories(tmp_path):
    refused("--resume", "no segment log there", preflight, "buffer", BufferConfig(resume=str(tmp_path)))
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / "segment-000000.arrow").write_bytes(b"")
    preflight("buffer", BufferConfig(resume=str(tmp_path)))
    refused("--run_dir", "already holds a segment log", preflight, "buffer", BufferConfig(run_dir=str(tmp_path)))


def test_every_command_refuses_infinite_numbers_and_bad_addresses_and_ports(tmp_path):
    run = dict(log_dir=str(tmp_path))
    refused("--learning_rate", "inf is not a finite number", preflight, "train",
            TrainConfig(learning_rate=math.inf, **run))
    refused("--heartbeat_timeout_s", "inf is not a finite", preflight, "train",
            TrainConfig(heartbeat_timeout_s=1e400, **run))
    refused("--credit_timeout_s", "inf is not a finite", preflight, "buffer",
            BufferConfig(run_dir=str(tmp_path / "b"), credit_timeout_s=math.inf))
    for address in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:-1", "garbage", "tcp://", "http://127.0.0.1:5555"):
        refused("--address", "not a ZeroMQ address with a valid port", preflight, "buffer",
                BufferConfig(run_dir=str(tmp_path / "b"), address=address))
    for address in ("tcp://127.0.0.1:0", "tcp://*:5555", "tcp://[::1]:5555", "ipc:///tmp/x.sock", "tcp://host-1:65535"):
        preflight("buffer", BufferConfig(run_dir=str(tmp_path / "b"), address=address))
    refused("--weights_broadcast_port", "70000 is not a TCP port", preflight, "train",
            TrainConfig(weights_broadcast_port=70000, **run))


def test_ray_address_must_answer(tmp_path):
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again below: nothing listens there
    refused("--ray_address", "nothing answers at", preflight, "train",
            TrainConfig(ray_address=f"127.0.0.1:{port}", log_dir=str(tmp_path)))
    refused("--ray_address", "is not HOST:PORT", preflight, "train",
            TrainConfig(ray_address="x", log_dir=str(tmp_path)))
    with socket.socket() as head:  # something listening passes
        head.bind(("127.0.0.1", 0))
        head.listen()
        preflight("train", TrainConfig(ray_address=f"127.0.0.1:{head.getsockname()[1]}", model="tiny", task="arith",
                                       log_dir=str(tmp_path)))


def test_make_demo_passes_preflight(tmp_path):
    """`make demo`'s own flags (read from the Makefile) pass every train check."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    args = shlex.split(recipe.split("distrl train", 1)[1].replace("$(DEMO_LOG_DIR)", str(tmp_path)))
    cfg = tyro.cli(TrainConfig, args=args)
    assert (cfg.model, cfg.task) == ("tiny", "arith")
    preflight("train", cfg)


def test_continue_it_only_for_failures_resume_can_fix(tmp_path, capsys):
    assert resumable(RoleStuck("learner0 stuck")) and resumable(ConnectionError("lost"))
    assert not resumable(ValueError("bad prompt")) and not resumable(FileNotFoundError("x"))
    end_early(ValueError("a prompt of 130 tokens"), tmp_path, time.time(), None, None,
              can_resume=resumable(ValueError()))
    out = capsys.readouterr().out
    assert "continue it" not in out and "fix the cause" in out
    assert json.loads((tmp_path / "summary.json").read_text())["resume"] is None
    end_early(RoleStuck("learner0"), tmp_path, time.time(), None, None, can_resume=True)
    assert "continue it:   distrl train --resume" in capsys.readouterr().out
