"""The same weights give the same payload digest in every process: PEFT writes adapter_config.json's
target_modules set in an order that string hashing randomizes per process, so a run and its --resume published
one version under two digests, and the resumed learner's attestation quarantined the actors' groups of that
version (found by bench/chaos.py). distrl.weights.fs.save_payload writes those lists sorted."""

from __future__ import annotations

import json
import subprocess
import sys

from distrl.weights import PayloadDirectory
from distrl.weights.fs import save_payload


class _Adapter:
    """A stand-in for a PEFT model whose save_pretrained lists its target modules in a given order."""

    def __init__(self, order: list[str]):
        self.order = order

    def save_pretrained(self, directory: str) -> None:
        config = {"r": 16, "target_modules": self.order, "peft_type": "LORA", "exclude_modules": None}
        with open(f"{directory}/adapter_config.json", "w") as f:
            json.dump(config, f)
        with open(f"{directory}/adapter_model.safetensors", "wb") as f:
            f.write(b"\x01\x02\x03")


def test_the_order_of_a_set_does_not_change_the_digest(tmp_path):
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    digests = []
    for i, order in enumerate((modules, modules[::-1], sorted(modules))):
        transport = PayloadDirectory(tmp_path / f"w{i}")
        digests.append(transport.publish(3, "lora", lambda d, o=order: save_payload(_Adapter(o), d)).digest)
    assert len(set(digests)) == 1, digests
    written = json.loads((tmp_path / "w0" / "v000003" / "adapter_config.json").read_text())
    assert written["target_modules"] == sorted(modules) and written["exclude_modules"] is None


_PUBLISH = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from distrl.weights import PayloadDirectory
from distrl.weights.fs import save_payload
torch.manual_seed(0)
model = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]), LoraConfig(
    r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
print(PayloadDirectory(sys.argv[2]).publish(1, "lora", lambda d: save_payload(model, d)).digest)
"""


def test_two_processes_publish_one_adapter_under_one_digest(tmp_path):
    """A real PEFT adapter of the tiny model, published by two processes with different hash seeds."""
    from distrl.core.tiny import build_tiny_model

    build_tiny_model(tmp_path / "model", seed=0)
    digests = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _PUBLISH, str(tmp_path / "model"), str(tmp_path / f"w{seed}")],
                             env={"PYTHONHASHSEED": seed, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1, digests
