"""Learner checkpoints: everything a learner rank needs to continue the same version sequence.

Layout of one checkpoint directory (e.g. ``<run_dir>/ckpt/v000010/``, :func:`checkpoint_dir`):

    model/            LoRA: the PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``);
                      full: ``model.safetensors`` (every tensor, shared ones once) + ``config.json``
    optimizer.pt      ``optimizer.state_dict()`` (AdamW moments and step counts)
    scheduler.pt      ``scheduler.state_dict()`` (the LR schedule's position)
    rng-rank<r>.pt    rank r's torch CPU (and CUDA) generator states
    rng-rank<r>.json  rank r's python ``random`` and numpy generator states
    state.json        ``{"version", "finetune", "extra"}`` (extra: e.g. the running-mean baseline)
    config.json       the run's resolved configuration (``TrainConfig.to_json()``)

Rank 0 writes the shared files (every rank holds the same weights and optimizer state), each rank its
RNG files; the directory is written as ``.<name>.tmp`` and renamed into place by rank 0 after a barrier,
so a crash never leaves a half-written checkpoint under the final name. ``.pt`` files are read back with
``torch.load(weights_only=True)`` (tensors and plain containers only, no arbitrary unpickling).

Not here: the buffer's and actors' positions: the buffer rebuilds itself from its segment log and
each actor skips the prompts its logged groups used; ``distrl train --resume`` wires the three.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from distrl.learn.distributed import active
from distrl.learn.model import is_peft


def checkpoint_dir(run_dir: str | Path, version: int) -> Path:
    """``<run_dir>/ckpt/v<version:06d>``."""
    return Path(run_dir) / "ckpt" / f"v{version:06d}"


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``<run_dir>/ckpt/`` (temporary ones ignored), or None."""
    found = sorted(p for p in (Path(run_dir) / "ckpt").glob("v[0-9]*") if (p / "state.json").is_file())
    return found[-1] if found else None


def _rng_state() -> tuple[dict, dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    py = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    return tensors, plain


def _set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _save_model(model, directory: Path) -> None:
    if is_peft(model):
        model.save_pretrained(str(directory))
        return
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    save_model(model, str(directory / "model.safetensors"))
    model.config.save_pretrained(str(directory))


def _load_model(model, directory: Path) -> None:
    from safetensors.torch import load_file, load_model

    if is_peft(model):
        from peft.utils import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(str(directory / "adapter_model.safetensors")))
        if result.unexpected_keys:
            raise ValueError(f"checkpoint adapter at {directory} does not fit this model: unexpected keys "
                             f"{result.unexpected_keys[:4]}")
        return
    load_model(model, str(directory / "model.safetensors"), strict=True)


def save_checkpoint(directory: str | Path, model, optimizer: torch.optim.Optimizer, scheduler, version: int,
                    config_json: str, extra: Optional[dict[str, Any]] = None, rank: int = 0,
                    world_size: int = 1) -> Path:
    """Write a checkpoint of policy ``version`` to ``directory`` (see the module docstring); returns it.

    Every rank calls this (collectively when ``world_size > 1``). ``extra`` must be JSON-serializable.
    Raises FileExistsError if ``directory`` already exists.
    """
    final = Path(directory)
    tmp = final.with_name(f".{final.name}.tmp")
    if final.exists():
        raise FileExistsError(f"checkpoint {final} exists")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if active(world_size):
        dist.barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    tensors, plain = _rng_state()
    torch.save(tensors, tmp / f"rng-rank{rank}.pt")
    (tmp / f"rng-rank{rank}.json").write_text(json.dumps(plain))
    if rank == 0:
        _save_model(model, tmp / "model")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "config.json").write_text(config_json)
        finetune = "lora" if is_peft(model) else "full"
        (tmp / "state.json").write_text(json.dumps({"version": version, "finetune": finetune,
                                                    "extra": extra or {}}, indent=2))
    if active(world_size):
        dist.barrier()
    if rank == 0:
        tmp.rename(final)
    if active(world_size):
        dist.barrier()
    return final


def load_checkpoint(directory: str | Path, model, optimizer: torch.optim.Optimizer, scheduler,
                    rank: int = 0) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG from ``directory``.

    Returns ``{"version", "finetune", "extra", "config_json"}``. Raises FileNotFoundError if the
    checkpoint (or this rank's RNG file) is missing, ValueError if it was written for the other
    fine-tuning mode or its weights do not fit ``model``.
    """
    path = Path(directory)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (state.json missing)")
    state = json.loads((path / "state.json").read_text())
    mode = "lora" if is_peft(model) else "full"
    if state["finetune"] != mode:
        raise ValueError(f"checkpoint {path} holds {state['finetune']} weights, the model is set up for {mode}")
    rng_pt, rng_json = path / f"rng-rank{rank}.pt", path / f"rng-rank{rank}.json"
    if not rng_pt.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no RNG state of rank {rank} (written with fewer ranks?)")
    _load_model(model, path / "model")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(rng_pt, weights_only=True), json.loads(rng_json.read_text()))
    return {"version": int(state["version"]), "finetune": state["finetune"], "extra": state["extra"],
            "config_json": (path / "config.json").read_text()}
