"""Helpers shared by the benchmarks (``paper``, ``operators``): tables, JSON, plots, and two
measurement helpers that :mod:`jvpreg.bench.timing` lacks (both clocks per run; a steady CPU heap).

No model code here. Plots use matplotlib's ``Agg``
backend (no display needed) and are imported lazily so that importing a benchmark module
costs nothing when only its JSON is wanted.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Sequence

from .timing import measure, sync


def fmt_seconds(t: float | None, digits: int = 3) -> str:
    """Seconds with ``digits`` significant digits, fixed-point (``0.0123``, ``1.23``, ``12.3``)."""
    if t is None or not math.isfinite(t):
        return "-"
    if t == 0:
        return "0"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(t)))))
    return f"{t:.{decimals}f}"


def fmt_ratio(r: float | None, digits: int = 2) -> str:
    """A speed-up or slow-down factor (``2.47``), ``∞`` for infinite, ``-`` for missing."""
    if r is None or (isinstance(r, float) and math.isnan(r)):
        return "-"
    if math.isinf(r):
        return "∞"
    return f"{r:.{digits}f}"


def fmt_count(n: int) -> str:
    """Parameter counts as in the paper (``25M``, ``5.3M``, ``120k``)."""
    if n >= 10_000_000:
        return f"{n / 1e6:.0f}M"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1_000:
        return f"{n / 1e3:.0f}k"
    return str(n)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub Markdown table; ``align`` is one char per column (``l``/``r``/``c``), default: first left."""
    rows = [[str(c) for c in r] for r in rows]
    align = align or ("l" + "r" * (len(headers) - 1))
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def arith_mean(values: Iterable[float | None]) -> float:
    """Mean of the finite values (``nan`` if none)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def geo_mean(values: Iterable[float | None]) -> float:
    """Geometric mean of the finite positive values (``nan`` if none)."""
    vals = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The shell command that reproduces a run (``prog`` followed by the quoted arguments)."""
    return " ".join([prog, *(shlex.quote(a) for a in argv)])


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (a shared machine's noise indicator); ``None`` where unknown."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def git_state(root: str | Path | None = None) -> Dict[str, Any] | None:
    """Commit and uncommitted files of the checkout that holds this package (``None`` outside git).

    A results file must name the engine it measured: the engine changes under a shared working tree.
    """
    import subprocess

    root = Path(root) if root else Path(__file__).resolve().parents[2]
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=10, check=True).stdout
        commit = run("rev-parse", "HEAD").strip()
        dirty = [line[3:] for line in run("status", "--porcelain", "--", "jvpreg").splitlines()]
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty_files": dirty}


