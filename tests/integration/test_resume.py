"""`distrl train --resume`: a run stopped at version k and resumed to 2k equals one run straight to 2k.

With max_staleness 0, one actor and fixed seeds, every piece of state must come back for the
parameters to match: the learner's weights, optimizer moments and LR schedule (checkpoint), the
buffer's unconsumed groups and credit count (segment log), the actor's place in the prompt stream
and its sampling seeds (derived from that place). The HF engine serves the adapters (fp32): the uninterrupted run
is on-policy (the HF engine's behaviour logprobs equal the learner's); vLLM's on-policy check is
test_train.py's test_policy_improvement_half_vocab.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from distrl.buffer.segments import groups_by_actor, read_segments
from tests.integration.test_train import check_run, distrl, run, scalars

FLAGS = ["--model", "tiny", "--task", "half_vocab", "--engine", "hf", "--torch_threads", "1", "--max_staleness", "0",
         "--batch_size", "4", "--group_size", "4", "--max_new_tokens", "8", "--learning_rate", "3e-3",
         "--checkpoint_every", "1"]


def adapter(run_dir, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "ckpt" / f"v{version:06d}" / "model" / "adapter_model.safetensors"))


def test_resume_continues_versions_data_and_optimizer_exactly(tmp_path):
    run(distrl(*FLAGS, "--max_steps", "4", "--run_name", "straight"), tmp_path)
    run(distrl(*FLAGS, "--max_steps", "2", "--run_name", "stopped"), tmp_path)
    run(distrl("--resume", str(tmp_path / "stopped"), "--max_steps", "4"), tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "stopped"
    # The version sequence goes on without a gap or a repeat.
    versions = scalars(resumed, "learner0", "learner/policy_version")
    assert sorted(versions) == [1, 2, 3, 4]
    assert json.loads((resumed / "summary.json").read_text())["versions"] == 4
    # The actor continued the prompt stream: the same prompts, in the same order, none served twice.
    prompts = {name: read_segments(tmp_path / name).column("prompt_id").to_pylist()[::4]
               for name in ("straight", "stopped")}
    assert prompts["stopped"] == prompts["straight"][: len(prompts["stopped"])]
    assert len(prompts["stopped"]) >= 16
    # Weights after version 4 equal the uninterrupted run's (optimizer state and data restored).
    a, b = adapter(straight, 4), adapter(resumed, 4)
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    scale = max(a[k].abs().max().item() for k in a)
    assert diff <= 1e-6 * max(scale, 1.0), diff
    # ...and the resumed steps really moved them (checkpoints keep the newest two: v3, v4).
    assert max((adapter(resumed, 3)[k] - b[k]).abs().max().item() for k in b) > 1e-4
    # The summary covers the whole run, not the resumed part only: per-actor groups are the log's, the
    # rewards those of versions 1..4, and the printed first reward is the report table's.
    summary = json.loads((resumed / "summary.json").read_text())
    logged = groups_by_actor(resumed)
    assert {a["actor_id"]: a["groups"] for a in summary["actors"]} == logged
    assert sum(logged.values()) == summary["buffer"]["groups_put"] == len(prompts["stopped"])
    rewards = scalars(resumed, "learner0", "learner/reward_mean")
    assert sorted(rewards) == [1, 2, 3, 4]
    assert summary["reward_by_version"] == [rewards[v] for v in (1, 2, 3, 4)]
    assert summary["reward_first"] == summary["reward_by_version"][0]
    # The uninterrupted run is on-policy (max_staleness 0): what the HF engine recorded at version v, serving LoRA
    # adapter v, equals the learner's logprobs at version v, fp32 on both sides (steps 2..4 trained on versions 1..3).
    check_run(straight, versions=4, max_staleness=0, actors=1)
    mean_abs = scalars(straight, "learner0", "learner/logprob_mismatch_mean_abs")
    max_abs = scalars(straight, "learner0", "learner/logprob_mismatch_max_abs")
    for step in range(2, 5):
        assert mean_abs[step] < 1e-5 and max_abs[step] < 1e-3, (step, mean_abs, max_abs)
