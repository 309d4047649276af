#!/usr/bin/env python
"""Thin wrapper: ``python scripts/bench_jvp.py [options]`` == ``python -m jvpreg.bench jvp [options]``."""
import sys

from jvpreg.bench.jvp import main

if __name__ == "__main__":
    sys.exit(main())
