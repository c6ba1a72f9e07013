"""Source under distrl/ says what the code does and why, not which ticket asked for it: issue numbers and
acceptance points mean nothing to a reader of the code (history lives in BENCHMARKS.md and the commits)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TICKET = re.compile(r"issue[ #-]*[0-9]|acceptance [0-9]", re.IGNORECASE)


def test_no_issue_numbers_in_the_source():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((ROOT / "distrl").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if TICKET.search(line)]
    assert not found, "\n".join(found)
