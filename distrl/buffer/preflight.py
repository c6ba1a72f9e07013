"""The buffer's preflight (`distrl buffer`): its run directory, checked before it binds or writes.

A new buffer's ``--run_dir`` must hold no segment log (the server would refuse it after binding);
``--resume`` must name a directory where a buffer ran (its ``segments/``); no other process may hold its lock
(:func:`check_unlocked`: one buffer per run directory, also checked by `distrl train --resume`). Each failure is a
:class:`distrl.core.errors.PreflightError` naming the flag (docs/troubleshooting.md).
"""

from __future__ import annotations

from pathlib import Path

from distrl.buffer.config import BufferEndpoint
from distrl.buffer.lock import holder
from distrl.buffer.segments import segment_paths
from distrl.core.errors import PreflightError


def check_unlocked(flag: str, run_dir: str | Path) -> None:
    """No process holds ``run_dir``'s buffer lock (:mod:`distrl.buffer.lock`): one buffer per run directory."""
    held = holder(run_dir) if Path(run_dir).is_dir() else None
    if held is not None:
        who = f"pid {held.get('pid', '?')} on host {held.get('host', '?')}"
        raise PreflightError(f"{flag}", f"{run_dir} is in use by {held.get('role', 'a buffer')} ({who})",
                             "stop that process first (its buffer.json says where it serves), or give another "
                             "run directory")


def check(cfg: BufferEndpoint) -> None:
    """`distrl buffer`'s --run_dir / --resume (their existence is checked when the flags parse)."""
    run_dir = Path(cfg.run_dir)
    check_unlocked("--resume" if cfg.resume is not None else "--run_dir", run_dir)
    if cfg.resume is not None:
        if not (run_dir / "segments").is_dir() and not segment_paths(run_dir) and cfg.replica is None:
            raise PreflightError("--resume", f"{cfg.resume}: no segment log there (segments/)",
                                 "give the --run_dir of a buffer that ran, or start a new buffer with --run_dir")
    elif run_dir.is_dir() and segment_paths(run_dir):
        raise PreflightError("--run_dir", f"{cfg.run_dir} already holds a segment log",
                             f"continue it with --resume {cfg.run_dir}, or give a new --run_dir")
