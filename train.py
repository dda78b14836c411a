#!/usr/bin/env python3
"""`python train.py --help`: the command lives in linattn_lm/training.py."""
import sys

from linattn_lm.training import main

if __name__ == "__main__":
    sys.exit(main())