def describe_git(git: Mapping[str, Any] | None) -> str:
    """One line for a report: ``commit abc1234`` plus uncommitted package files, if any."""
    if not git:
        return "code version unknown"
    text = f"commit `{git['commit'][:10]}`"
    dirty = git.get("dirty_files") or []
    if dirty:
        shown = ", ".join(f"`{f}`" for f in dirty[:6]) + (f" (+{len(dirty) - 6} more)" if len(dirty) > 6 else "")
        text += f" with uncommitted changes in {shown}"
    if git.get("note"):
        text += f" ({git['note']})"
    return text


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (non-finite floats become strings ``"inf"``/``"nan"``)."""

    def clean(o):
        if isinstance(o, float) and not math.isfinite(o):
            return "nan" if math.isnan(o) else ("inf" if o > 0 else "-inf")
        if isinstance(o, Mapping):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(obj), indent=1, ensure_ascii=False) + "\n")
    return path


def write_results(stem: str | Path, markdown: str, obj: Any) -> tuple:
    """Write a benchmark's ``<stem>.md`` (the table people read) and ``<stem>.json`` (everything measured,
    :func:`write_json`); returns both paths."""
    stem = Path(stem)
    md = stem.parent / f"{stem.name}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown)
    return md, write_json(stem.parent / f"{stem.name}.json", obj)


def read_json(path: str | Path) -> Any:
    """Read a file written by :func:`write_json`, turning ``"inf"``/``"-inf"``/``"nan"`` back into floats."""
    special = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}

    def revive(o):
        if isinstance(o, str) and o in special:
            return special[o]
        if isinstance(o, dict):
            return {k: revive(v) for k, v in o.items()}
        if isinstance(o, list):
            return [revive(v) for v in o]
        return o

    return revive(json.loads(Path(path).read_text()))


def _stats(times: Sequence[float]) -> Dict[str, float]:
    return {"median": statistics.median(times), "mean": statistics.fmean(times),
            "std": statistics.pstdev(times) if len(times) > 1 else 0.0, "min": min(times)}


def measure_clocks(fn: Callable[[], Any], *, repeats: int, warmup: int, device: Any,
                   clock: str = "wall") -> Dict[str, Any]:
    """Like :func:`jvpreg.bench.timing.measure`, timing each run on the wall clock *and* on the process's
    CPU clock (``time.process_time``); ``median/mean/std/min`` are those of ``clock``.

    On a shared CPU the wall clock also counts the time other processes hold the core; the CPU clock
    does not, and with one torch thread (``--threads 1``) it equals the wall time of an idle machine.
    With several threads it sums their CPU time, so compare ``cpu`` times only at a fixed thread count.
    """
    if clock == "wall" and device.type == "cuda":
        return {**measure(fn, repeats=repeats, warmup=warmup, device=device), "clock": "wall"}
    for _ in range(warmup):
        fn()
    sync(device)
    wall, cpu = [], []
    for _ in range(repeats):
        sync(device)
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync(device)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    chosen = cpu if clock == "cpu" else wall
    return {**_stats(chosen), "repeats": repeats, "clock": clock,
            "wall": _stats(wall), "cpu": _stats(cpu)}


def steady_malloc() -> bool:
    """Serve all allocations from glibc's heap and never trim it (``mallopt``); False where unavailable.

    glibc serves buffers above its dynamic, history-dependent mmap threshold with fresh pages, so a
    memory-bound op pays page faults on every call or on none depending on what ran before (one relu's
    time varied widely in the same process). A steady heap is the CPU analogue
    of PyTorch's CUDA caching allocator. Process-wide and irreversible: call it in benchmark
    processes only.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2 ** 31 - 1))  # C int
    except (OSError, AttributeError):
        return False


def pyplot():
    """matplotlib's pyplot on the non-interactive ``Agg`` backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path: str | Path, labels: Sequence[str], series: Mapping[str, Sequence[float | None]], *,
              title: str, ylabel: str, hline: float | None = 1.0, annotate: bool = True,
              extra_lines: Sequence[tuple] = ()) -> Path:
    """Grouped bars, one group per label and one bar per series; missing values leave a gap.

    Infinite values (every alternative failed) are drawn at the top of the axis with ``∞``.
    ``extra_lines`` adds labelled horizontal lines ``(y, label)`` (e.g. a target).
    """
    plt = pyplot()
    n = max(len(series), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(labels) + 2), 4.2))
    finite = [v for vals in series.values() for v in vals if v is not None and math.isfinite(v)]
    top = max(finite + [1.0]) * 1.15
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        hs = [top if (v is not None and math.isinf(v)) else (v if v is not None and math.isfinite(v) else 0.0)
              for v in vals]
        bars = ax.bar(xs, hs, width, label=name)
        if annotate:
            for b, v in zip(bars, vals):
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    ax.text(b.get_x() + b.get_width() / 2, 0.02 * top, "n/a", ha="center", va="bottom",
                            fontsize=6, rotation=90)
                else:
                    ax.text(b.get_x() + b.get_width() / 2, b.get_height(), fmt_ratio(v, 1), ha="center",
                            va="bottom", fontsize=6)
    if hline is not None:
        ax.axhline(hline, color="red", lw=1)
    for y, label in extra_lines:
        ax.axhline(y, color="gray", lw=1, ls="--", label=label)
        top = max(top, y * 1.05)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right")
    ax.set_ylim(0, top * 1.08)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if len(series) > 1 or extra_lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (disabled, but still usable, when ``enabled`` is false or tqdm is missing)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        class _Null:
            def update(self, n=1): ...
            def set_postfix_str(self, s): ...
            def close(self): ...
        return _Null()
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True)
