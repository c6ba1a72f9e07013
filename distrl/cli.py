"""The `distrl` command. Parses and validates flags before importing torch, vLLM or Ray."""

from __future__ import annotations

import sys

import tyro

from distrl.config import TrainConfig

COMMANDS = {"train": TrainConfig}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `distrl <command> [flags]`; `--help` on any command lists every flag."""
    cfg = tyro.extras.subcommand_cli_from_dict(COMMANDS, args=argv, prog="distrl", use_underscores=True)
    if isinstance(cfg, TrainConfig):
        from distrl.trainer import train

        try:
            train(cfg)
        except FileExistsError as exc:
            print(f"distrl train: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
