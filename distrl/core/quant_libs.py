"""Keep the quantization libraries out of a process that loads no quantized weights.

bitsandbytes and torchao come installed as Unsloth's dependencies, and other libraries import them whenever they
are installed: ``peft.helpers`` imports bitsandbytes unconditionally (``import peft`` does), and transformers' model
code imports torchao's safetensors support. Both register kernels and ops as they load: about 1.5 s of CPU in each
role process on a 2-core machine (``python -X importtime``), and a learner or actor that loads an unquantized model
without Unsloth and without 4-bit never calls them.

:func:`skip_quantization_libraries` makes them unimportable in such a process: ``import bitsandbytes`` raises
ImportError and ``importlib.util.find_spec`` answers None, which is how peft (``is_bnb_available``) and transformers
(``is_torchao_available``) look for them, so both go on without them. It must run before transformers or peft
has looked (both cache the answer); once either is imported it changes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QUANTIZATION_LIBRARIES = ("bitsandbytes", "torchao")
# libraries that cache whether the ones above are installed: once imported, the answer stands
_ASKERS = ("transformers", "peft", "vllm", "unsloth")


def quantized(model_dir: str | Path) -> bool:
    """True when ``<model_dir>/config.json`` declares a ``quantization_config`` (a pre-quantized checkpoint), or
    when there is no readable config.json there (a hub name: not known here, so assumed quantized)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return True
    return "quantization_config" in config


def skip_quantization_libraries(model_dir: str | Path, *, unsloth: bool = False, load_in_4bit: bool = False) -> bool:
    """Make :data:`QUANTIZATION_LIBRARIES` unimportable in this process when it loads ``model_dir`` unquantized
    (not :func:`quantized`) without Unsloth (``unsloth``: the learner's settled backend is ``unsloth``) and without
    ``load_in_4bit``, and none of them, nor a library that looks for them, is imported yet.

    Returns True when it did (the caller may log it), False when it left the process as it was."""
    if unsloth or load_in_4bit or any(name in sys.modules for name in QUANTIZATION_LIBRARIES + _ASKERS):
        return False
    if quantized(model_dir):
        return False
    for name in QUANTIZATION_LIBRARIES:
        sys.modules[name] = None  # the import system's "not importable" marker
    return True
