"""Two versions of the code side by side from their benchmark reports: ``capture`` and ``train`` JSONs.

``python scripts/compare_runs.py --before A.json [A2.json ...] --after B.json [B2.json ...]`` prints a Markdown
table per report kind: for each model and method, the ratio to the physical limit (the plain forward of the 2B-row
batch for a JVP, the plain 2B step for a training step) in each version, the median over the runs given, and
``after / before`` of that ratio. Ratios to a plain run in the same process cancel most of a shared machine's load;
a method whose code did not change (double backprop) shows what is left of it.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Dict, List, Tuple


def _ratios(report: dict, clock: str = "cpu") -> Dict[Tuple[str, str], float]:
    """(model, method) -> time / physical limit, for a capture or a train report (a train report's process CPU time
    with ``clock="cpu"``, its wall-clock median with ``"wall"``)."""
    out = {}
    if "rows" in report:  # python -m jvpreg.bench capture
        for row in report["rows"]:
            limit = row["times"].get("forward_2B")
            for method, t in row["times"].items():
                if limit and t and method not in ("forward_B", "forward_2B"):
                    out[(row["model"], f"{method} / fwd 2B")] = t / limit
    else:  # python -m jvpreg.bench train
        key = "cpu_median_s" if clock == "cpu" else "median_s"
        limits = {r["model"]: r[key] for r in report["results"] if r["method"] == "plain_2b"}
        for r in report["results"]:
            if r["method"] not in ("plain", "plain_2b") and r.get(key) and limits.get(r["model"]):
                out[(r["model"], f"{r['method']} / plain 2B")] = r[key] / limits[r["model"]]
    return out


def _median(reports: List[dict], clock: str) -> Dict[Tuple[str, str], float]:
    ratios = [_ratios(r, clock) for r in reports]
    keys = set().union(*ratios)
    return {k: statistics.median(r[k] for r in ratios if k in r) for k in keys}


def table(before: List[dict], after: List[dict], clock: str = "cpu") -> str:
    """The Markdown table: each (model, ratio) in both versions, and their quotient with its geometric mean."""
    b, a = _median(before, clock), _median(after, clock)
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
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="train reports: process CPU time (steadier on a shared machine) or wall clock")
    args = parser.parse_args()
    load = lambda paths: [json.load(open(p)) for p in paths]  # noqa: E731
    print(table(load(args.before), load(args.after), args.clock))


if __name__ == "__main__":
    main()
