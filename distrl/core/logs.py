"""Where each process's log lines go, and the one place known harmless library warnings are silenced.

* **Roles of `distrl train`** (Ray workers) write to ``<run_dir>/logs/<role>.log`` only
  (:func:`role_logging`): their Python logging, and their stdout/stderr redirected at the
  file-descriptor level, so library prints, ``warnings`` and C/C++ messages land in the same file.
  Ray forwards nothing to the driver (``log_to_driver=False`` in ``distrl.cmd.trainer``): the terminal
  shows the driver alone (start-up lines, the live view or progress lines, errors).
* **The driver and the separate launchers** (`distrl learn|rollout|buffer|replay`): INFO on stderr
  and in their log file (:func:`setup_logging`). While the live view stands, the driver's stderr
  shows WARNING and above only (:func:`set_stderr_level`).
* **Known harmless library messages** (:func:`quiet_libraries`, called by every process at start-up):
  torchao's "Failed to load ... _C_*.so" (optional CUDA kernels) and "Detected no triton", torch's
  pytree "Enum subclass ... register_constant()" deprecation, Ray's deprecation of the API its own
  ``was_current_actor_reconstructed`` uses, torch's ``reduce_op`` deprecation that vLLM's scan of
  torch's attributes triggers, tensorboard's INFO lines. Each is silenced at its logger
  or by a warnings filter; vLLM-CPU's "doesn't allow to use `torch.set_num_threads`" (at every
  generate call) is shown once.
* **Ray's pushed errors**: the messages the cluster pushes to the driver (a task to be retried, with the
  role's traceback; a worker that died), dozens of lines each, go to the driver's log file only
  (:func:`ray_errors_to_log`); the role's own error reaches the terminal as ``distrl.cmd.faults.RoleFailed``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# logger -> the level below which its records are dropped (what each says is harmless here)
QUIET_LOGGERS = {
    "torchao": logging.ERROR,  # "Failed to load .../_C_cutlass_90a.abi3.so" (kernels for other GPUs/Pythons)
    "torchao.kernel.intmm": logging.ERROR,  # "Detected no triton" (CPU machines)
    "torch.utils._pytree": logging.ERROR,  # torchao's Enum register_constant(): a deprecation for torchao
    "tensorboard": logging.WARNING,  # "No path found after <events file>" at every read of a growing file
}
# logger -> message starts shown once per process (the first one only): repeated at every call
ONCE = {
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),  # each generate
}
RAY_PUSHED = "distrl.ray_pushed"  # logger of the messages Ray pushes to the driver: log file only
# (message regex, category): warnings shown never
QUIET_WARNINGS = [
    ("This API is deprecated and may be removed in future Ray releases", DeprecationWarning),
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning),  # vLLM's scan of torch's attributes
]


class _Once(logging.Filter):
    """Pass the first record whose message starts with one of ``starts``, drop its repeats."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts, self.seen = starts, set()

    def filter(self, record: logging.LogRecord) -> bool:
        start = next((s for s in self.starts if record.getMessage().startswith(s)), None)
        if start is None or start not in self.seen:
            self.seen.add(start)
            return True
        return False


def quiet_libraries() -> None:
    """Silence the known harmless library messages listed in the module docstring (idempotent)."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for name, starts in ONCE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Once) for f in logger.filters):
            logger.addFilter(_Once(starts))
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


class _Stderr(logging.StreamHandler):
    """A StreamHandler that writes to whatever ``sys.stderr`` is now (the live view redirects it, so
    a driver's warning is printed above the view rather than through it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.addFilter(lambda record: not record.name.startswith(RAY_PUSHED))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(log_file: Path | None = None, stderr: bool = True) -> None:
    """INFO to stderr (unless ``stderr`` is False) and, if given, to ``log_file`` (its folder made).

    Also calls :func:`quiet_libraries`. Replaces any handlers the root logger had.
    """
    quiet_libraries()
    handlers: list[logging.Handler] = [_Stderr()] if stderr else []
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=handlers, force=True)


def set_stderr_level(level: int) -> None:
    """Show only records at ``level`` or above on stderr (the log file keeps every INFO line)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _Stderr):
            handler.setLevel(level)


def redirect_output(log_file: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at ``log_file`` (appending),
    so whatever a library prints, from Python or C, goes there rather than to a terminal."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def role_logging(log_file: Path) -> None:
    """A role of `distrl train`: everything it logs or prints goes to ``log_file`` and nowhere else."""
    redirect_output(log_file)
    setup_logging(log_file, stderr=False)


def ray_errors_to_log() -> None:
    """Log the error messages Ray pushes to this driver (``ray._private.worker.print_to_stdstream``,
    which with ``log_to_driver=False`` prints only those, on stdout) under :data:`RAY_PUSHED`: the
    driver's log file keeps them whole, the terminal shows none (idempotent; after ``ray.init``)."""
    import ray._private.worker as ray_worker

    pushed = logging.getLogger(RAY_PUSHED)

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            pushed.warning("(%s) %s", data.get("pid", "ray"), line)

    ray_worker.print_to_stdstream = to_log
