#!/usr/bin/env python
"""Seed-compatible launcher: `python bin/train_distributed.py --run_name x --number_of_actors 2 ...`.

Accepts the seed script's flags as written and runs `distrl train` with them.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distrl.cmd.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
