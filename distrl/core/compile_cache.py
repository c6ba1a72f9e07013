"""Compiled code kept across runs: torch inductor's FX-graph and kernel caches, Triton's kernels and vLLM's
compile cache live under distrl's cache directory (``<cache dir>/compile/``, :func:`distrl.core.probe.cache_dir`:
``$DISTRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/distrl``, else ``~/.cache/distrl``), not in ``/tmp``, so the first run
of a model and its flags pays the compilation and later runs load it.

Reuse is safe by construction of those caches, not by a key of ours: inductor keys each compiled graph by the
traced graph itself (operators, shapes or their symbols, dtypes, devices), the inductor config and the torch
version; the weights are inputs of the graph, not part of it. A changed model architecture or a flag that changes
what is traced (``--learner_pack_tokens``, ``--kl_coef``, LoRA) is a different graph and compiles afresh; a
different checkpoint of the same architecture reuses the compiled code, which is correct for any weights. vLLM
keys its cache by the model config, the compilation config and its own version, and its startup plan (the KV
cache size it profiled, ``VLLM_ENABLE_STARTUP_PLAN``, on unless set) also by the device and its free memory.

A variable the user already set (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, ``VLLM_CACHE_ROOT``) wins.

Python's own bytecode too (:func:`use_bytecode_cache`): an environment that forbids writing it
(``PYTHONDONTWRITEBYTECODE``, common in container images) whose packages were installed without it (uv's default,
``pip --no-compile``) compiles every module of torch, transformers and their imports from source in every process,
every run: 4.4 s of a role's start-up on the GPU machine (BENCHMARKS.md, twenty-third round). There distrl keeps the
bytecode under ``<cache dir>/compile/pycache`` (``PYTHONPYCACHEPREFIX``), never beside the installed sources.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from distrl.core.probe import cache_dir

# environment variable -> sub-directory of <cache dir>/compile
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "VLLM_CACHE_ROOT": "vllm"}


def use_compile_caches(root: str | Path | None = None) -> dict[str, str]:
    """Point this process's (and its children's) compile caches under ``root`` (default
    ``<cache dir>/compile``) unless the variable is already set; returns the variables in effect.
    Call before the first compilation (the caches read their variable when they first write)."""
    base = _compile_root(root)
    for name, sub in CACHE_VARIABLES.items():
        os.environ.setdefault(name, str(base / sub))
    os.environ.setdefault("VLLM_ENABLE_STARTUP_PLAN", "1")  # vLLM keeps its memory profile with its compile cache
    use_bytecode_cache(base / "pycache")
    return {name: os.environ[name] for name in CACHE_VARIABLES}


def use_bytecode_cache(prefix: str | Path | None = None, probe_package: str = "torch") -> bool:
    """Keep this process's and its children's Python bytecode under ``prefix`` (default
    ``<cache dir>/compile/pycache``) when the environment forbids
    writing it (``sys.dont_write_bytecode``: ``PYTHONDONTWRITEBYTECODE``) and ``probe_package`` was installed
    without it (no ``__pycache__`` entry beside its ``__init__.py``), so each module compiles once, not once per
    process. Sets ``sys.pycache_prefix`` and ``PYTHONPYCACHEPREFIX``, and lets bytecode be written again (here and,
    through the environment, in children). Returns whether it did; a ``PYTHONPYCACHEPREFIX`` the user set wins,
    and an install that has its bytecode, or bytecode writes allowed, changes nothing."""
    if not sys.dont_write_bytecode or os.environ.get("PYTHONPYCACHEPREFIX") or sys.pycache_prefix:
        return False
    module = sys.modules.get(probe_package)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(probe_package)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py") or os.path.exists(importlib.util.cache_from_source(origin)):
        return False
    prefix = prefix if prefix is not None else _compile_root() / "pycache"
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    return True


def _compile_root(root: str | Path | None = None) -> Path:
    """``root``, else ``<cache dir>/compile``: where the compile caches and the bytecode live."""
    return Path(root) if root is not None else cache_dir() / "compile"


def compile_counters() -> dict[str, int]:
    """This process's torch.compile counters so far: ``fxgraph_cache_hit`` and ``fxgraph_cache_miss`` (inductor
    graphs loaded from the cache / compiled), ``frames_compiled`` (Dynamo frames traced, recompiles included);
    {} when Dynamo was never imported (nothing compiled; importing it costs a second of CPU)."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    return {"fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
            "frames_compiled": int(counters["stats"]["unique_graphs"])}
