"""Sweep summaries: one table (Markdown + CSV) and one plot comparing the jobs of a sweep.

``jvpreg-train -m ...`` writes them at the end of every multirun (the Hydra callback
:class:`jvpreg.train.SweepSummaryCallback`, registered in ``jvpreg/conf/hydra/default.yaml``), into the sweep folder:
``summary.md``, ``summary.csv`` and ``summary.png``. ``jvpreg-summarize <dir>`` (also
``python -m jvpreg.summarize <dir>``) does the same for runs made elsewhere: SLURM array jobs, W&B
agents, or single runs collected in one folder.

What is read: every ``metrics.json`` under the folder (written by ``jvpreg-train`` in each job's
output folder) and the job's command-line overrides from ``.hydra/overrides.yaml`` next to it.

What is written: one row per job (its overrides, clean accuracy, the robustness figures, mean
``||J||_F``, the best validation accuracy, the wall time). When the sweep varies ``seed``, a second
table groups the jobs that differ only by their seed and gives ``mean ± std`` (sample standard
deviation, ``n`` seeds) of every figure; the plot shows those groups with error bars. Jobs that
have no ``metrics.json`` (failed or still running) are listed by folder.

Implementation choices: only the standard library is imported at module level (matplotlib when
plotting; never Hydra), so the command starts fast; columns are the overrides that differ between jobs (those
shared by all jobs are stated once above the table); clean accuracy is ``robustness/clean_acc``,
else ``test/acc``.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("jvpreg.summarize")

__all__ = ["Job", "SweepSummary", "load_jobs", "main", "summarize_sweep"]

#: (metrics.json key, column name), in table order; robustness keys with an ``@`` follow in their own order
_FIXED_BEFORE = (("clean_acc", "clean acc"),)
_FIXED_AFTER = (("robustness/jacobian_fro", "||J||_F"), ("val/acc_best", "val acc (best)"),
                ("elapsed_s", "time (s)"))
_ROBUST = re.compile(r"^robustness/((noise|fgsm|pgd|rot|shift)_acc@.+)$")


@dataclass
class Job:
    """One job of a sweep.

    Attributes:
        name: the job's folder, relative to the sweep folder.
        overrides: its command-line overrides, ``{"regularizer.weight": "0.01", "seed": "1"}``.
        values: its figures by column name (``"clean acc"``, ``"noise_acc@0.1"``, ``"||J||_F"``, ...).
    """

    name: str
    overrides: Dict[str, str]
    values: Dict[str, float] = field(default_factory=dict)


@dataclass
class SweepSummary:
    """What :func:`summarize_sweep` found and wrote.

    Attributes:
        jobs: the finished jobs, sorted by folder name (numeric job numbers in order).
        incomplete: folders of jobs without ``metrics.json``.
        columns: the figure columns, in table order.
        varying: the override keys that differ between jobs (table columns).
        common: overrides shared by every job.
        groups: with ``seed`` swept, ``[(overrides without seed, {column: (mean, std, n)})]``; else empty.
        paths: ``{"md": ..., "csv": ..., "png": ...}`` of the files written.
    """

    jobs: List[Job]
    incomplete: List[str]
    columns: List[str]
    varying: List[str]
    common: Dict[str, str]
    groups: List[Tuple[Dict[str, str], Dict[str, Tuple[float, float, int]]]]
    paths: Dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- reading


def _read_overrides(job_dir: Path) -> Dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    out: Dict[str, str] = {}
    for line in path.read_text().splitlines():  # a YAML list of strings, one per line: "- key=value"
        m = re.match(r"^-\s+(.*)$", line.strip())
        if not m:
            continue
        item = m.group(1).strip()
        if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"":
            item = item[1:-1]
        key, sep, value = item.partition("=")
        if sep:
            key = key.lstrip("+~")
            if not key.startswith("hydra."):
                out[key] = value
    return out


def _figures(result: Dict[str, Any]) -> Dict[str, float]:
    metrics = result.get("metrics") or {}
    values: Dict[str, float] = {}
    clean = metrics.get("robustness/clean_acc", metrics.get("test/acc"))
    if clean is not None:
        values["clean acc"] = float(clean)
    for key, value in metrics.items():
        m = _ROBUST.match(key)
        if m:
            values[m.group(1)] = float(value)
    for key, col in _FIXED_AFTER:
        value = result.get(key) if key == "elapsed_s" else metrics.get(key)
        if value is not None:
            values[col] = float(value)
    return values


def _sort_key(name: str) -> Tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def load_jobs(sweep_dir: str | os.PathLike) -> Tuple[List[Job], List[str]]:
    """The finished jobs under ``sweep_dir`` and the folders of the unfinished ones.

    Args:
        sweep_dir: a multirun folder (``multirun/<task>/<date>_<time>``) or any folder holding
            ``jvpreg-train`` output folders, at any depth.

    Returns:
        ``(jobs, incomplete)``: :class:`Job` per ``metrics.json`` found, and the job folders (those
        with a ``.hydra`` folder) that have none.

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a folder.

    Example::

        >>> jobs, incomplete = load_jobs("multirun/train/2026-01-01_12-00-00")
        >>> jobs[0].overrides, jobs[0].values["clean acc"]
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"jvpreg-summarize: {str(sweep_dir)!r} is not a folder. Pass the sweep folder that "
                                "holds the jobs' output folders (e.g. multirun/train/<date>_<time>).")
    jobs: List[Job] = []
    done = set()
    for path in sorted(root.rglob("metrics.json")):
        job_dir = path.parent
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            log.warning("skipping %s: %s", path, err)
            continue
        if not isinstance(result, dict) or "metrics" not in result:
            continue  # not a jvpreg-train metrics file
        name = str(job_dir.relative_to(root)) if job_dir != root else job_dir.name
        jobs.append(Job(name, _read_overrides(job_dir), _figures(result)))
        done.add(job_dir)
    incomplete = sorted((str(p.parent.relative_to(root)) for p in root.rglob(".hydra")
                         if p.is_dir() and p.parent not in done and p.parent != root), key=_sort_key)
    jobs.sort(key=lambda j: _sort_key(j.name))
    return jobs, incomplete


