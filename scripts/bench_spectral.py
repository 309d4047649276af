#!/usr/bin/env python
"""Thin wrapper: ``python scripts/bench_spectral.py [options]`` == ``python -m jvpreg.bench spectral [options]``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jvpreg.bench.spectral import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
