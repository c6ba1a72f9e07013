"""A `distrl train` run directory (``<log_dir>/<run_name>/``, its layout in docs/reference.md "Where things go"):
made with its ``config.json``, resumed from it, the weights it started from and its newest learner checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from distrl.cmd.assemble import resolve_model
from distrl.cmd.config import TrainConfig


def prepare_run_dir(cfg: TrainConfig) -> tuple[Path, str]:
    """Create the run directory, write the resolved config, build the tiny model if asked.

    Returns (run_dir, model_dir). Raises FileExistsError if the run directory exists.
    """
    run_dir = cfg.run_dir
    if run_dir.exists():
        raise FileExistsError(f"run directory {run_dir} exists: pick another --run_name or remove it")
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    return run_dir, resolve_model(cfg.model, run_dir, cfg.seed)


def resumed_config(cfg: TrainConfig) -> TrainConfig:
    """`--resume <run_dir>`: the run's saved config with this command's --max_steps (and resume set); writes
    nothing. A backend saved as "unsloth" resumes as "auto" (runs before --backend auto stored Unsloth, the
    default then, whether or not it worked on this host). Raises FileNotFoundError if the directory holds no
    config.json."""
    run_dir = Path(cfg.resume).resolve()
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.json there (not a distrl run directory)")
    saved = json.loads((run_dir / "config.json").read_text())
    saved.update(max_steps=cfg.max_steps, resume=str(run_dir), log_dir=str(run_dir.parent), run_name=run_dir.name)
    if saved.get("backend") == "unsloth":
        saved["backend"] = "auto"
    return TrainConfig(**saved)


def resume_run_dir(cfg: TrainConfig) -> tuple[Path, str]:
    """Write a resumed run's config (:func:`resumed_config`, settled) into its directory.

    Returns (run_dir, model_dir)."""
    run_dir = cfg.run_dir
    (run_dir / "config.json").write_text(cfg.to_json())
    return run_dir, base_model_dir(run_dir, cfg.model)


def base_model_dir(run_dir: str | Path, model: str) -> str:
    """The weights run ``run_dir`` started from (its policy version 0), given its ``--model``: its
    ``warm_start/`` after ``--warm_start_steps``, else its built ``model/`` for ``tiny``, else ``model`` (a
    hub id or directory). `distrl train --resume` and `distrl replay` both start from it."""
    run_dir = Path(run_dir)
    if (run_dir / "warm_start" / "config.json").is_file():  # --warm_start_steps: the run's base model
        return str(run_dir / "warm_start")
    return resolve_model(model, run_dir)


def checkpoint_version(run_dir: Path) -> int:
    """Version of the newest complete learner checkpoint under `<run_dir>/ckpt/` (0: none); the buffer
    rolls back selections made after it (distrl.learn.checkpoint writes `state.json` last, then renames)."""
    states = sorted((run_dir / "ckpt").glob("v[0-9]*/state.json"))
    return json.loads(states[-1].read_text())["version"] if states else 0
