"""Per-operator slow-down of clone mode (the paper's Fig. "speedups"), in PyTorch.

``python scripts/bench_operators.py [options]`` (``jvpreg.bench.operators.main``) times, for
32-channel inputs ``(B, 32, S, S)`` over spatial sizes ``S`` and two batch sizes ``B``:

* ``relu``: the clone rule (``F.relu`` on a clone batch of ``2B`` rows: the mask comes from the
  primal rows and multiplies every block);
* ``maxpool``: the clone rule of ``F.max_pool2d(·, 2)`` (argmax from the primal rows, every block
  gathered there);
* ``conv``: ``F.conv2d`` (32 → 32, 3×3, padding 1) on the clone batch (affine: one convolution of
  the merged ``2B`` rows),

each against the default operator on ``B`` rows (the paper's figure: the cost of one JVP relative to
one plain forward; 2 would be "twice the rows, no overhead") and on ``2B`` rows (the engine's own
overhead: 1 is ideal). The paper's figure uses 3 blocks ``[x; u; 0]`` and batches 10 and 80; the
difference form needs 2 blocks. Clone inputs are built with :func:`jvpreg.clone.pack`, so the
dispatch cost of the ``CloneTensor`` subclass is included, as it is in a real forward.

Outputs ``<name>.json``, ``<name>.md`` and ``<name>.png`` (one panel per batch size; solid lines:
vs ``B`` rows, dashed: vs ``2B`` rows; red line at 1).

Allocator (CPU): glibc serves buffers above its (dynamic, history-dependent) mmap threshold with
fresh pages, so a memory-bound op pays page faults on every call or on none, depending on what ran
before: the same relu's time varied widely in one process. ``--steady-malloc``
(default on CPU) calls ``mallopt`` to serve every buffer from the heap and keep freed memory there,
the CPU analogue of PyTorch's CUDA caching allocator, so the figure shows compute, not page faults.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F

from ..clone import call, pack
from . import report
from .timing import machine_description

OPS: Dict[str, str] = {
    "relu": "clone activation (relu)",
    "maxpool": "clone max-pool 2×2",
    "conv": "Conv2D 3×3 on the clone batch",
}
COLORS = {"relu": "black", "maxpool": "green", "conv": "blue"}


def _op_fn(op: str, channels: int, device: torch.device, gen: torch.Generator) -> Callable[[torch.Tensor], Any]:
    if op == "relu":
        return F.relu
    if op == "maxpool":
        return lambda t: F.max_pool2d(t, 2)
    if op == "conv":
        w = (torch.randn(channels, channels, 3, 3, generator=gen) / (3 * channels ** 0.5)).to(device)
        b = torch.zeros(channels, device=device)
        return lambda t: F.conv2d(t, w, b, padding=1)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def _timed(fn: Callable[[], Any], repeats: int, warmup: int, device: torch.device, budget: float | None,
           clock: str) -> dict:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if budget is not None and first * (warmup + repeats) > budget:
        warmup = min(warmup, 1)
        repeats = max(min(3, repeats), min(repeats, int(budget / max(first, 1e-9) + 1e-9) - warmup))
    return report.measure_clocks(fn, repeats=repeats, warmup=warmup, device=device, clock=clock)


def run(ops: Sequence[str], sizes: Sequence[int], batch_sizes: Sequence[int], *, channels: int = 32,
        repeats: int = 20, warmup: int = 3, device: str = "cpu", cell_budget: float | None = None,
        seed: int = 0, stat: str = "median", clock: str = "wall", show_progress: bool = True) -> List[Dict[str, Any]]:
    """One record per (op, B, S): times of clone (2B rows), default (B rows) and default (2B rows)."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    records: List[Dict[str, Any]] = []
    bar = report.progress(len(ops) * len(sizes) * len(batch_sizes), "operators", show_progress)
    try:
        with torch.no_grad():
            for b in batch_sizes:
                for s in sizes:
                    x = torch.randn(b, channels, s, s, generator=gen).to(dev)
                    u = torch.randn(x.shape, generator=gen).to(dev)
                    x2 = torch.cat([x, x + u])
                    (cx,), _ = pack((x,), (u.unsqueeze(0),))
                    for op in ops:
                        bar.set_postfix_str(f"B={b} S={s} {op}")
                        f = _op_fn(op, channels, dev, gen)
                        rec: Dict[str, Any] = {"op": op, "batch_size": b, "size": s, "channels": channels}
                        try:
                            rec["clone"] = _timed(lambda: call(f, (cx,), engine="eager"), repeats, warmup, dev, cell_budget, clock)
                            rec["default_B"] = _timed(lambda: f(x), repeats, warmup, dev, cell_budget, clock)
                            rec["default_2B"] = _timed(lambda: f(x2), repeats, warmup, dev, cell_budget, clock)
                            rec["slowdown_vs_B"] = rec["clone"][stat] / rec["default_B"][stat]
                            rec["slowdown_vs_2B"] = rec["clone"][stat] / rec["default_2B"][stat]
                        except Exception as err:  # noqa: BLE001 - recorded, never raised
                            rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                        records.append(rec)
                        bar.update(1)
                    del x, u, x2, cx
    finally:
        bar.close()
    return records


