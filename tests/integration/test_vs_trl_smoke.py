"""`python -m bench.vs_trl smoke`: the GPU benchmark's distrl side (a `distrl train` run read back from
TensorBoard into completions/s and tokens/s) on CPU with the tiny model; the summary's ratios on given sides.

Checks what the script wrote and printed is well formed and self-consistent; never how fast anything was.
TRL 1.15's GRPOTrainer needs triton (its fused logprob kernel), which the CPU stack lacks: its side runs on
the GPU machine only."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from tests.integration.test_train import ENV, ROOT


def test_smoke_times_the_distrl_side(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "smoke", "--out", str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "fixed.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary  # the last line: the same JSON
    distrl = summary["sides"][0]
    assert distrl["side"] == "distrl" and distrl["how"] == "exited 0" and distrl["steps"] == 2
    # 1 warm-up + 2 timed versions + the last one (it writes the final checkpoint: outside the window)
    assert "--task half_vocab" in distrl["command"] and "--max_steps 4" in distrl["command"]
    # 2 versions x 4 prompts x 2 completions
    wall = distrl["wall_s"]  # rounded to 1 ms: at ~50 ms that alone moves 16 / wall by 1 %
    assert 0.999 * 16 / (wall + 5e-4) <= distrl["completions_per_s"] <= 1.001 * 16 / max(wall - 5e-4, 1e-6)
    # at most 5 tokens each: the random tiny model (52 ids since the calculator's < and >) may sample EOS earlier
    assert 1.0 <= distrl["mean_completion_tokens"] <= 5.0
    # nothing is compiled on CPU: no recompile (TORCH_LOGS=recompiles is read from the side's logs)
    assert distrl["recompiles_after_warmup"] == 0 and distrl["recompiles"] == 0 and distrl["startup_s"] > 0
    assert math.isclose(distrl["tokens_per_s"], distrl["mean_completion_tokens"] * distrl["completions_per_s"],
                        rel_tol=0.01)
    phases = distrl["startup_phases_s"]  # summary.json's startup (distrl.core.startup)
    assert 0 < phases["learner_model_load"] < phases["launch_to_first_version"] <= distrl["startup_s"] + 5
    parts = ("actor_imports_and_task", "actor_engine_imports", "actor_engine_build")  # actor_engine_init's three
    assert all(phases[p] >= 0 for p in parts)
    assert math.isclose(sum(phases[p] for p in parts), phases["actor_engine_init"], abs_tol=0.02)
    if importlib.util.find_spec("triton") is None:
        assert len(summary["sides"]) == 1 and summary["vs_trl"] is None and summary["trl_best"] is None
    assert "distrl / fastest TRL" in proc.stdout


def test_summary_divides_by_the_fastest_trl_variant():
    from bench.vs_trl import summarize

    sides = [{"side": "distrl", "completions_per_s": 90.0, "tokens_per_s": 9000.0},
             {"side": "trl:hf", "completions_per_s": 30.0, "tokens_per_s": 3000.0},
             {"side": "trl:continuous", "completions_per_s": 45.0, "tokens_per_s": 4000.0},
             {"side": "trl:static", "how": "exited 1"}]
    summary = summarize("variable", sides)
    assert summary["trl_best"] == "trl:continuous" and summary["vs_trl"] == 2.0 and summary["vs_trl_tokens"] == 2.25
    assert summarize("fixed", sides[1:])["vs_trl"] is None  # no distrl window: no ratio


def test_vllm_and_hf_ratios_beside_the_fastest_hf_generate_one():
    from bench.vs_trl import summarize

    sides = [{"side": "distrl", "completions_per_s": 90.0, "tokens_per_s": 9000.0},
             {"side": "distrl1", "completions_per_s": 60.0, "tokens_per_s": 6000.0},
             {"side": "trl:hf", "completions_per_s": 30.0, "tokens_per_s": 3000.0},
             {"side": "trl:vllm", "completions_per_s": 45.0, "tokens_per_s": 4500.0}]
    summary = summarize("fixed", sides)
    # vs_trl keeps its meaning: the fastest TRL side that generates with transformers, never trl:vllm
    assert summary["trl_best"] == "trl:hf" and summary["vs_trl"] == 3.0 and summary["vs_trl_tokens"] == 3.0
    assert summary["vs_trl_vllm"] == 2.0 and summary["vs_trl_hf"] == 3.0
    assert sides[1]["vs_trl"] == 2.0 and sides[1]["vs_trl_vllm"] == round(60 / 45, 3)
    lost = summarize("fixed", [sides[0], {"side": "trl:vllm", "how": "killed at --hard_s"}])
    assert lost["vs_trl_vllm"] is None and lost["vs_trl"] is None and lost["vs_trl_hf"] is None


def test_report_adds_runs_and_keeps_every_key(tmp_path):
    from bench.vs_trl import report

    results = tmp_path / "vs_trl.json"
    results.write_text(json.dumps({"note": "old", "runs": [{"workload": "fixed", "date": "d0", "vs_trl": 5.0}],
                                   "vs_trl_fixed": 5.0, "vs_trl_fixed_runs": [5.0], "seventh_round": {"x": 1}}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "fixed.json").write_text(json.dumps({"workload": "fixed", "date": "d1", "vs_trl": 7.0,
                                                "vs_trl_vllm": 4.5, "vs_trl_hf": 7.5}))
    (run / "variable.json").write_text(json.dumps({"workload": "variable", "date": "d1", "vs_trl": None,
                                                   "vs_trl_vllm": None, "vs_trl_hf": None}))
    out = report([str(run)], "machine, commit", path=results)
    assert out["note"] == "old" and out["seventh_round"] == {"x": 1} and len(out["runs"]) == 3
    assert out["vs_trl_fixed"] == 7.0 and out["vs_trl_fixed_runs"] == [5.0, 7.0]
    assert out["vs_trl_vllm_fixed"] == 4.5 and out["vs_trl_vllm_fixed_runs"] == [4.5]
    assert out["vs_trl_hf_fixed"] == 7.5 and out["runs"][-1]["note"] == "machine, commit"
    assert out["vs_trl_vllm_variable"] is None and out["vs_trl_vllm_variable_runs"] == []
    assert json.loads(results.read_text()) == out
    assert len(report([str(run)], "again", path=results)["runs"]) == 3  # a run already there is not added twice


def test_a_bad_trl_variant_is_named(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "run", "--trl", "hf,sglang", "--model", "tiny",
                           "--out", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--trl: unknown variant(s) sglang" in proc.stderr
    assert not list(tmp_path.iterdir())


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
