"""Where compiled code is kept (distrl.core.compile_cache) and what the start-up summary says about it
(distrl.core.startup). The compile itself, twice and with a changed flag:
tests/integration/test_compile_cache_reuse.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from distrl.core import startup
from distrl.core.compile_cache import CACHE_VARIABLES, compile_counters, use_compile_caches


def test_the_caches_go_under_distrls_cache_dir_and_a_users_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # bytecode: the tests below
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DISTRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/mine")
    got = use_compile_caches()
    assert got == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "compile" / "inductor"),
                   "TRITON_CACHE_DIR": "/somewhere/mine",
                   "VLLM_CACHE_ROOT": str(tmp_path / "cache" / "compile" / "vllm")}


CHILD = """
import json, os, sys
from distrl.core.compile_cache import use_bytecode_cache
done = use_bytecode_cache(sys.argv[1], "pkg")
import pkg.mod
print(json.dumps({"done": done, "prefix": sys.pycache_prefix, "env": os.environ.get("PYTHONPYCACHEPREFIX"),
                  "dont_write": os.environ.get("PYTHONDONTWRITEBYTECODE"), "value": pkg.mod.VALUE}))
"""


def _child(tmp_path: Path, **env) -> dict:
    """A Python child importing ``pkg.mod`` (under tmp_path/site) after use_bytecode_cache(tmp_path/prefix)."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(Path(__file__).parents[2])]),
            **env}
    full = {k: v for k, v in full.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "prefix")], env=full, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def _package(tmp_path: Path) -> Path:
    site = tmp_path / "site" / "pkg"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "mod.py").write_text("VALUE = 42\n")
    return site


def test_bytecode_goes_to_the_cache_where_the_environment_forbids_it_and_the_install_has_none(tmp_path):
    site = _package(tmp_path)
    got = _child(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=None)
    assert got == {"done": True, "prefix": str(tmp_path / "prefix"), "env": str(tmp_path / "prefix"),
                   "dont_write": None, "value": 42}
    cached = [p.name for p in (tmp_path / "prefix").rglob("*.pyc") if "pkg" in p.parts]
    assert sorted(cached) == sorted(f"{m}.{sys.implementation.cache_tag}.pyc" for m in ("__init__", "mod"))
    assert not (site / "__pycache__").exists()  # never beside the installed sources
    again = _child(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=None)
    assert again["done"] and again["value"] == 42


def test_bytecode_settings_are_left_alone_where_writes_are_allowed_the_install_has_it_or_the_user_chose(tmp_path):
    site = _package(tmp_path)
    assert not _child(tmp_path, PYTHONDONTWRITEBYTECODE=None, PYTHONPYCACHEPREFIX=None)["done"]  # writes allowed
    mine = _child(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "mine"))
    assert not mine["done"] and mine["prefix"] == str(tmp_path / "mine")  # the user's prefix wins
    import py_compile

    py_compile.compile(str(site / "__init__.py"), cfile=str(site / "__pycache__" /
                                                              f"__init__.{sys.implementation.cache_tag}.pyc"))
    installed = _child(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=None)
    assert installed["done"] is False and installed["dont_write"] == "1"  # the install has its bytecode


def test_compile_counters_count_a_compiled_function():
    import torch

    before = compile_counters()
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    after = compile_counters()
    assert after["frames_compiled"] == before.get("frames_compiled", 0) + 1  # {} before Dynamo's first import
    assert set(after) == {"fxgraph_cache_hit", "fxgraph_cache_miss", "frames_compiled"}


def test_the_summary_counts_frames_compiled_after_each_roles_warm_up(tmp_path):
    lines = [{"role": "driver", "phase": "launch", "t": 100.0},
             {"role": "learner0", "phase": "first_version", "t": 130.0, "compile": {"frames_compiled": 6}},
             {"role": "learner0", "phase": "finished", "t": 190.0, "compile": {"frames_compiled": 8}},
             {"role": "actor0", "phase": "engine_warm", "t": 120.0, "compile": {"frames_compiled": 3}},
             {"role": "actor0", "phase": "finished", "t": 191.0, "compile": {"frames_compiled": 3}}]
    (tmp_path / "logs").mkdir()
    (tmp_path / startup.FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = startup.startup_summary(tmp_path)
    assert summary["recompiles_after_warmup"] == 2
    assert summary["compile"]["learner0"]["finished"] == {"frames_compiled": 8}
    assert summary["marks_s"]["learner0"]["first_version"] == 30.0


def test_a_run_without_finished_marks_has_no_recompile_count(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / startup.FILE).write_text(json.dumps({"role": "driver", "phase": "launch", "t": 1.0}) + "\n")
    assert startup.startup_summary(tmp_path)["recompiles_after_warmup"] is None
