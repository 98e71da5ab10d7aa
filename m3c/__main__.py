"""`python -m m3c ...`: the same command line as the `m3c` console script."""

from __future__ import annotations

import sys

from m3c.cli import main

if __name__ == "__main__":
    sys.exit(main())
