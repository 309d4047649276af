#!/usr/bin/env python
"""The paper's JVP timing tables: thin wrapper of ``python -m jvpreg.bench paper`` (same options).

Example (the committed CPU run; see experiments/results/paper/cpu_small.md)::

    python scripts/bench_paper.py --shapes small --threads 1 --out experiments/results/paper
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jvpreg.bench.paper import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python scripts/bench_paper.py"))
