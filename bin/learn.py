#!/usr/bin/env python
"""`distrl learn` as a script: `python bin/learn.py --help` lists every flag."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distrl.cmd.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["learn", *sys.argv[1:]]))
