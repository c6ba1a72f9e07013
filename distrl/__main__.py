"""`python -m distrl <command> ...`: the `distrl` command (distrl/cmd/cli.py), e.g. under torchrun."""

import sys

from distrl.cmd.cli import main

if __name__ == "__main__":
    sys.exit(main())
