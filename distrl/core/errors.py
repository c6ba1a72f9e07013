"""Errors that every layer may raise and every launcher reports the same way, and the wire's errors with the
``code`` of the ERROR reply each stands for (foundation: imports nothing)."""

from __future__ import annotations

import enum
from typing import Any, ClassVar


class BindError(OSError):
    """An endpoint cannot be bound (the port in use, no such interface, no permission). The message names the
    address and what to change; launchers print it after ``distrl <command>: error:`` and exit with status 2."""


class PreflightError(Exception):
    """A flag whose value cannot work, found before any role, Ray cluster or run directory exists.

    Args:
        flag: the option at fault, as the user types it (e.g. ``--model``).
        problem: what is wrong, one line (e.g. ``/data/m: no such directory``).
        fix: what to do instead, one line.

    ``str(error)`` is at most two lines: ``--flag: problem`` and ``  fix: ...``. Launchers print it
    after ``distrl <command>: error:`` and exit with status 2; docs/troubleshooting.md lists every one.
    """

    def __init__(self, flag: str, problem: str, fix: str):
        self.flag, self.problem, self.fix = flag, problem, fix
        super().__init__(f"{flag}: {problem}\n  fix: {fix}")


class NoProgress(RuntimeError):
    """A run that cannot advance and never will, found while it runs (e.g. ``--max_filtered_groups``
    groups in a row dropped by ``--filter_zero_variance``: the reward tells no completion apart).

    ``str(error)`` is one line naming the flag to change. Raised by the buffer (its role or launcher)
    and by a buffer client whose request the buffer refused for this reason (ERROR code
    ``no_progress``); launchers print it after ``distrl <command>: error:`` and exit with status 1.
    """


class ErrorCode(str, enum.Enum):
    """The ``code`` of an ERROR reply (docs/protocol.md): what went wrong, so a client can react."""

    MALFORMED = "malformed"  # not a message of this wire: bad JSON, unknown type, bad envelope or body
    VERSION = "version"  # the peer speaks another SCHEMA_VERSION
    UNSUPPORTED = "unsupported"  # a well-formed message this server does not answer
    INVALID = "invalid"  # a field of the wrong type or out of range, or a request the state refuses
    FULL = "full"  # the buffer holds its memory bound: retry later
    EXHAUSTED = "exhausted"  # offline replay: no batch can be made, and none ever will
    NO_PROGRESS = "no_progress"  # the run cannot advance (:class:`NoProgress`)
    INTERNAL = "internal"  # a bug on the server's side (logged there)


class WireError(ValueError):
    """A message that does not follow the wire format (:mod:`distrl.core.wire`, :mod:`distrl.core.rows`;
    the text says what is wrong)."""

    code: ClassVar[ErrorCode] = ErrorCode.MALFORMED


class FieldError(WireError):
    """A header whose fields have the wrong type or are out of range (msgspec's text names the field)."""

    code: ClassVar[ErrorCode] = ErrorCode.INVALID


class VersionError(WireError):
    """A header whose ``schema`` (wire version, ``theirs``) is not this side's (``ours``,
    :data:`distrl.core.wire.SCHEMA_VERSION`)."""

    code: ClassVar[ErrorCode] = ErrorCode.VERSION

    def __init__(self, theirs: Any, ours: int, text: str | None = None) -> None:
        super().__init__(text or f"peer speaks wire version {theirs!r}, this side speaks {ours}")
        self.theirs, self.ours = theirs, ours

    def __reduce__(self):
        return type(self), (self.theirs, self.ours, str(self))


def error_code(exc: BaseException) -> ErrorCode:
    """The ERROR code an exception stands for: its class's ``code`` attribute (WireError and the
    servers' own errors set one), ``no_progress`` for NoProgress, ``invalid`` for other ValueError,
    KeyError and TypeError, else ``internal``."""
    code = getattr(type(exc), "code", None)
    if isinstance(code, ErrorCode):
        return code
    if isinstance(exc, NoProgress):
        return ErrorCode.NO_PROGRESS
    return ErrorCode.INVALID if isinstance(exc, (ValueError, KeyError, TypeError)) else ErrorCode.INTERNAL
