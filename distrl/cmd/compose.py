"""Config by composition: a command's config holds named sections (dataclasses), not their fields by inheritance.

:func:`composed` turns a plain dataclass whose fields are sections (and a few plain fields) into a command's
config. Every option keeps its flat name everywhere a user meets it, while the code sees which section owns it:

- the command line: tyro omits the section prefixes (``--max_steps``, not ``--learn.max_steps``); ``--help``
  groups the flags by section, each with its docstring;
- flat keys in: ``Config(max_steps=3)``, :func:`from_flat` (a saved ``config.json``, a ``--config`` file, a
  ``join.json``) put each key into its section; a key no section has raises TypeError, as before;
- flat keys out: :func:`to_flat` / ``to_json`` write one flat mapping, so old and new run directories read alike;
- flat names read and set on the composed config (``cfg.max_steps`` is ``cfg.learn.max_steps``) for the
  commands' own code. Roles never receive the composed config: ``distrl/cmd/assemble.py`` hands each its sections.

Building a config resolves each section's derived values (its ``resolve``), then the command's ``settle``
(role counts), then validates: each section's ``check`` (its own fields), then the command's ``rules``
(functions joining two sections, raising ValueError). Neither check nor rule changes the config.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Callable

import tyro


def _section_names(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name]))


def _flat_index(cls: type) -> dict[str, str | None]:
    """Flat option name -> the section field holding it (None: a plain field of the config itself)."""
    hints = typing.get_type_hints(cls)
    index: dict[str, str | None] = {}
    for f in dataclasses.fields(cls):
        names = [g.name for g in dataclasses.fields(hints[f.name])] if f.name in cls._sections else [f.name]
        for name in names:
            if name in index:
                raise TypeError(f"{cls.__name__}: option {name!r} is in two sections ({index[name]}, {f.name})")
            index[name] = f.name if f.name in cls._sections else None
    return index


def flat_fields(config) -> list[dataclasses.Field]:
    """The option fields of a composed config (class or instance), flat, in section order."""
    cls = config if isinstance(config, type) else type(config)
    hints = typing.get_type_hints(cls)
    out: list[dataclasses.Field] = []
    for f in dataclasses.fields(cls):
        out += dataclasses.fields(hints[f.name]) if f.name in cls._sections else [f]
    return out


def flat_hints(cls: type) -> dict[str, Any]:
    """Flat option name -> its type, for every option of composed config class ``cls``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        out.update(typing.get_type_hints(hints[f.name]) if f.name in cls._sections else {f.name: hints[f.name]})
    return {f.name: out[f.name] for f in flat_fields(cls)}


def to_flat(cfg) -> dict[str, Any]:
    """Every option of ``cfg`` by its flat name (the form of config.json, --config files and join.json)."""
    return {f.name: getattr(cfg, f.name) for f in flat_fields(cfg)}


def from_flat(cls: type, data: dict[str, Any]):
    """``cls`` built from flat keys (a saved config.json, ...); raises TypeError naming an unknown key."""
    return cls(**data)


def section_default(cls: type, name: str):
    """A fresh default of ``cls``'s section ``name``."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default_factory()


def _init_flat(init):
    """The dataclass's ``__init__`` of sections, taking flat option names too (each goes into its section)."""

    def __init__(self, *args, **given):
        cls = type(self)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in given if k not in fields and k not in cls._flat)
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown option(s) {', '.join(unknown)}")
        direct = {k: v for k, v in given.items() if k in fields}
        for name in cls._sections:  # each config owns its section objects (none shared with another config)
            values = {k: v for k, v in given.items() if cls._flat.get(k) == name and k not in fields}
            base = direct[name] if name in direct else section_default(cls, name)
            direct[name] = dataclasses.replace(base, **values)
        init(self, *args, **direct)
        self.__post_init__()  # the dataclass's own __init__ calls none: it was added after @dataclass

    __init__.__wrapped__ = init
    return __init__


def _validate(self) -> None:
    """Raise ValueError naming the first bad option: each section's own check, then the rules joining two."""
    for name in type(self)._sections:
        section = getattr(self, name)
        if hasattr(section, "check"):
            section.check()
    for rule in type(self).rules:
        rule(self)


def _get_flat(self, name: str):
    section = type(self)._flat.get(name)
    if section is None:
        raise AttributeError(f"{type(self).__name__} has no option {name!r}")
    return getattr(getattr(self, section), name)


def _set_flat(self, name: str, value) -> None:
    section = type(self)._flat.get(name)
    if section is None:
        object.__setattr__(self, name, value)
    else:
        setattr(getattr(self, section), name, value)


def composed(*rules: Callable[[Any], None], settle: Callable[[Any], None] | None = None,
             prepare: Callable[[Any], None] | None = None):
    """Class decorator over ``@dataclass``: make ``cls`` a command's config (module docstring). ``rules``: the
    cross-section rules checked after each section's own; ``settle(cfg)``: derived values joining sections
    (role counts), run after each section's ``resolve``; ``prepare(cfg)``: run before them (`--join`)."""

    def __post_init__(self) -> None:
        if prepare is not None:
            prepare(self)
        for name in type(self)._sections:
            section = getattr(self, name)
            if hasattr(section, "resolve"):
                section.resolve()
        if settle is not None:
            settle(self)
        self.validate()

    def wrap(cls: type) -> type:
        cls._sections = _section_names(cls)
        cls._flat = _flat_index(cls)
        cls.rules = rules
        cls.__init__ = _init_flat(cls.__init__)
        cls.__post_init__ = __post_init__
        cls.validate = _validate
        cls.__getattr__ = _get_flat  # flat names read and set their section's field (the commands' code)
        cls.__setattr__ = _set_flat
        cls.to_flat = to_flat
        cls.to_json = lambda self: json.dumps(to_flat(self), indent=2, sort_keys=True)
        cls.from_flat = classmethod(from_flat)
        cls.from_json = classmethod(lambda c, text: from_flat(c, json.loads(text)))
        return tyro.conf.configure(tyro.conf.OmitArgPrefixes)(cls)  # flags keep their flat names

    return wrap
