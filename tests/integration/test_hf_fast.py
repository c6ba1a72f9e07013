"""The HF engine's fast path (static cache; CUDA graph on GPU, the same code eagerly on CPU) against the
engine's own loop on the tiny model: same greedy tokens, logprobs within 1e-5 (fp32), per-row stops,
exact sampling, weight loads and in-flight updates.

On CPU the fast path runs eagerly (no graph): what is checked is its static-cache code. The ``cuda``
cases (marked ``gpu``) run the captured graph, including re-capture after a load changes modules.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from distrl.rollout.engines.hf.engine import INFLIGHT_INTERVAL, HFEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_garbage_while_tracing")

NEW = 24
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU")])]


def _prompts() -> list[str]:
    """Three GSM8K question openings of different lengths (the engine left-pads them); on a machine
    without ``../shared/data`` (the GPU machine gets the repository alone), three arithmetic prompts."""
    path = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    if not path.exists():
        return ["1+2=", "12*3= and then 4", "(7+5)*3 = 36, so then 2*"]
    lines = path.read_text().splitlines()[:3]
    return [json.loads(line)["question"][:n] for line, n in zip(lines, (7, 19, 33))]


def _save_lora(base: Path, out: Path, seed: int, r: int = 8) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0,
                     init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def _save_full(base: Path, out: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    from distrl.core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("hf_fast")
    base = build_tiny_model(root / "tiny")
    return dict(base=base, lora1=_save_lora(base, root / "lora1", 1), lora2=_save_lora(base, root / "lora2", 2),
                lora_r4=_save_lora(base, root / "lora_r4", 3, r=4), full=_save_full(base, root / "full", 4),
                root=root, prompts=_prompts())


def _engines(model: Path, device: str, **kwargs) -> tuple[HFEngine, HFEngine]:
    """(the engine's own loop, the fast path), fp32, on ``device``, static batching; the fast path uncompiled."""
    slow = HFEngine(str(model), dtype="float32", max_model_len=128, device=device, fast=False, batching="static",
                    **kwargs)
    fast = HFEngine(str(model), dtype="float32", max_model_len=128, device=device, fast=True, fast_compile=False,
                    batching="static", **kwargs)
    assert fast._fast is not None and fast._fast.cuda_graphs == (device == "cuda")
    return slow, fast


def _flat(results) -> list:
    return [c for r in results for c in r.completions]


def _assert_same(a, b, atol: float = 1e-5) -> None:
    """Same token ids, finish reasons and texts; logprobs within ``atol`` nats."""
    ca, cb = _flat(a), _flat(b)
    assert [(c.token_ids, c.finish_reason, c.text) for c in ca] == [(c.token_ids, c.finish_reason, c.text) for c in cb]
    worst = max(max((abs(x - y) for x, y in zip(p.logprobs, q.logprobs)), default=0.0) for p, q in zip(ca, cb))
    assert worst <= atol, worst


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_the_engine_loop_with_a_stop_per_row(w, device):
    slow, _ = _engines(w["base"], device)
    rows = [c.token_ids for c in _flat(slow.generate(w["prompts"], 1, 0.0, NEW))]
    # a stop token that some rows emit after their first token and others never: rows end apart
    stop = next(t for ids in rows for t in ids[1:] if any(t not in other for other in rows))
    model = w["root"] / f"stop_{device}"
    shutil.copytree(w["base"], model, dirs_exist_ok=True)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], stop]
    (model / "generation_config.json").write_text(json.dumps(gen))
    slow, fast = _engines(model, device)
    expected = slow.generate(w["prompts"], 2, 0.0, NEW)
    got = fast.generate(w["prompts"], 2, 0.0, NEW)
    _assert_same(expected, got)
    reasons = [c.finish_reason for c in _flat(got)]
    assert "stop" in reasons and "length" in reasons
    assert all(c.token_ids[-1] == stop for c in _flat(got) if c.finish_reason == "stop")
    state = fast._fast._state
    _assert_same(expected, fast.generate(w["prompts"], 2, 0.0, NEW))  # the same shape reuses the buffers
    assert fast._fast._state is state


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_logprobs_equal_fp32_recomputation(w, device):
    from transformers import AutoModelForCausalLM

    _, fast = _engines(w["base"], device, seed=5)
    results = fast.generate(w["prompts"], 3, 0.7, 16)
    model = AutoModelForCausalLM.from_pretrained(str(w["base"]), dtype=torch.float32).eval()
    worst = 0.0
    for r in results:
        for c in r.completions:
            ids = torch.tensor([r.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float() / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert worst < 1e-5
    assert len({tuple(c.token_ids) for c in _flat(results)}) > 3  # sampled, not greedy


@pytest.mark.parametrize("device", DEVICES)
def test_weight_loads_and_inflight_updates_match_the_engine_loop(w, device):
    slow, fast = _engines(w["base"], device)
    p = w["prompts"]
    _assert_same(slow.generate(p, 1, 0.0, NEW), fast.generate(p, 1, 0.0, NEW))
    for version, fmt, path in [(1, "lora", w["lora1"]),  # wraps the model: new modules
                               (2, "lora", w["lora2"]),  # same shape: copied in place
                               (3, "lora", w["lora_r4"]),  # another rank: new modules
                               (4, "full", w["full"])]:  # unloads the adapter
        captures = fast._fast.captures
        slow.load_weights(version, fmt, path)
        fast.load_weights(version, fmt, path)
        _assert_same(slow.generate(p, 1, 0.0, NEW), fast.generate(p, 1, 0.0, NEW), atol=1e-5)
        if device == "cuda":  # a new graph after module changes only
            assert fast._fast.captures == captures + (version != 2)

    calls = {"slow": [], "fast": []}

    def switch(engine, name):
        def between():
            calls[name].append(engine.version)
            if engine.version == 4:
                engine.load_weights(5, "lora", w["lora1"])  # in flight, and it changes modules
        return between

    a = slow.generate(p, 2, 0.0, 3 * INFLIGHT_INTERVAL, between_steps=switch(slow, "slow"))
    b = fast.generate(p, 2, 0.0, 3 * INFLIGHT_INTERVAL, between_steps=switch(fast, "fast"))
    _assert_same(a, b)
    assert calls["slow"] == calls["fast"] and calls["fast"][0] == 4
    assert slow.version == fast.version == 5


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_step_gives_the_same_tokens(w, device):
    """fast_compile (torch.compile of the decode step; the default on CUDA): same greedy tokens."""
    slow = HFEngine(str(w["base"]), dtype="float32", max_model_len=128, device=device, fast=False, batching="static")
    fast = HFEngine(str(w["base"]), dtype="float32", max_model_len=128, device=device, fast=True, fast_compile=True,
                    batching="static")
    _assert_same(slow.generate(w["prompts"], 2, 0.0, NEW), fast.generate(w["prompts"], 2, 0.0, NEW), atol=1e-4)
