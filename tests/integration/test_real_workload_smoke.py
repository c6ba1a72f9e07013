"""`python -m bench.real_workload smoke`: the GPU benchmark's code path (a `distrl train` case, read back from
TensorBoard into a version-time split, the scoring costs, the summary JSON) on CPU with the tiny model.

Checks what the script wrote and printed is well formed and self-consistent; never how fast anything was."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.integration.test_train import ENV, ROOT

SPLIT = {"get_wait", "learner_step", "publish", "generate", "weight_load", "actor_rest"}


def test_smoke_writes_a_sane_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.real_workload", "smoke", "--out", str(out)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    case = json.loads((out / "custom_reward.json").read_text())
    assert case["how"] == "exited 0" and case["case"] == "custom_reward"
    assert "--model tiny" in case["command"] and "--reward " in case["command"] and "--max_steps 3" in case["command"]
    assert case["versions"] == 2 == len(case["times"])  # 3 versions, none left out: 2 gaps between them
    times = case["times"]
    assert all(t > 0 for t in times) and case["version_s_min"] == min(times) and case["version_s_max"] == max(times)
    assert case["version_s_min"] <= case["version_s_median"] <= case["version_s_max"]
    assert math.isclose(case["version_s_mean"], sum(times) / len(times), abs_tol=1e-3)
    split = case["split_s"]
    assert set(split) == SPLIT and all(math.isfinite(v) for v in split.values())
    assert min(split["get_wait"], split["publish"], split["weight_load"]) >= 0 and split["generate"] > 0
    # the learner's part of a version: GET wait + step + publish is the version's mean time
    assert math.isclose(split["get_wait"] + split["learner_step"] + split["publish"], case["version_s_mean"],
                        abs_tol=2e-3)
    assert case["actor_steps_per_version"] > 0 and case["learner_tokens_per_s"] > 0 and case["startup_s"] > 0
    # on CPU the engine runs its own loop (no graph) and nothing is compiled: both counts are there, and 0
    assert case["graph_captures_after_warmup"] == 0 and case["recompiles_after_warmup"] == 0 == case["recompiles"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cases"]["custom_reward"] == case
    assert summary["version_s_median_custom_reward"] == case["version_s_median"]
    assert summary["runs"] == {"custom_reward": {k: case[k] for k in ("version_s_median", "version_s_p90")}}
    assert summary["version_s_median"] is None and summary["best_case"] is None  # no case without a custom reward
    assert summary["score_s_builtin"] > 0 and summary["score_s_custom"] > 0
    assert summary["recompiles_after_warmup"] == 0 and summary["graph_captures_after_warmup"] == 0
    printed = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line: the summary without per-case detail
    assert printed["version_s_median_custom_reward"] == case["version_s_median"]
    assert printed["cases"] == {"custom_reward": summary["runs"]["custom_reward"]}
    assert "custom_reward: exited 0" in proc.stdout


def test_recompiles_counts_torch_logs_lines_after_a_wall_time(tmp_path):
    """bench.real_workload.recompiles reads what TORCH_LOGS=recompiles really prints (a function compiled for
    two shapes: one recompile), in a log file or in a directory of them, before and after a wall time."""
    import time

    from bench.real_workload import recompiles

    code = "import torch\nf = torch.compile(lambda x: x * 2, dynamic=False)\nf(torch.ones(3)); f(torch.ones(5))\n"
    logs = tmp_path / "session" / "logs"
    logs.mkdir(parents=True)
    before = time.time() - 2
    with open(logs / "worker-1.err", "w") as err:
        subprocess.run([sys.executable, "-c", code], env={**ENV, "TORCH_LOGS": "recompiles"}, stderr=err, check=True,
                       timeout=300)
    (tmp_path / "case.log").write_text("no torch lines here\n")
    assert recompiles([tmp_path / "case.log", tmp_path / "session"], before) == (1, 1)
    assert recompiles([tmp_path / "session"], time.time() + 5) == (0, 1)
