"""bench/results/*.json keep the keys that issues' acceptance asked for: each at the top level with its latest
measured value (a number or a bool) and its history ``<key>_runs``, however later rounds rewrite the file
(their writers merge: ``bench/results_file.py``). Later issues add their keys to REQUIRED."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.results_file import merge

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

REQUIRED = {
    "real_model.json": ["heldout_gain", "vs_trl_time_to_accuracy", "unsloth_lora_gain", "qlora_gain",
                        "startup_s", "startup_cold_s", "recompiles_after_warmup",
                        "vs_trl_vllm_time_to_accuracy_from_launch"],
    "gpu_vllm.json": ["greedy_equal_lora", "greedy_equal_full", "decode_tok_s_b256", "vs_trl",
                      "weight_latency_lora_s", "weight_latency_full_s"],
    "vs_trl.json": ["vs_trl_fixed", "vs_trl_variable", "vs_trl_vllm_fixed", "vs_trl_vllm_variable",
                    "vs_trl_hf_variable", "vs_trl_hf_fixed"],
    "real_workload.json": ["version_s_median", "version_s_p90", "version_s_median_custom_reward",
                           "continuous_vs_static", "continuous_ideal_ratio", "continuous_vs_ideal",
                           "decode_roofline_fraction_b1024", "vs_trl_fixed", "vs_trl_variable",
                           "recompiles_after_warmup"],
    "chaos.json": ["kills_total", "resumes", "versions_reached", "acked_lost", "trained_twice", "versions_backwards"],
    "buffer.json": ["ingest_vs_raw_zmq", "ingest_replicated_vs_unreplicated"],
    "startup.json": ["startup_s_hf_cold"],
    "adaptive_staleness.json": ["auto_vs_0_speed", "auto_vs_ceiling_speed", "auto_reward_gap", "runs"],
    "demo_tools.json": ["tool_gain_heldout", "tool_minus_notool", "runs"],  # make demo-tools (bench/demo_tools.py)
    "bias_correction.json": ["slice_acc_reweight", "slice_acc_none", "slice_acc_slack"],  # and "runs"
    "multiturn.json": ["tool_gain", "turns_mean", "episodes_per_s"],  # bench/multiturn.py (GPU)
    "vs_peer.json": ["vs_peer_variable", "vs_peer_time_to_accuracy_from_launch"],  # bench/vs_peer.py (GPU)
    "bytecode_cache.json": ["bytecode_cache_startup_ratio"],  # bench/bytecode_cache.py (CPU)
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_each_required_key_has_a_value_and_a_history(name):
    out = json.loads((RESULTS / name).read_text())
    for key in REQUIRED[name]:
        assert isinstance(out.get(key), (bool, int, float)), f"{name}: {key} = {out.get(key)!r}, not a measured value"
        runs = out.get(f"{key}_runs")
        assert isinstance(runs, list) and runs, f"{name}: {key}_runs missing or empty"
        assert all(isinstance(v, (bool, int, float)) or v is None for v in runs), f"{name}: {key}_runs"


def test_merge_keeps_every_key_and_extends_each_history(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"gain": 0.2, "gain_runs": [0.2], "ratio": 3.0, "ratio_runs": [3.0], "old": 1,
                                "note": "first round"}))
    out = merge(path, {"gain": 0.3, "ratio": None, "speed": 5, "flag": True, "note": "second round",
                       "pair": 1.5, "pair_runs": [1.5, 2.5]})
    assert out == json.loads(path.read_text())
    assert out["old"] == 1 and "old_runs" not in out  # kept as it was
    assert (out["gain"], out["gain_runs"]) == (0.3, [0.2, 0.3])
    assert (out["ratio"], out["ratio_runs"]) == (3.0, [3.0])  # None: not measured this time
    assert (out["speed_runs"], out["flag_runs"]) == ([5], [True])
    assert out["note"] == "second round" and "note_runs" not in out
    assert out["pair_runs"] == [1.5, 2.5]  # the run's own list of runs, not its value twice


def test_bias_correction_reports_each_seed():
    out = json.loads((RESULTS / "bias_correction.json").read_text())
    runs = out["runs"]
    arms = {r["correction"] for r in runs}
    assert "none" in arms and arms <= {"none", "reweight", "slack", "bound4"}, arms
    for arm in arms:
        seeds = [r["seed"] for r in runs if r["correction"] == arm]
        assert len(seeds) == len(set(seeds)) == out["seeds"], arm
    assert all(isinstance(r["slice_acc"], float) for r in runs)