def render_markdown(result: Dict[str, Any]) -> str:
    cfg, machine = result["config"], result["machine"]
    lines = [f"# Per-operator slow-down of clone mode ({machine['device']})", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {machine['cpu']} ({machine['cpu_cores']} cores, {machine['torch_threads']} torch threads), "
             f"GPU: {machine.get('gpu') or 'none'}; torch {machine['torch']}. Load average start/end: "
             f"{result.get('load_start')} / {result.get('load_end')}. Wall time {result['elapsed_s'] / 60:.1f} min. "
             f"Code: {report.describe_git(result.get('git'))}.", "",
             f"{cfg['channels']}-channel inputs (B, {cfg['channels']}, S, S); times are the {cfg['stat']} over "
             f"{cfg['repeats']} runs after {cfg['warmup']} warm-up runs (fewer under the cell budget), in ms of "
             f"{'process CPU time' if cfg.get('clock') == 'cpu' else 'wall-clock time'}. "
             "`clone` runs the op on the clone batch of 2B rows `[x; x + s·u]` (dispatch included); "
             "`vs B` = clone / default op on B rows (the paper's slow-down; 2.0 = twice the rows at no overhead); "
             "`vs 2B` = clone / default op on the same 2B rows (the engine's overhead; 1.0 = none). "
             "The paper's figure uses 3 blocks [x; u; 0]; the difference form uses 2. "
             + ("CPU buffers stay on the heap (`--steady-malloc`: no per-call page faults, see the module doc)."
                if cfg.get("steady_malloc") else "Default allocator (page-fault costs included)."), ""]
    headers = ["op", "B", "S", "default B (ms)", "default 2B (ms)", "clone 2B (ms)", "vs B", "vs 2B"]
    body = []
    for r in result["records"]:
        if "error" in r:
            body.append([r["op"], r["batch_size"], r["size"], "fails", "", "", "", r["error"][:60]])
            continue
        st = cfg["stat"]
        body.append([r["op"], r["batch_size"], r["size"], report.fmt_seconds(r["default_B"][st] * 1e3),
                     report.fmt_seconds(r["default_2B"][st] * 1e3), report.fmt_seconds(r["clone"][st] * 1e3),
                     report.fmt_ratio(r["slowdown_vs_B"]), report.fmt_ratio(r["slowdown_vs_2B"])])
    lines += [report.md_table(headers, body, "lrrrrrrr"), ""]
    summ = result["summary"]
    lines += ["Geometric means over sizes: " + "; ".join(
        f"{op} B={b}: vs B {report.fmt_ratio(v['vs_B'])}, vs 2B {report.fmt_ratio(v['vs_2B'])}"
        for op, d in summ.items() for b, v in d.items()) + ".", ""]
    if result.get("notes"):
        lines += ["## Findings", "", result["notes"].strip(), ""]
    return "\n".join(lines)


