"""The `distrl` command. Parses and validates flags before importing torch, vLLM or Ray.

Each subcommand is a config dataclass (its fields are the flags, their docstrings the help) and the
dotted path of the function that runs it, imported only after the flags are valid. `distrl --version` prints
the installed package's version (importlib.metadata).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import signal
import sys

import tyro

from distrl.cmd.config import BufferConfig, EvalConfig, LearnConfig, ReplayConfig, RolloutConfig, TrainConfig
from distrl.cmd.configfile import ConfigFileError, expand_config
from distrl.cmd.faults import RoleFailed, as_interrupted, raise_on_signals
from distrl.cmd.join import expand_join
from distrl.cmd.preflight import preflight
from distrl.core.compile_cache import use_bytecode_cache
from distrl.core.errors import BindError, NoProgress, PreflightError
from distrl.core.logs import quiet_libraries

# name -> (config class, "module:function" that takes the config)
COMMANDS: dict[str, tuple[type, str]] = {
    "train": (TrainConfig, "distrl.cmd.trainer:train"),
    "learn": (LearnConfig, "distrl.cmd.launch:run_learn"),
    "rollout": (RolloutConfig, "distrl.cmd.launch:run_rollout"),
    "buffer": (BufferConfig, "distrl.cmd.launch:run_buffer"),
    "replay": (ReplayConfig, "distrl.cmd.replay_sweep:replay_or_sweep"),
    "eval": (EvalConfig, "distrl.cmd.evaluate:run"),
}

# commands that take a --config file shared by a run's roles: other commands' keys are ignored (one line says which)
SHARED_CONFIG_FILE = ("learn", "rollout", "buffer")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `distrl <command> [flags]`; `--help` on any command lists every flag."""
    configs = {name: cls for name, (cls, _) in COMMANDS.items()}
    if (sys.argv[1:] if argv is None else list(argv))[:1] in (["--version"], ["-V"]):
        print(f"distrl {importlib.metadata.version('distrl')}")
        return 0
    use_bytecode_cache()  # the imports below and in children compile once (distrl.core.compile_cache)
    # no "Writing model shards" bar per published version (roles inherit it; set it to 0 to see them)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:  # --config FILE, then `rollout --join RUN`: their flags go before the command line's, so it wins
        argv = expand_config(sys.argv[1:] if argv is None else list(argv), configs, shared=SHARED_CONFIG_FILE)
        argv = expand_join(argv, RolloutConfig)
    except ConfigFileError as exc:
        print(f"distrl: error: {exc}", file=sys.stderr)
        return 2
    cfg = tyro.extras.subcommand_cli_from_dict(configs, args=argv, prog="distrl", use_underscores=True)
    name = next(n for n, (cls, _) in COMMANDS.items() if type(cfg) is cls)
    module, func = COMMANDS[name][1].split(":")
    quiet_libraries()  # known harmless library warnings, before any command imports torch (distrl.core.logs)
    raise_on_signals()  # SIGINT/SIGTERM: each command cleans up, then we exit with 128 + the signal number
    if name == "buffer" and cfg.prefault_bytes:  # before pyarrow starts a thread (distrl.buffer.memory)
        from distrl.buffer.memory import single_arena

        single_arena()
    try:
        if getattr(cfg, "model", None):  # --model FILE.gguf -> its cached dequantized directory (distrl.core.gguf)
            from distrl.core.gguf import resolve_model

            cfg.model = resolve_model(cfg.model)
        preflight(name, cfg)  # before Ray, the buffer, any engine or the run directory (docs/troubleshooting.md)
        getattr(importlib.import_module(module), func)(cfg)
    except (FileExistsError, FileNotFoundError, PreflightError, BindError) as exc:
        print(f"distrl {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Interrupted, or what Ray or C code made of it
        signum = as_interrupted(exc).signum
        print(f"distrl {name}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except RoleFailed as exc:  # a role raised, died or is stuck: its error, shortened, and its log file
        print(f"distrl {name}: error: {exc}", file=sys.stderr)
        return 1
    except NoProgress as exc:  # raised here, or in a role (Ray's RayTaskError is a subclass; .cause holds it)
        print(f"distrl {name}: error: {getattr(exc, 'cause', exc)}", file=sys.stderr)
        return 1
    return 0

