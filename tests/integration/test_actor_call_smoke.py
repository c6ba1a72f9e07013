"""`python -m bench.actor_call --smoke`: the GPU benchmark's code path (the actor's engine, a call of each kind, the
steps counted by bucket, the summary JSON) on CPU with the tiny model. Checks that what it wrote is well formed and
self-consistent; never how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.actor_call import KINDS
from tests.integration.test_train import ENV, ROOT


def test_smoke_writes_a_sane_summary(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.actor_call", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "actor_call.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == res
    assert res["rows"] == 4 and res["max_new_tokens"] == 8 and res["device"] == "cpu"
    assert set(res["calls_s"]) == set(KINDS) and all(len(v) == 1 and v[0] > 0 for v in res["calls_s"].values())
    assert all(res[f"{kind}_s_median"] == res["calls_s"][kind][0] for kind in KINDS)
    split = res["split"]
    # 4 rows of at most 8 tokens: the prefill picks the first, each decode step one more (7 steps at most, 4 slots)
    assert 0 < split["tokens"] <= 32 and set(split["steps_by_bucket"]) == {"4"}
    assert 1 <= split["steps_by_bucket"]["4"] <= 7 and split["replay_ms"] == {}  # no graphs on CPU
    assert 0 < split["prefill_s"] == split["gpu_s"] <= split["call_s"]
