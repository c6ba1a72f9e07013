"""The end-of-run report (distrl/cmd/report.py) from real TensorBoard event files and an eval.jsonl."""

from __future__ import annotations

import json

import pytest

from distrl.cmd.report import read_eval, read_scalars, write_report
from distrl.core.metrics import Metrics


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    with Metrics(run / "tb" / "learner0") as m:
        for v in range(1, 5):
            m.scalars({"learner/reward_mean": 0.1 * v, "learner/staleness_mean": 0.5,
                       "learner/staleness_max": v % 2, "learner/tokens_per_s": 100.0 * v}, step=v)
    with Metrics(run / "tb" / "actor0") as m:
        m.scalars({"actor/tokens_per_s": 50.0}, step=0)
        m.scalars({"actor/tokens_per_s": 70.0}, step=2)
    lines = [{"version": 4, "wall_s": 9.0, "accuracy": 0.5}, {"version": 0, "wall_s": 1.0, "accuracy": 0.25}]
    (run / "eval.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def test_read_scalars_and_eval(run_dir):
    scalars = read_scalars(run_dir / "tb" / "learner0", ("learner/reward_mean",))
    assert list(scalars) == ["learner/reward_mean"]
    assert [s for s, _ in scalars["learner/reward_mean"]] == [1, 2, 3, 4]
    assert scalars["learner/reward_mean"][-1][1] == pytest.approx(0.4)
    assert [line["version"] for line in read_eval(run_dir)] == [0, 4]  # sorted by version
    assert read_scalars(run_dir / "tb" / "missing") == {} and read_eval(run_dir / "tb") == []


def test_write_report(run_dir, capsys):
    summary = {"run_dir": str(run_dir), "versions": 4, "wall_s": 12.5, "train_wall_s": 10.0,
               "buffer": {"groups_put": 20}, "reward_by_version": [0.1, 0.2, 0.3, 0.4]}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    numbers = write_report(run_dir, summary)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == numbers
    assert numbers["accuracy_before"] == 0.25 and numbers["accuracy_after"] == 0.5
    assert numbers["eval_versions"] == [0, 4]
    assert numbers["reward_first"] == pytest.approx(0.1) and numbers["reward_last"] == pytest.approx(0.4)
    assert numbers["staleness_mean"] == pytest.approx(0.5) and numbers["staleness_max"] == 1
    assert numbers["learner_tokens_per_s"] == pytest.approx(250.0)
    assert numbers["actor_tokens_per_s"] == pytest.approx(60.0)
    assert numbers["groups"] == 20 and numbers["wall_s"] == 12.5
    png = run_dir / "curve.png"
    assert numbers["curve_png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert numbers["tensorboard_dir"] == str(run_dir / "tb")
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["accuracy_after"] == 0.5 and saved["buffer"] == {"groups_put": 20}


def test_report_without_eval(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    numbers = write_report(run, {"versions": 2, "wall_s": 1.0, "reward_by_version": [0.0, 1.0]})
    assert numbers["accuracy_before"] is None and numbers["eval_jsonl"] is None
    assert numbers["reward_last"] == 1.0  # from the summary when there are no learner events
    assert (run / "curve.png").is_file()
