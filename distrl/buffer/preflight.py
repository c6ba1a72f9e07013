"""The buffer's preflight (`distrl buffer`): its run directory, checked before it binds or writes.

A new buffer's ``--run_dir`` must hold no segment log (the server would refuse it after binding);
``--resume`` must name a directory where a buffer ran (its ``segments/``). Each failure is a
:class:`distrl.core.errors.PreflightError` naming the flag (docs/troubleshooting.md).
"""

from __future__ import annotations

from pathlib import Path

from distrl.buffer.segments import segment_paths
from distrl.core.errors import PreflightError


def check(cfg) -> None:
    """A BufferConfig's --run_dir / --resume (their existence is checked when the flags parse)."""
    run_dir = Path(cfg.run_dir)
    if cfg.resume is not None:
        if not (run_dir / "segments").is_dir() and not segment_paths(run_dir):
            raise PreflightError("--resume", f"{cfg.resume}: no segment log there (segments/)",
                                 "give the --run_dir of a buffer that ran, or start a new buffer with --run_dir")
    elif run_dir.is_dir() and segment_paths(run_dir):
        raise PreflightError("--run_dir", f"{cfg.run_dir} already holds a segment log",
                             f"continue it with --resume {cfg.run_dir}, or give a new --run_dir")
