"""`--model tiny` is copied from distrl's cache (distrl.core.tiny.tiny_model): the same files as a fresh build."""

from __future__ import annotations

import subprocess
import sys

from distrl.core.tiny import build_tiny_model, tiny_model

# The copy must not import transformers' model classes (the build's ~2 s of CPU in every `distrl train`).
NO_MODEL_IMPORT = """
import sys
from distrl.core.tiny import tiny_model
tiny_model(sys.argv[1], seed=3)
print(sorted(m for m in sys.modules if m.startswith(("transformers.models.qwen2", "torch._dynamo"))))
"""


def test_a_cached_build_equals_a_fresh_one_and_is_copied_without_importing_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTRL_CACHE_DIR", str(tmp_path / "cache"))
    first = tiny_model(tmp_path / "run1" / "model", seed=3)  # builds the cache, then copies
    fresh = build_tiny_model(tmp_path / "fresh", seed=3)
    (cached,) = (tmp_path / "cache" / "tiny").iterdir()
    assert cached.name.startswith("seed3-")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "distrl_tiny.json"):
        assert (first / name).read_bytes() == (fresh / name).read_bytes() == (cached / name).read_bytes(), name
    out = subprocess.run([sys.executable, "-c", NO_MODEL_IMPORT, str(tmp_path / "run2" / "model")], text=True,
                         capture_output=True, env={"DISTRL_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin"},
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
    weights = (fresh / "model.safetensors").read_bytes()
    assert (tmp_path / "run2" / "model" / "model.safetensors").read_bytes() == weights
    assert len(list((tmp_path / "cache" / "tiny").iterdir())) == 1  # one build, reused
    other = tiny_model(tmp_path / "run3" / "model", seed=4)  # another seed: its own build, other weights
    assert (other / "model.safetensors").read_bytes() != weights
