"""Errors that every layer may raise and every launcher reports the same way (foundation: imports nothing)."""

from __future__ import annotations


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