# --------------------------------------------------------------------------- summarising


def _columns(jobs: Sequence[Job]) -> List[str]:
    seen = {c for j in jobs for c in j.values}
    robust = sorted((c for c in seen if "@" in c), key=lambda c: (["noise", "fgsm", "pgd", "rot", "shift"].index(
        c.split("_")[0]), float(re.sub(r"[^0-9.eE+-]", "", c.split("@")[1]) or 0)))
    return [c for _, c in _FIXED_BEFORE if c in seen] + robust + [c for _, c in _FIXED_AFTER if c in seen]


def _group_by_seed(jobs: Sequence[Job], columns: Sequence[str]):
    groups: Dict[Tuple, List[Job]] = {}
    for job in jobs:
        key = tuple(sorted((k, v) for k, v in job.overrides.items() if k != "seed"))
        groups.setdefault(key, []).append(job)
    out = []
    for key, members in groups.items():
        stats = {}
        for col in columns:
            vals = [j.values[col] for j in members if col in j.values and math.isfinite(j.values[col])]
            if vals:
                std = statistics.stdev(vals) if len(vals) > 1 else 0.0
                stats[col] = (statistics.fmean(vals), std, len(vals))
        out.append((dict(key), stats))
    return out


def _fmt(col: str, v: float) -> str:
    if col == "time (s)":
        return f"{v:.1f}"
    if col == "||J||_F":
        return f"{v:.4g}"
    return f"{v:.4f}"


def _write_csv(path: Path, s: SweepSummary) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job", *s.varying, *s.columns])
        for j in s.jobs:
            w.writerow([j.name, *(j.overrides.get(k, "") for k in s.varying),
                        *(repr(j.values[c]) if c in j.values else "" for c in s.columns)])


