#!/usr/bin/env python
"""Per-operator slow-down of clone mode (the paper's Fig. speedups): wrapper of ``jvpreg.bench.operators``.

Example::

    python scripts/bench_operators.py --batch-sizes 10,80 --sizes 8,16,32,64,128 --out experiments/results/paper
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jvpreg.bench.operators import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python scripts/bench_operators.py"))
