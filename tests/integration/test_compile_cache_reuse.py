"""Compiled code is kept across runs (distrl.core.compile_cache): the learner's layers compiled by inductor on the
CPU (`--learner_compile`'s `compile_layers`), each run in its own process as a role would, with the caches under a
test directory. A second run of the same model and flags loads every graph from the cache; a flag that changes the
traced code (packed rows) compiles its new graphs afresh; and the compiled layers compute what the eager model does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

RUN = textwrap.dedent("""
    import json, sys
    from distrl.core.compile_cache import compile_counters, use_compile_caches
    use_compile_caches(sys.argv[1])
    import torch
    from transformers import AutoModelForCausalLM
    from distrl.learn.model import compile_layers
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2], torch_dtype=torch.float32)
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    compile_layers(model, packed=sys.argv[3] == "packed")
    with torch.no_grad():
        compiled = model(input_ids=ids).logits
    print(json.dumps({**compile_counters(), "max_abs_diff": (compiled - eager).abs().max().item()}))
""")


def _run(cache, model, flag) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"):
        env.pop(name, None)  # the run's own choice (use_compile_caches), not an inherited one
    out = subprocess.run([sys.executable, "-c", RUN, str(cache), str(model), flag], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~110 s of inductor C++ compiles on 2 cores; in make test: tests/unit/test_compile_cache.py
def test_a_second_run_loads_the_compiled_layers_and_a_changed_flag_compiles_afresh(qwen_tiny, tmp_path):
    cache = tmp_path / "compile"
    first = _run(cache, qwen_tiny, "plain")
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_hit"] == 0, first
    assert (cache / "inductor").is_dir()
    second = _run(cache, qwen_tiny, "plain")
    assert second["fxgraph_cache_hit"] == first["fxgraph_cache_miss"] and second["fxgraph_cache_miss"] == 0, second
    packed = _run(cache, qwen_tiny, "packed")
    assert packed["fxgraph_cache_miss"] > 0, packed  # the packed rows' graphs were never compiled before
    for run in (first, second, packed):
        assert run["max_abs_diff"] < 1e-4, run
