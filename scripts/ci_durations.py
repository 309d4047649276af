"""Where the CI run's time goes: a pytest ``--durations=0`` log summed by file and by test function.

CI (``.ci/run``) must finish within 90 minutes on a 2-core machine, install included. Run the CI command with
``--durations=0`` and read this summary before adding slow tests::

    python -m pytest tests -q --slow -n 2 --durations=0 > /tmp/durations.log
    python scripts/ci_durations.py /tmp/durations.log            # top files and test functions
    python scripts/ci_durations.py /tmp/durations.log --top 40

Times are setup + call + teardown per test (what pytest reports at or above its 0.005 s threshold); the wall time is
the last line of the log (``N passed ... in S s``).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")
WALL = re.compile(r" in ([\d.]+)s")


def parse(lines) -> dict:
    """``{node id: seconds}`` summed over setup, call and teardown."""
    out = defaultdict(float)
    for line in lines:
        m = LINE.match(line)
        if m:
            out[m.group(3)] += float(m.group(1))
    return dict(out)


def group(durations: dict, key) -> list:
    """``[(name, seconds, tests)]`` grouped by ``key(node id)``, largest first."""
    total, count = defaultdict(float), defaultdict(int)
    for node, s in durations.items():
        total[key(node)] += s
        count[key(node)] += 1
    return sorted(((k, total[k], count[k]) for k in total), key=lambda r: -r[1])


def by_file(node: str) -> str:
    return node.split("::")[0]


def by_function(node: str) -> str:
    return node.split("[")[0]


def table(title: str, rows: list, top: int, total: float) -> str:
    lines = [f"{title:<100} {'min':>7} {'share':>6} {'tests':>6}"]
    for name, s, n in rows[:top]:
        lines.append(f"{name:<100} {s / 60:7.1f} {s / total:6.1%} {n:6d}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="the output of pytest --durations=0")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with open(args.log) as f:
        lines = f.readlines()
    durations = parse(lines)
    if not durations:
        sys.exit(f"{args.log}: no durations found; run pytest with --durations=0")
    total = sum(durations.values())
    walls = [float(m.group(1)) for m in map(WALL.search, lines[-5:]) if m]
    wall = f", {walls[-1] / 60:.1f} min wall" if walls else ""
    print(f"{len(durations)} tests, {total / 60:.1f} min summed{wall}")
    print()
    print(table("file", group(durations, by_file), args.top, total))
    print()
    print(table("test function", group(durations, by_function), args.top, total))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
