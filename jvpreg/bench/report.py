"""Table, JSON and plot helpers shared by the benchmarks (``paper``, ``operators``).

Everything here is presentation: no timing, no model code. Plots use matplotlib's ``Agg``
backend (no display needed) and are imported lazily so that importing a benchmark module
costs nothing when only its JSON is wanted.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


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


def pyplot():
    """matplotlib's pyplot on the non-interactive ``Agg`` backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def bar_chart(path: str | Path, labels: Sequence[str], series: Mapping[str, Sequence[float | None]], *,
              title: str, ylabel: str, hline: float | None = 1.0, annotate: bool = True) -> Path:
    """Grouped bars, one group per label and one bar per series; missing values leave a gap.

    Infinite values (every alternative failed) are drawn at the top of the axis with ``∞``.
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
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right")
    ax.set_ylim(0, top * 1.08)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if len(series) > 1:
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
