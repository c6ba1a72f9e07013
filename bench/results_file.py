"""Writing a ``bench/results/*.json`` file without losing what earlier rounds put there.

A results file is rewritten by every round of its bench, and its top-level keys are what issues ask for and
tests check (``tests/unit/test_results_keys.py``). :func:`merge` therefore keeps every key the file holds,
sets the keys this run measured, and keeps each measured number's history: ``<key>_runs`` gets the new value
appended (or, when the run brings its own ``<key>_runs`` list, that list's values). A key the run reports as
None (not measured) keeps its earlier value.
"""

from __future__ import annotations

import json
from pathlib import Path


def _measured(value) -> bool:
    """A number or a bool: a value whose history is worth keeping (not a string, a list or a dict)."""
    return isinstance(value, (bool, int, float))


def merge(path: str | Path, values: dict, indent: int = 1) -> dict:
    """Merge ``values`` into the JSON object at ``path`` (created when missing) and write it back.

    Every key already there stays; each key of ``values`` is set, except a None over an existing value. For a
    number or bool ``values[k]`` (``k`` not itself a ``*_runs`` key), ``k + "_runs"`` is extended by
    ``values[k + "_runs"]`` when the run gives that list, else by ``[values[k]]``. Returns the written object.
    """
    path = Path(path)
    old = json.loads(path.read_text()) if path.is_file() else {}
    out = dict(old)
    for key, value in values.items():
        if key.endswith("_runs") and key[: -len("_runs")] in values:
            continue  # extended below, with its value's key
        if value is None and out.get(key) is not None:
            continue
        out[key] = value
        if _measured(value) and not key.endswith("_runs"):
            new = values.get(key + "_runs")
            out[key + "_runs"] = list(old.get(key + "_runs", [])) + (list(new) if isinstance(new, list) else [value])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=indent, default=str) + "\n")
    return out
