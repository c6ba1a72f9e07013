"""bench/results/vs_trl.json keeps the keys issue 43 asks for beside the older ones: each ratio and its history."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_vs_trl_results_hold_every_ratio_and_its_history():
    out = json.loads((RESULTS / "vs_trl.json").read_text())
    for key in ("vs_trl", "vs_trl_vllm", "vs_trl_hf"):
        for workload in ("fixed", "variable"):
            name = f"{key}_{workload}"
            assert name in out and isinstance(out[f"{name}_runs"], list), name
            assert out[name] is None or out[name] in out[f"{name}_runs"], name  # one of the runs' ratios
    assert len(out["vs_trl_fixed_runs"]) >= 7 and len(out["vs_trl_variable_runs"]) >= 8  # history never dropped
    assert all("workload" in run for run in out["runs"])


def test_startup_results_name_each_case():
    out = json.loads((RESULTS / "startup.json").read_text())
    for run in out["runs"]:
        for case in run["cases"]:
            assert case["case"].split(":")[0] in ("hf", "vllm") and "phases_s" in case and "marks_s" in case
