"""bench/many_actors.py in its short mode: 64 actors (real ZMQ clients) PUT to a real `distrl buffer` process
while a learner GETs; groups flow and none is accepted beyond AReaL's credit rule. Speed is not asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_many_actors_short_run_has_no_credit_violations(tmp_path):
    out = tmp_path / "many_actors.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "many_actors.py"), "--seconds", "3", "--warmup_s",
                           "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())  # the run's keys, and each measured number's *_runs history (results_file)
    assert {k: saved[k] for k in last} == last and saved["groups_per_s_runs"] == [last["groups_per_s"]]
    assert last["actors"] == 64 and last["fsync"].startswith("batch")
    assert last["credit_violations"] == 0 and last["credits_beyond_rule"] == 0
    assert last["buffer_credit_violations_counter"] in (0, None)
    assert last["stale_rows_served"] == 0 and last["duplicates"] == 0
    assert last["groups_per_s"] > 0 and last["gets_in_window"] > 0  # groups flowed, learner versions advanced
    assert last["groups_put_total"] == last["actor_puts"]  # every acknowledged group is counted by the buffer
