"""Users' options through `distrl train` on the tiny model: a --reward function from a test file, a
--prompt_template, truncation marked per completion, sample completions and idle/throughput/staleness
metrics in TensorBoard, and the exported final model (LoRA adapter + merged weights).

The tiny random model practically never emits its end-of-sequence token (every completion of a
24-token run hit the limit), so `--truncation zero` or `mask` would leave it no signal and no step:
the run keeps truncated completions (`keep`, the default), and `zero`/`mask` are tested in
tests/unit/test_user_options.py (the actor's rule by hand, the learner's mask on the model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distrl.buffer.segments import read_segments
from tests.integration.test_train import ENV, ROOT

REWARDS = ROOT / "tests" / "unit" / "user_rewards.py"


def events(run_dir: Path, role: str) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb" / role), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


# A shell with RAY_ADDRESS set to a cluster that is gone (left by an earlier `ray start`): `distrl train` without
# --ray_address starts its own local cluster all the same (ray.init(address="local")); it must not try to join.
GONE_CLUSTER = {"RAY_ADDRESS": "127.0.0.1:9"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """The users' run, launched from a shell whose RAY_ADDRESS names a cluster that is gone (GONE_CLUSTER)."""
    log_dir = tmp_path_factory.mktemp("runs")
    args = [sys.executable, "-m", "distrl", "train", "--model", "tiny", "--run_name", "users", "--max_steps", "2",
            "--batch_size", "2", "--group_size", "4", "--max_new_tokens", "6", "--learning_rate", "1e-3",
            "--reward", f"{REWARDS}:digits", "--prompt_template", "what is {question}", "--truncation", "keep",
            "--log_samples", "2", "--engine", "hf", "--torch_threads", "1", "--log_dir", str(log_dir)]
    proc = subprocess.run(args, cwd=ROOT, env=ENV | GONE_CLUSTER, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return log_dir / "users"


def test_custom_reward_template_and_truncation_in_the_segments(run_dir):
    rows = read_segments(run_dir).to_pylist()
    assert rows and all(r["prompt_text"].startswith("what is ") and r["prompt_text"].endswith("=") for r in rows)
    truncated = [r for r in rows if r["finish_reason"] == "length"]
    assert truncated, "max_new_tokens 6 on a random model: some completions must hit the limit"
    for r in rows:
        comps = r["reward_components"]
        comps = dict(comps) if not isinstance(comps, dict) else comps
        text = r["completion_text"]
        share = sum(ch.isdigit() for ch in text) / max(len(text), 1)  # what user_rewards.digits computes
        assert comps["digits"] == pytest.approx(share) and "has_gold" in comps
        assert comps["truncated"] == float(r["finish_reason"] == "length") and "scored" not in comps
        assert r["reward"] == pytest.approx(share)  # --truncation keep: as scored


def test_samples_and_monitoring_in_tensorboard(run_dir):
    actor = events(run_dir, "actor0")
    samples = actor.Tensors("actor/samples")
    assert samples and len({s.step for s in samples}) == len(samples)  # at most one per policy version
    text = samples[0].tensor_proto.string_val[0].decode()
    assert text.count("**reward") == 2 and "    what is " in text
    for tag in ("actor/idle_fraction", "actor/credit_wait_fraction", "actor/weight_wait_fraction",
                "actor/truncated_fraction"):
        assert all(0.0 <= e.value <= 1.0 for e in actor.Scalars(tag)), tag
    idle, credit, weight = (actor.Scalars(f"actor/{t}") for t in ("idle_fraction", "credit_wait_fraction",
                                                                   "weight_wait_fraction"))
    assert len(idle) == len(credit) == len(weight) > 0  # written together, one of each per report
    for e, c, w in zip(idle, credit, weight):  # idle = waiting for credits + waiting for weights
        assert e.step == c.step == w.step and e.value == pytest.approx(c.value + w.value, abs=1e-6)
    assert max(e.value for e in actor.Scalars("actor/truncated_fraction")) > 0
    assert all(e.value > 0 for e in actor.Scalars("actor/tokens_per_s_wall"))

    learner = events(run_dir, "learner0")
    for tag in ("learner/idle_fraction", "learner/idle_fraction_version", "learner/truncated_fraction"):
        values = {e.step: e.value for e in learner.Scalars(tag)}
        assert sorted(values) == [1, 2] and all(0.0 <= v <= 1.0 for v in values.values()), tag
    assert all(e.value > 0 for e in learner.Scalars("learner/tokens_per_s_wall"))
    hist = {h.step: h.histogram_value for h in learner.Histograms("learner/staleness")}
    assert sorted(hist) == [1, 2]
    assert all(h.num == 2 * 4 and 0 <= h.min <= h.max <= 1 for h in hist.values())  # batch 2 x group 4


def test_final_model_is_exported_and_loads(run_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final"
    assert sorted(p.name for p in final.iterdir()) == ["adapter", "merged"]
    # the adapter is the last policy version's
    published = load_file(str(run_dir / "weights" / "v000002" / "adapter_model.safetensors"))
    exported = load_file(str(final / "adapter" / "adapter_model.safetensors"))
    assert published.keys() == exported.keys()
    assert all(torch.equal(published[k], exported[k]) for k in published)
    assert any(v.abs().sum() > 0 for k, v in exported.items() if "lora_B" in k)  # it trained
    merged = AutoModelForCausalLM.from_pretrained(str(final / "merged"), dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(str(final / "merged")).encode("1+1=") == \
        AutoTokenizer.from_pretrained(str(run_dir / "model")).encode("1+1=")
    base = AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(final / "adapter")).merge_and_unload().state_dict()
    state = merged.state_dict()
    assert set(state) == set(reference)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6)


def test_reward_timeouts_are_counted_and_said(tmp_path):
    """Issue 40: a --reward that runs past --reward_timeout_s scored 0 with nothing in the console, TensorBoard or
    summary.json. `stalls` sleeps a minute on every non-empty completion, through the actor's real worker pool (the
    HF engine: the rule is the actor's, whichever engine generates; vLLM's start-up only cost CPU here)."""
    import json

    args = [sys.executable, "-m", "distrl", "train", "--model", "tiny", "--backend", "hf", "--engine", "hf",
            "--torch_threads", "1", "--run_name", "stalls", "--max_steps", "2", "--batch_size", "2",
            "--group_size", "2",
            "--max_new_tokens", "4", "--reward", f"{REWARDS}:stalls", "--reward_timeout_s", "0.5",
            "--reward_workers", "2", "--no_console", "--log_dir", str(tmp_path)]
    proc = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    run_dir = tmp_path / "stalls"
    rows = read_segments(run_dir).to_pylist()
    timed_out = sum(dict(r["reward_components"]).get("timeout") == 1.0 for r in rows)
    assert timed_out > 0 and all(r["reward"] == 0.0 for r in rows if r["completion_text"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_timeouts"] == timed_out  # every group the actor made is in the segment log
    assert max(e.value for e in events(run_dir, "actor0").Scalars("actor/reward_timeouts")) == timed_out
    warnings = [line for line in (run_dir / "logs" / "actor0.log").read_text().splitlines()
                if "ran past --reward_timeout_s 0.5 and scored 0" in line]
    assert len(warnings) == 1 and " WARNING " in warnings[0]  # the first time only
    assert f"rewards that ran past their time limit and scored 0: {timed_out}" in proc.stdout
