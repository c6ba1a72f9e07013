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

import json
import math
import re
import socket
from pathlib import Path
from typing import Callable

from distrl.cmd.compose import flat_fields
from distrl.core.errors import PreflightError

# ZeroMQ endpoints given by flag: tcp://HOST:PORT (PORT 0-65535, or *), ipc://PATH or inproc://NAME
ZMQ_ADDRESS_FLAGS = ("address", "buffer_address", "weights_pub_bind", "weights_endpoint_bind", "weights_pub",
                     "weights_endpoint")
ZMQ_ADDRESS = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\*|\d{1,5})|(?:ipc|inproc)://\S+")
PORT_FLAGS = ("weights_broadcast_port",)
RAY_CONNECT_TIMEOUT_S = 10.0
# What `distrl train --resume` keeps from the command line; the rest comes from the run's config.json.
RESUME_KEEPS = ("resume", "max_steps", "config", "log_dir", "run_name")


def dropped_by_resume(cfg, saved: dict) -> list[str]:
    """Flags of ``cfg`` that `--resume` would ignore: given (not the config class's default, after its own
    resolution) and different from the run's saved value, except those of RESUME_KEEPS."""
    defaults = type(cfg)()
    dropped = []
    for f in flat_fields(cfg):
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
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PreflightError("--resume", f"{cfg.resume}/config.json cannot be read ({exc})",
                             "restore the file distrl train wrote there, or start a new run") from None
    unknown = sorted(set(saved) - {f.name for f in flat_fields(cfg)}) if isinstance(saved, dict) else None
    if unknown is None or unknown:
        raise PreflightError("--resume", f"{cfg.resume}/config.json is not a run's config (unknown keys: {unknown})",
                             "restore the file distrl train wrote there, or start a new run")
    dropped = dropped_by_resume(cfg, saved)
    if dropped:
        flags = " ".join(dropped)
        raise PreflightError("--resume", f"would ignore {flags} (a resumed run keeps its config)",
                             "drop them (only --max_steps may change), or start a new run with them")


def check_flags(cfg) -> None:
    """Every command: each float flag is a finite number (no range check of a role lets ``inf`` work), each
    ZeroMQ address flag is ``tcp://HOST:PORT`` with a port of at most 65535, ``ipc://`` or ``inproc://``,
    and each port flag is a port."""
    for f in flat_fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise PreflightError(f"--{f.name}", f"{value} is not a finite number",
                                 "give a finite value (`distrl <command> --help` says what it means)")
        if f.name in ZMQ_ADDRESS_FLAGS:
            match = ZMQ_ADDRESS.fullmatch(value)
            if not match or (match["port"] not in (None, "*") and int(match["port"]) > 65535):
                raise PreflightError(f"--{f.name}", f"{value!r} is not a ZeroMQ address with a valid port",
                                     "give tcp://HOST:PORT (PORT 1-65535; 0 or * picks a free one where it binds), "
                                     "ipc://PATH or inproc://NAME")
        if f.name in PORT_FLAGS and not 0 <= value <= 65535:
            raise PreflightError(f"--{f.name}", f"{value} is not a TCP port", "give a port from 1 to 65535")


def check_ray_address(address: str | None) -> None:
    """`distrl train --ray_address HOST:PORT`: something accepts a TCP connection there within
    RAY_CONNECT_TIMEOUT_S (Ray itself retries an unreachable address for minutes). ``auto``, ``local`` and
    ``ray://`` client addresses are left to Ray."""
    if not address or address in ("auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise PreflightError("--ray_address", f"{address!r} is not HOST:PORT",
                             "give the head node's GCS address, e.g. 10.0.0.1:6379, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise PreflightError("--ray_address", f"nothing answers at {address} ({exc})",
                             "start the head there (`ray start --head`), check the address, or leave "
                             "--ray_address unset to start a local cluster") from None


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

    check_ray_address(cfg.ray_address)
    if cfg.resume:
        from distrl.buffer.preflight import check_unlocked

        check_unlocked("--resume", Path(cfg.resume).expanduser())  # a buffer (or a run's replica) holds it
        check_resume(cfg)
        return
    check_new_run(cfg)
    learn.check(cfg.shared)
    rollout.check_inputs(cfg.prompt, cfg.generation, cfg.rollout, cfg.shared)


def check_eval(cfg) -> None:
    """`distrl eval`: model, tokenizer, dataset and task, temperature, prompts' length."""
    from distrl.rollout import preflight as rollout
    from distrl.rollout.prompt_fit import PromptSource

    rollout.check_sources(cfg.model, cfg.tokenizer)
    rollout.check_dataset(cfg.task, cfg.dataset)
    rollout.check_temperature(cfg.engine, cfg.sampling_temperature)
    rollout.check_prompts(PromptSource(cfg.prompt, cfg.model, cfg.tokenizer, cfg.seed, cfg.max_model_len,
                                       cfg.max_new_tokens, split=cfg.split, limit=cfg.limit))


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

    preflight.check(cfg.shared)


def _rollout(cfg) -> None:
    from distrl.rollout import preflight

    preflight.check(cfg.prompt, cfg.generation, cfg.rollout, cfg.shared)


def _buffer(cfg) -> None:
    from distrl.buffer import preflight

    preflight.check(cfg.endpoint)


CHECKS: dict[str, Callable] = {"train": check_train, "learn": _learn, "rollout": _rollout, "buffer": _buffer,
                               "eval": check_eval, "replay": check_replay}


def preflight(command: str, cfg) -> None:
    """Run the checks of ``command`` (a key of `distrl.cmd.cli.COMMANDS`) on its parsed config.

    Raises PreflightError (flag, problem, fix) on the first failure.
    """
    check_flags(cfg)
    CHECKS[command](cfg)
