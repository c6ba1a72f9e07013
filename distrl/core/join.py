"""The join file of a running run: what `distrl rollout --join` reads to add an actor.

`distrl train`'s driver (and `distrl buffer`) write ``<run_dir>/join.json`` once the run's endpoints are bound:
a JSON object with ``run_dir``, ``first_id`` (actor ids below it belong to the launcher's own actors),
``config`` (the options an actor needs, by flag name: the buffer's and weight endpoints' addresses, the
weight transport, model, task and sampling) and, when the run's endpoints are CURVE-authenticated with keys
made in memory (`distrl train` off loopback), ``keys``: the buffer's and weight endpoints' public keys and
the run's client key pair (Z85 strings). That is a secret: the file is written with mode 0600 (owner only),
and anyone who can read it can join the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

JOIN_FILE = "join.json"


def write_join_file(run_dir: str | os.PathLike, info: dict) -> Path:
    """Write ``info`` (JSON-serializable) as ``<run_dir>/join.json``, mode 0600, atomically; returns its path."""
    path = Path(run_dir) / JOIN_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info, indent=2, sort_keys=True))
    os.chmod(tmp, 0o600)  # an older file of that name keeps its mode through O_TRUNC
    os.replace(tmp, path)
    return path


def join_file_path(where: str | os.PathLike) -> Path:
    """The join file ``where`` names: the file itself, or ``join.json`` in a run directory."""
    path = Path(where).expanduser()
    return (path / JOIN_FILE if path.is_dir() else path).resolve()


def read_join_file(where: str | os.PathLike) -> dict:
    """The join file's contents (``where``: the file or its run directory). Raises ValueError naming what to
    give when there is none, or when it is not a join file (a bad flag: the command line says so)."""
    path = join_file_path(where)
    if not path.is_file():
        raise ValueError(f"--join {where}: no {JOIN_FILE} there (`distrl train` and `distrl buffer` write "
                                f"it into their run directory once the run's endpoints are up; copy it to "
                                f"this host if the run directory is not shared)")
    info = json.loads(path.read_text())
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
        raise ValueError(f"--join {path}: not a distrl join file (no 'config' object)")
    return info
