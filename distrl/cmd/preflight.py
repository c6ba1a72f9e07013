"""Preflight: every launcher checks what it cheaply can after its flags parse and before Ray, the buffer,
any engine or a run directory starts (`distrl.cmd.cli.main` calls :func:`preflight`).

The checks live with the roles that need them (`distrl/rollout/preflight.py`, `distrl/learn/preflight.py`,
`distrl/buffer/preflight.py`); this module says which run for each command and adds the commands' own
(`--resume` of `distrl train`, the run directory, a replay's segment log). A failure is a
:class:`distrl.core.errors.PreflightError`: the cli prints its two lines and exits 2, nothing started,
nothing written. Imports stay light: no torch model, no vLLM, no Ray (transformers' AutoConfig and
AutoTokenizer only when --tokenizer is given). docs/troubleshooting.md lists every message.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

from distrl.core.errors import PreflightError

# What `distrl train --resume` keeps from the command line; the rest comes from the run's config.json.
RESUME_KEEPS = ("resume", "max_steps", "config", "log_dir", "run_name")


def dropped_by_resume(cfg, saved: dict) -> list[str]:
    """Flags of ``cfg`` that `--resume` would ignore: given (not the config class's default, after its own
    resolution) and different from the run's saved value, except those of RESUME_KEEPS."""
    defaults = type(cfg)()
    dropped = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in RESUME_KEEPS or value == getattr(defaults, f.name):
            continue
        if f.name in saved and json.loads(json.dumps(value)) == saved[f.name]:  # tuples are lists in JSON
            continue
        dropped.append(f"--{f.name}")
    return dropped


def check_resume(cfg) -> None:
    """`distrl train --resume RUN`: RUN holds config.json, and no other flag than --max_steps is given."""
    run_dir = Path(cfg.resume).expanduser()
    if not (run_dir / "config.json").is_file():
        raise PreflightError("--resume", f"{cfg.resume}: no config.json there (not a distrl run directory)",
                             "give the directory of a run that distrl train started (<log_dir>/<run_name>)")
    dropped = dropped_by_resume(cfg, json.loads((run_dir / "config.json").read_text()))
    if dropped:
        flags = " ".join(dropped)
        raise PreflightError("--resume", f"would ignore {flags} (a resumed run keeps its config)",
                             "drop them (only --max_steps may change), or start a new run with them")


def check_new_run(cfg) -> None:
    """`distrl train`: the run directory does not exist yet (it is created only once the checks pass)."""
    if cfg.run_dir.exists():
        raise PreflightError("--run_name", f"run directory {cfg.run_dir} exists",
                             "pick another --run_name (or --log_dir), remove that directory, or continue it "
                             "with --resume")


def check_train(cfg) -> None:
    """`distrl train`: a resumed run is checked as resumed (its own config ran before); a new one as the
    learners and actors it starts would check it."""
    from distrl.learn import preflight as learn
    from distrl.rollout import preflight as rollout

    if cfg.resume:
        check_resume(cfg)
        return
    check_new_run(cfg)
    learn.check(cfg)
    rollout.check_inputs(cfg)


def check_eval(cfg) -> None:
    """`distrl eval`: model, tokenizer, dataset and task, temperature, prompts' length."""
    from distrl.rollout import preflight as rollout

    rollout.check_sources(cfg.model, cfg.tokenizer)
    rollout.check_dataset(cfg.task, cfg.dataset)
    rollout.check_temperature(cfg.engine, cfg.sampling_temperature)
    rollout.check_prompts(cfg)


def check_replay(cfg) -> None:
    """`distrl replay SOURCE`: SOURCE holds a segment log; --model, when given, resolves."""
    from distrl.buffer.segments import segment_paths
    from distrl.core.hub import check_model

    if not segment_paths(cfg.source):
        raise PreflightError("SOURCE", f"{cfg.source}: no segment log (segments/segment-*.arrow)",
                             "give the run directory of a distrl train or distrl buffer run that put groups")
    if cfg.model is not None:
        check_model(cfg.model)


def _learn(cfg) -> None:
    from distrl.learn import preflight

    preflight.check(cfg)


def _rollout(cfg) -> None:
    from distrl.rollout import preflight

    preflight.check(cfg)


def _buffer(cfg) -> None:
    from distrl.buffer import preflight

    preflight.check(cfg)


CHECKS: dict[str, Callable] = {"train": check_train, "learn": _learn, "rollout": _rollout, "buffer": _buffer,
                               "eval": check_eval, "replay": check_replay}


def preflight(command: str, cfg) -> None:
    """Run the checks of ``command`` (a key of `distrl.cmd.cli.COMMANDS`) on its parsed config.

    Raises PreflightError (flag, problem, fix) on the first failure.
    """
    CHECKS[command](cfg)
