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
another shape (a nested mapping). Each value is checked against its field's type first (:func:`check_value`:
`max_steps: true` names the file, the key and "an integer"; tyro's own message named neither). A string that
reads as the number is taken for a number field: PyYAML reads `3e-4` (no dot) as a string.
"""

from __future__ import annotations

import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from distrl.cmd.compose import flat_fields, flat_hints

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


def _is_number(value: Any, kind: type) -> bool:
    """`value` is an int (a float too for `kind` float), or a string that `kind` parses; never a bool."""
    if isinstance(value, str):
        try:
            kind(value)
        except ValueError:
            return False
        return True
    return not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)


_SCALARS = {bool: ("true or false", lambda v: isinstance(v, bool)),
            int: ("an integer", lambda v: _is_number(v, int)),
            float: ("a number", lambda v: _is_number(v, float)),
            str: ("a string", lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool))}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _expected(hint: Any, value: Any) -> str | None:
    """What a field of type `hint` takes, in words, when `value` does not fit it; None when it fits (or the
    type is none of the config's: bool, int, float, str, Literal, tuple[X, ...], Optional of these)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        expected = _expected(inner, value)
        return expected and f"{expected} or null"
    if origin is Literal:
        return None if value in args else "one of " + ", ".join(map(str, args))
    if origin is tuple:  # tuple[X, ...]: a list, or one value
        items = value if isinstance(value, list) else [value]
        fits = all(_expected(args[0], v) is None for v in items)
        return None if fits else f"a list of {_PLURALS.get(args[0], 'values')}"
    if hint not in _SCALARS:
        return None
    name, fits = _SCALARS[hint]
    return None if fits(value) else name


def check_value(key: str, value: Any, hint: Any, path: str | Path) -> None:
    """Raise ConfigFileError naming the file, the key and the expected type when `value` does not fit `hint`."""
    expected = _expected(hint, value)
    if expected is None:
        return
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    quote = isinstance(value, bool) and expected.startswith(("one of", "a string"))  # `export_final: off`
    raise ConfigFileError(f"--config {path}: key {key!r} must be {expected}, got {shown}"
                          + (" (YAML reads unquoted on/off/yes/no as true/false: quote it)" if quote else ""))


def flag_tokens(data: dict[str, Any], config_class: type, path: str | Path) -> list[str]:
    """Flag tokens for ``data``'s keys, checked against ``config_class``'s fields; raises ConfigFileError."""
    names = {f.name for f in flat_fields(config_class)}
    hints = flat_hints(config_class)
    tokens: list[str] = []
    for key, value in data.items():
        if key not in names or key == "config":
            raise ConfigFileError(f"--config {path}: unknown key {key!r} (not a flag of this command; "
                                  f"see --help for the flag names)")
        if isinstance(value, dict):
            raise ConfigFileError(f"--config {path}: key {key!r} holds a mapping; flags take plain values")
        check_value(key, value, hints[key], path)
        if isinstance(value, bool):
            tokens.append(f"--{key}" if value else f"--no_{key}")
        elif value is None:
            tokens.append(f"--{key}=None")
        elif isinstance(value, (list, tuple)):
            tokens += [f"--{key}", *(str(v) for v in value)]
        else:
            tokens.append(f"--{key}={value}")
    return tokens


def other_commands_keys(data: dict[str, Any], command: str, configs: dict[str, type]) -> list[str]:
    """The keys of ``data`` that are not flags of ``command`` but are flags of another command of ``configs``."""
    own = {f.name for f in flat_fields(configs[command])}
    others = {f.name for name, cls in configs.items() if name != command for f in flat_fields(cls)}
    return [key for key in data if key not in own and key in others]


def expand_config(argv: list[str], configs: dict[str, type], shared: tuple[str, ...] = ()) -> list[str]:
    """``argv`` (``[command, flags...]``) with the flags of its ``--config FILE`` inserted after the command.

    ``configs`` maps command names to their config classes; a command whose class has no ``config``
    field is left alone (its parser then rejects --config). Only the last --config counts. For a command
    in ``shared``, the file's keys that only other commands take are left out, named on one stderr line.
    """
    if not argv or argv[0] not in configs or "config" not in {f.name for f in flat_fields(configs[argv[0]])}:
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
