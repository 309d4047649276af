#!/usr/bin/env python
"""Thin wrapper: ``python scripts/bench_train.py [options]`` == ``python -m jvpreg.bench train [options]``."""
import sys

from jvpreg.bench.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