def _md_table(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _write_md(path: Path, s: SweepSummary, title: str) -> None:
    lines = [f"# Sweep summary: {title}", ""]
    lines.append(f"{len(s.jobs)} finished job(s)" + (f", {len(s.incomplete)} without results: "
                                                      f"{', '.join(s.incomplete)}" if s.incomplete else "") + ".")
    if s.common:
        lines += ["", "Shared by every job: " + ", ".join(f"`{k}={v}`" for k, v in sorted(s.common.items())) + "."]
    if s.groups:
        varying = [k for k in s.varying if k != "seed"]
        lines += ["", "## Mean ± std over seeds", ""]
        rows = []
        for over, stats in s.groups:
            n = max((st[2] for st in stats.values()), default=0)
            rows.append([*(over.get(k, "") for k in varying), str(n),
                         *(f"{_fmt(c, stats[c][0])} ± {_fmt(c, stats[c][1])}" if c in stats else "" for c in s.columns)])
        lines += _md_table([*varying, "seeds", *s.columns], rows)
    lines += ["", "## Jobs", ""]
    rows = [[j.name, *(j.overrides.get(k, "") for k in s.varying),
             *(_fmt(c, j.values[c]) if c in j.values else "" for c in s.columns)] for j in s.jobs]
    lines += _md_table(["job", *s.varying, *s.columns], rows)
    lines += ["", "Accuracies on the test split of the best checkpoint (clean, Gaussian noise σ, FGSM/PGD ε); "
              "||J||_F: mean Frobenius norm of the input-output Jacobian.", ""]
    path.write_text("\n".join(lines))


def _write_png(path: Path, s: SweepSummary, title: str) -> None:
    from matplotlib.figure import Figure  # Agg canvas, no pyplot state

    varying = [k for k in s.varying if k != "seed"]
    if s.groups:
        labels = ["\n".join(f"{k}={over.get(k, '')}" for k in varying) or "(all)" for over, _ in s.groups]
        stats = [st for _, st in s.groups]
    else:
        labels = ["\n".join(f"{k}={j.overrides.get(k, '')}" for k in varying) or j.name for j in s.jobs]
        stats = [{c: (v, 0.0, 1) for c, v in j.values.items()} for j in s.jobs]
    accs = [c for c in s.columns if c == "clean acc" or "@" in c]
    fig = Figure(figsize=(max(8.0, 1.2 * len(labels) + 6), 4.2), dpi=110)
    ax_acc, ax_j = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / max(1, len(accs))
    for i, col in enumerate(accs):
        xs = [g + (i - (len(accs) - 1) / 2) * width for g in range(len(labels))]
        ax_acc.bar(xs, [st.get(col, (math.nan,))[0] for st in stats], width,
                   yerr=[st.get(col, (0, 0))[1] for st in stats], capsize=2, label=col)
    ax_acc.set_xticks(range(len(labels)))
    ax_acc.set_xticklabels(labels, fontsize=7)
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_ylabel("test accuracy")
    if accs:
        ax_acc.legend(fontsize=7, ncol=2)
    ax_acc.set_title("accuracy (mean ± std over seeds)" if s.groups else "accuracy", fontsize=9)
    if "||J||_F" in s.columns:
        ax_j.bar(range(len(labels)), [st.get("||J||_F", (math.nan,))[0] for st in stats],
                 yerr=[st.get("||J||_F", (0, 0))[1] for st in stats], capsize=2, color="tab:gray")
        ax_j.set_xticks(range(len(labels)))
        ax_j.set_xticklabels(labels, fontsize=6, rotation=20, ha="right")
    ax_j.set_title("mean ||J||_F", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def summarize_sweep(sweep_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None,
                    plot: bool = True) -> SweepSummary:
    """Write ``summary.md``, ``summary.csv`` and ``summary.png`` comparing the jobs under ``sweep_dir``.

    Args:
        sweep_dir: the sweep folder (see :func:`load_jobs`).
        out_dir: where to write (default: ``sweep_dir``).
        plot: also write ``summary.png``.

    Returns:
        A :class:`SweepSummary` (rows, seed groups, paths written).

    Raises:
        FileNotFoundError: ``sweep_dir`` is not a folder, or holds no ``metrics.json``.

    Example::

        >>> s = summarize_sweep("multirun/train/2026-01-01_12-00-00")
        >>> print(open(s.paths["md"]).read())
    """
    jobs, incomplete = load_jobs(sweep_dir)
    if not jobs:
        raise FileNotFoundError(f"jvpreg-summarize: no metrics.json under {str(sweep_dir)!r}"
                                + (f" (job folders without results: {', '.join(incomplete)})" if incomplete else "")
                                + ". Each jvpreg-train job writes one at its end; pass the folder that holds the jobs.")
    keys = sorted({k for j in jobs for k in j.overrides})
    varying = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]
    common = {k: jobs[0].overrides[k] for k in keys if k not in varying and k in jobs[0].overrides}
    columns = _columns(jobs)
    groups = _group_by_seed(jobs, columns) if "seed" in varying else []
    summary = SweepSummary(jobs, incomplete, columns, varying, common, groups)
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = Path(sweep_dir).resolve().name
    summary.paths = {"md": str(out / "summary.md"), "csv": str(out / "summary.csv")}
    _write_md(out / "summary.md", summary, title)
    _write_csv(out / "summary.csv", summary)
    if plot:
        summary.paths["png"] = str(out / "summary.png")
        _write_png(out / "summary.png", summary, title)
    return summary


# --------------------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``jvpreg-summarize <sweep_dir> [--out DIR] [--no-plot]``."""
    parser = argparse.ArgumentParser(
        prog="jvpreg-summarize",
        description="Compare the jvpreg-train jobs of a sweep: writes summary.md, summary.csv and summary.png "
                    "(one row per job; mean ± std over seeds when seed was swept).")
    parser.add_argument("sweep_dir", help="folder holding the jobs' output folders (any depth)")
    parser.add_argument("--out", default=None, help="where to write (default: sweep_dir)")
    parser.add_argument("--no-plot", action="store_true", help="skip summary.png")
    args = parser.parse_args(argv)
    try:
        s = summarize_sweep(args.sweep_dir, out_dir=args.out, plot=not args.no_plot)
    except FileNotFoundError as err:
        print(str(err), file=sys.stderr)
        return 2
    print(Path(s.paths["md"]).read_text())
    print("\n".join(f"{k}: {v}" for k, v in s.paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
