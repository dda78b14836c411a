#!/usr/bin/env python3
"""`python eval.py --help`: the command lives in linattn_lm/evaluate.py."""
import sys

from linattn_lm.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