def summarize(records: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for op in dict.fromkeys(r["op"] for r in records):
        for b in dict.fromkeys(r["batch_size"] for r in records):
            rs = [r for r in records if r["op"] == op and r["batch_size"] == b and "error" not in r]
            out.setdefault(op, {})[str(b)] = {"vs_B": report.geo_mean(r["slowdown_vs_B"] for r in rs),
                                              "vs_2B": report.geo_mean(r["slowdown_vs_2B"] for r in rs),
                                              "max_vs_2B": max((r["slowdown_vs_2B"] for r in rs), default=None)}
    return out


def plot(result: Dict[str, Any], path: str | Path) -> Path:
    """One panel per batch size: slow-down vs spatial size, solid vs B rows, dashed vs 2B rows."""
    plt = report.pyplot()
    records = result["records"]
    batches = list(dict.fromkeys(r["batch_size"] for r in records))
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 4.0), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for op in dict.fromkeys(r["op"] for r in records):
            rs = sorted((r for r in records if r["op"] == op and r["batch_size"] == b and "error" not in r),
                        key=lambda r: r["size"])
            xs = [r["size"] for r in rs]
            ax.plot(xs, [r["slowdown_vs_B"] for r in rs], "-o", color=COLORS.get(op), ms=3, label=f"{op} vs B rows")
            ax.plot(xs, [r["slowdown_vs_2B"] for r in rs], "--", color=COLORS.get(op), lw=1, label=f"{op} vs 2B rows")
        ax.axhline(1.0, color="red", lw=1)
        ax.axhline(2.0, color="gray", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("spatial size S")
        ax.set_ylabel("slow-down (×)")
        ax.set_title(f"batch {b}, {result['config']['channels']} channels ({result['machine']['device']})", fontsize=9)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _ints(text: str, what: str) -> List[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--{what}: expected a comma list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"--{what}: expected positive integers, got {text!r}")
    return vals


def build_parser(prog: str = "python -m jvpreg.bench.operators") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                description="Per-operator slow-down of clone mode (the paper's Fig. speedups).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ops", default="relu,maxpool,conv", help="comma list of: " + ", ".join(OPS))
    p.add_argument("--sizes", default="8,16,32,64,128", help="spatial sizes S")
    p.add_argument("--batch-sizes", default="10,80", help="batch sizes B (the paper's: 10 and 80)")
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cell-budget", type=float, default=None, help="seconds per timing; fewer repeats if slower")
    p.add_argument("--stat", choices=("median", "mean", "min"), default="median")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall clock or process CPU clock (CPU only, with --threads 1; see jvpreg.bench.paper)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--steady-malloc", choices=("auto", "on", "off"), default="auto",
                   help="keep CPU buffers on glibc's heap (no per-call page faults; see module doc); auto = on for CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/paper")
    p.add_argument("--name", default=None, help="file stem (default: operators_<device>)")
    p.add_argument("--notes", default=None, help="Markdown file appended as 'Findings'")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="re-render the MD (with --notes) and PNG of an earlier run from its JSON; runs nothing")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m jvpreg.bench.operators") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    if args.from_json:
        path = Path(args.from_json)
        result = report.read_json(path)
        if args.notes:
            result["notes"] = Path(args.notes).read_text()
            report.write_json(path, result)
        path.with_suffix(".md").write_text(render_markdown(result))
        if not args.no_plot:
            plot(result, path.with_suffix(".png"))
        print(f"re-rendered {path.with_suffix('.md')}")
        return 0
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            raise SystemExit(f"--ops: unknown op {o!r}; known: {', '.join(OPS)}")
    sizes, batches = _ints(args.sizes, "sizes"), _ints(args.batch_sizes, "batch-sizes")
    dev = torch.device(args.device)
    if args.clock == "cpu" and dev.type != "cpu":
        raise SystemExit("--clock cpu: only meaningful with --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    steady = args.steady_malloc == "on" or (args.steady_malloc == "auto" and dev.type == "cpu")
    steady = steady and report.steady_malloc()
    name = args.name or f"operators_{dev.type}"
    started = _dt.datetime.now().astimezone()
    load_start = report.load_average()
    t0 = time.perf_counter()
    records = run(ops, sizes, batches, channels=args.channels, repeats=args.repeats, warmup=args.warmup,
                  device=args.device, cell_budget=args.cell_budget, seed=args.seed, stat=args.stat, clock=args.clock,
                  show_progress=not args.quiet)
    result = {
        "benchmark": "operators", "command": report.command_line(prog, argv), "argv": argv,
        "machine": machine_description(dev), "git": report.git_state(),
        "started": started.isoformat(timespec="seconds"),
        "elapsed_s": time.perf_counter() - t0, "load_start": load_start, "load_end": report.load_average(),
        "config": {"ops": ops, "sizes": sizes, "batch_sizes": batches, "channels": args.channels,
                   "repeats": args.repeats, "warmup": args.warmup, "cell_budget": args.cell_budget,
                   "stat": args.stat, "clock": args.clock, "threads": torch.get_num_threads(),
                   "steady_malloc": steady,
                   "device": args.device, "seed": args.seed},
        "records": records, "summary": summarize(records),
        "notes": Path(args.notes).read_text() if args.notes else None,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_results(out / name, render_markdown(result), result)
    if not args.no_plot:
        plot(result, out / f"{name}.png")
    if not args.quiet:
        for op, d in result["summary"].items():
            for b, v in d.items():
                print(f"{op} B={b}: slow-down vs B {report.fmt_ratio(v['vs_B'])}, vs 2B {report.fmt_ratio(v['vs_2B'])}")
        print(f"wrote {out / name}.{{json,md,png}} in {result['elapsed_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
