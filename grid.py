#!/usr/bin/env python3
"""`python grid.py --help`: the command lives in linattn_lm/grid.py."""
import sys

from linattn_lm.grid import main

if __name__ == "__main__":
    sys.exit(main())
