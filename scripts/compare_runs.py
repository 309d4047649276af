"""Two versions of the code side by side from their benchmark reports: ``capture`` and ``train`` JSONs.

``python scripts/compare_runs.py --before A.json [A2.json ...] --after B.json [B2.json ...]`` prints a Markdown
table per report kind: for each model and method, the ratio to the physical limit (the plain forward of the 2B-row
batch for a JVP, the plain 2B step for a training step) in each version, the median over the runs given, and
``after / before`` of that ratio. Ratios to a plain run in the same process cancel most of a shared machine's load.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Dict, List, Tuple


def _ratios(report: dict) -> Dict[Tuple[str, str], float]:
    """(model, method) -> time / physical limit, for a capture or a train report."""
    out = {}
    if "rows" in report:  # python -m jvpreg.bench capture
        for row in report["rows"]:
            limit = row["times"].get("forward_2B")
            for method, t in row["times"].items():
                if limit and t and method not in ("forward_B", "forward_2B"):
                    out[(row["model"], f"{method} / fwd 2B")] = t / limit
    else:  # python -m jvpreg.bench train
        limits = {r["model"]: r["median_s"] for r in report["results"] if r["method"] == "plain_2b"}
        for r in report["results"]:
            if r["method"] not in ("plain", "plain_2b") and r.get("median_s") and limits.get(r["model"]):
                out[(r["model"], f"{r['method']} / plain 2B")] = r["median_s"] / limits[r["model"]]
    return out


def _median(reports: List[dict]) -> Dict[Tuple[str, str], float]:
    keys = set().union(*(_ratios(r) for r in reports))
    return {k: statistics.median(_ratios(r)[k] for r in reports if k in _ratios(r)) for k in keys}


def table(before: List[dict], after: List[dict]) -> str:
    b, a = _median(before), _median(after)
    lines = ["| model | ratio | before | after | after / before |", "|:---|:---|---:|---:|---:|"]
    logs = []
    for key in sorted(set(b) & set(a)):
        change = a[key] / b[key]
        logs.append(math.log(change))
        lines.append(f"| {key[0]} | {key[1]} | {b[key]:.2f} | {a[key]:.2f} | {change:.3f} |")
    if logs:
        lines.append(f"| geometric mean | | | | **{math.exp(statistics.mean(logs)):.3f}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", required=True, help="reports of the old code")
    parser.add_argument("--after", nargs="+", required=True, help="reports of the new code (same command)")
    args = parser.parse_args()
    load = lambda paths: [json.load(open(p)) for p in paths]  # noqa: E731
    print(table(load(args.before), load(args.after)))


if __name__ == "__main__":
    main()
