"""The `distrl` command. Parses and validates flags before importing torch, vLLM or Ray.

Each subcommand is a config dataclass (its fields are the flags, their docstrings the help) and the
dotted path of the function that runs it, imported only after the flags are valid.
"""

from __future__ import annotations

import importlib
import sys

import tyro

from distrl.config import BufferConfig, LearnConfig, ReplayConfig, RolloutConfig, TrainConfig

# name -> (config class, "module:function" that takes the config)
COMMANDS: dict[str, tuple[type, str]] = {
    "train": (TrainConfig, "distrl.trainer:train"),
    "learn": (LearnConfig, "distrl.launch:run_learn"),
    "rollout": (RolloutConfig, "distrl.launch:run_rollout"),
    "buffer": (BufferConfig, "buffer.launch:run"),
    "replay": (ReplayConfig, "distrl.replay:replay"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `distrl <command> [flags]`; `--help` on any command lists every flag."""
    configs = {name: cls for name, (cls, _) in COMMANDS.items()}
    cfg = tyro.extras.subcommand_cli_from_dict(configs, args=argv, prog="distrl", use_underscores=True)
    name = next(n for n, (cls, _) in COMMANDS.items() if type(cfg) is cls)
    module, func = COMMANDS[name][1].split(":")
    try:
        getattr(importlib.import_module(module), func)(cfg)
    except (FileExistsError, FileNotFoundError) as exc:
        print(f"distrl {name}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
