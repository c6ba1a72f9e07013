"""Weights on disk for engines: safetensors iteration, and a LoRA adapter merged into base weights.

``merged_weights`` streams a model's checkpoint tensors, replacing each LoRA-targeted linear weight
``W`` (out, in) by ``W + (alpha / r) * B @ A`` (B (out, r), A (r, in); ``alpha / sqrt(r)`` with
rsLoRA), computed in fp32 and cast back to the checkpoint's dtype. Engines without LoRA support load
the result as full weights (``--merge_lora``). The base is always re-read from the model's files, so
merging version v+1 never compounds on version v.

Checkpoints are read by :func:`read_safetensors`, not by ``safetensors``' ``framework="pt"`` loader:
that one (0.8.0) leaks two Python objects (~56 bytes) per tensor read, which an actor loading every
policy version accumulates without bound (~1.4 KB per version of the tiny model).
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Iterator

import torch

# PEFT's saved key of a LoRA factor: [base_model.model.]<module>.lora_{A,B}[.<adapter>].weight
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def local_model_dir(model: str | Path) -> Path:
    """The local directory of ``model``: itself when it is a directory, else its hub snapshot.

    Raises an ``huggingface_hub`` error when a hub id is not cached and cannot be downloaded.
    """
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.safetensors", "*.json"]))


def weight_files(directory: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory, sorted. Raises FileNotFoundError if none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    return files


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every safetensors file in ``directory`` (on CPU)."""
    for file in weight_files(directory):
        yield from read_safetensors(file)


# safetensors dtype names (the format's spec) -> torch dtypes; float8 ones only where torch has them
_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U16", "uint16"),
    ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2")) if hasattr(torch, attr)}


def read_safetensors(file: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each tensor of one ``.safetensors`` file, in file order, on CPU.

    The format: an 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
    data_offsets: [begin, end]}}`` (offsets into the data that follows; ``__metadata__`` skipped), then
    the data. Each tensor is read straight into its own new tensor (one tensor in memory at a time),
    with no Python object left behind (unlike ``safe_open(framework="pt")``, see the module docstring).

    Raises ValueError: a truncated file, an unknown dtype, or offsets that do not match the shape.
    """
    with open(file, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
        base = 8 + size
        entries = sorted((v["data_offsets"][0], k, v) for k, v in header.items() if k != "__metadata__")
        for begin, name, info in entries:
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which this reader does not know")
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            raw = tensor.reshape(-1).view(torch.uint8).numpy()  # (bytes,) writable view of the tensor
            if info["data_offsets"][1] - begin != raw.nbytes:
                raise ValueError(f"{file}: tensor {name} {info['dtype']}{info['shape']} has "
                                 f"{info['data_offsets'][1] - begin} bytes, expected {raw.nbytes}")
            fh.seek(base + begin)
            if raw.nbytes and fh.readinto(raw) != raw.nbytes:
                raise ValueError(f"{file}: truncated at tensor {name}")
            yield name, tensor


def checkpoint_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of a safetensors checkpoint directory, read from headers only."""
    from safetensors import safe_open

    shapes = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def read_lora(adapter_dir: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float, bool]:
    """Read a PEFT LoRA adapter: ``({base weight name: (A (r, in), B (out, r))}, scale, fan_in_fan_out)``.

    Raises:
        ValueError: an adapter this merge does not support (DoRA, per-module rank or alpha patterns,
            ``modules_to_save``, embedding LoRA or any other non-LoRA-factor tensor), or a module with
            only one of its two factors.
    """
    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise ValueError(f"adapter {adapter_dir} sets {key}={cfg[key]!r}: merging supports plain LoRA only")
    r = int(cfg["r"])
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_safetensors(adapter_dir):
        m = _LORA_KEY.match(name)
        if m is None:
            raise ValueError(f"adapter {adapter_dir} holds {name!r}, not a LoRA factor: cannot merge it")
        factors.setdefault(m["module"] + ".weight", {})[m["ab"]] = tensor
    pairs = {}
    for weight, ab in factors.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {adapter_dir}: {weight} has lora_{''.join(ab)} but not both factors")
        pairs[weight] = (ab["A"], ab["B"])
    return pairs, scale, bool(cfg.get("fan_in_fan_out"))


def merged_weights(base_dir: str | Path, adapter_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every checkpoint tensor of ``base_dir``, with the adapter's LoRA merged where it applies.

    Args:
        base_dir: the base model's checkpoint directory (safetensors).
        adapter_dir: a PEFT LoRA adapter directory saved for that model.
    Raises (before yielding anything):
        ValueError: an unsupported adapter (see :func:`read_lora`), or an adapted module whose weight
            is not in the base checkpoint.
    """
    pairs, scale, transpose = read_lora(adapter_dir)
    missing = sorted(set(pairs) - set(checkpoint_shapes(base_dir)))
    if missing:
        raise ValueError(f"adapter {adapter_dir} adapts {missing[:3]}... not found in the base weights {base_dir}")
    return _merge(iter_safetensors(base_dir), pairs, scale, transpose)


def _merge(base: Iterator[tuple[str, torch.Tensor]], pairs, scale: float, transpose: bool):
    for name, weight in base:
        if name in pairs:
            a, b = pairs[name]
            delta = scale * (b.float() @ a.float())  # (out, r) @ (r, in) -> (out, in)
            weight = (weight.float() + (delta.T if transpose else delta)).to(weight.dtype)
        yield name, weight
