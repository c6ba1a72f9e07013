"""distrl.core.quant_libs: which processes leave bitsandbytes and torchao out, and that peft and transformers go on
without them (a fresh interpreter: the test process has imported both already)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distrl.core.quant_libs import QUANTIZATION_LIBRARIES, quantized, skip_quantization_libraries


@pytest.fixture
def plain(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return tmp_path


def test_quantized_reads_the_config(plain, tmp_path_factory):
    assert not quantized(plain)
    q = tmp_path_factory.mktemp("q")
    (q / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert quantized(q)
    assert quantized(tmp_path_factory.mktemp("empty"))  # no config here (a hub name): assumed quantized
    assert quantized("Qwen/Qwen2.5-0.5B-Instruct")


def test_left_in_where_they_may_be_used_or_where_it_is_too_late(plain, monkeypatch):
    for name in QUANTIZATION_LIBRARIES + ("transformers", "peft", "vllm", "unsloth"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not skip_quantization_libraries(plain, unsloth=True)
    assert not skip_quantization_libraries(plain, load_in_4bit=True)
    monkeypatch.setitem(sys.modules, "peft", object())  # peft has looked already: its answer stands
    assert not skip_quantization_libraries(plain)
    assert all(name not in sys.modules for name in QUANTIZATION_LIBRARIES)


def test_peft_and_transformers_build_lora_without_them(plain):
    code = ("import sys; from distrl.core.quant_libs import skip_quantization_libraries as s; "
            f"assert s({str(plain)!r}); "
            "import peft, transformers; from peft import LoraConfig, get_peft_model; "
            "from transformers import Qwen2Config, Qwen2ForCausalLM; "
            "m = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, "
            "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)); "
            "p = get_peft_model(m, LoraConfig(r=2, target_modules=['q_proj'])); "
            "print(sum(n.endswith('lora_A.default.weight') for n, _ in p.named_parameters()), "
            "[n for n in ('bitsandbytes', 'torchao') if sys.modules.get(n) is not None])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "[]"]
