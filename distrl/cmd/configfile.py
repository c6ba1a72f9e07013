"""`--config run.yaml|run.toml`: flags from a file, overridden by the command line.

The file is a mapping whose keys are the command's flag names (snake_case, without `--`) and whose
values are what the flag takes: a string, a number, a boolean, null (`None`), or a list for a flag
that takes several values. :func:`expand_config` turns it into flag tokens placed *before* the
command line's own flags; the parser keeps the last value of a flag, so the command line wins, and
every value is parsed and validated exactly as if it had been typed. The file's path stays in the
resolved config (`config` in `<run_dir>/config.json`).

One file may serve every role of a run (docs/multihost.md): for the commands given as ``shared`` (`distrl
learn|rollout|buffer`), a key that is a flag of another command is left out, and one line on stderr names
those keys. A key no command knows is an error everywhere.

Raises :class:`ConfigFileError` (a ValueError) for a missing file, another extension, a document
that is not a mapping, a key that is not a flag of the command (naming key and file), or a value of
another shape (a nested mapping).
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from pathlib import Path
from typing import Any

SUFFIXES = (".yaml", ".yml", ".toml")


class ConfigFileError(ValueError):
    """A --config file that cannot be used; the text names the file (and the key)."""


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in ``path`` (YAML for .yaml/.yml, TOML for .toml); raises ConfigFileError."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ConfigFileError(f"--config {path}: the file must end in .yaml, .yml or .toml")
    if not path.is_file():
        raise ConfigFileError(f"--config {path}: no such file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # the parsers' own errors say where: pass them on with the file name
        raise ConfigFileError(f"--config {path}: cannot parse it: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, got "
                              f"{type(data).__name__}")
    return data


def flag_tokens(data: dict[str, Any], config_class: type, path: str | Path) -> list[str]:
    """Flag tokens for ``data``'s keys, checked against ``config_class``'s fields; raises ConfigFileError."""
    names = {f.name for f in dataclasses.fields(config_class)}
    tokens: list[str] = []
    for key, value in data.items():
        if key not in names or key == "config":
            raise ConfigFileError(f"--config {path}: unknown key {key!r} (not a flag of this command; "
                                  f"see --help for the flag names)")
        if isinstance(value, bool):
            tokens.append(f"--{key}" if value else f"--no_{key}")
        elif value is None:
            tokens.append(f"--{key}=None")
        elif isinstance(value, (list, tuple)):
            tokens += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            raise ConfigFileError(f"--config {path}: key {key!r} holds a mapping; flags take plain values")
        else:
            tokens.append(f"--{key}={value}")
    return tokens


def other_commands_keys(data: dict[str, Any], command: str, configs: dict[str, type]) -> list[str]:
    """The keys of ``data`` that are not flags of ``command`` but are flags of another command of ``configs``."""
    own = {f.name for f in dataclasses.fields(configs[command])}
    others = {f.name for name, cls in configs.items() if name != command for f in dataclasses.fields(cls)}
    return [key for key in data if key not in own and key in others]


def expand_config(argv: list[str], configs: dict[str, type], shared: tuple[str, ...] = ()) -> list[str]:
    """``argv`` (``[command, flags...]``) with the flags of its ``--config FILE`` inserted after the command.

    ``configs`` maps command names to their config classes; a command whose class has no ``config``
    field is left alone (its parser then rejects --config). Only the last --config counts. For a command
    in ``shared``, the file's keys that only other commands take are left out, named on one stderr line.
    """
    if not argv or argv[0] not in configs or "config" not in {f.name for f in dataclasses.fields(configs[argv[0]])}:
        return argv
    path = None
    for i, token in enumerate(argv[1:], start=1):
        if token == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
    if path is None or path == "None":
        return argv
    data = load_config_file(path)
    if argv[0] in shared:
        ignored = other_commands_keys(data, argv[0], configs)
        if ignored:
            print(f"distrl {argv[0]}: --config {path}: ignoring {len(ignored)} keys that other commands take: "
                  f"{', '.join(ignored)}", file=sys.stderr)
            data = {key: value for key, value in data.items() if key not in ignored}
    return [argv[0], *flag_tokens(data, configs[argv[0]], path), *argv[1:]]
