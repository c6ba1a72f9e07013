"""Where compiled code is kept (distrl.core.compile_cache) and what the start-up summary says about it
(distrl.core.startup). The compile itself, twice and with a changed flag:
tests/integration/test_compile_cache_reuse.py."""

from __future__ import annotations

import json

from distrl.core import startup
from distrl.core.compile_cache import CACHE_VARIABLES, compile_counters, use_compile_caches


def test_the_caches_go_under_distrls_cache_dir_and_a_users_variable_wins(monkeypatch, tmp_path):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DISTRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/mine")
    got = use_compile_caches()
    assert got == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "compile" / "inductor"),
                   "TRITON_CACHE_DIR": "/somewhere/mine",
                   "VLLM_CACHE_ROOT": str(tmp_path / "cache" / "compile" / "vllm")}


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
