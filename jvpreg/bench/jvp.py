"""``python -m jvpreg.bench jvp``: JVP engines side by side, medians over repeats, with ratios.

Methods, each in its best setting (no graph is kept for methods that do not need one):
plain forward of the B-row batch, plain forward of the 2B-row batch (the physical limit for a
clone JVP), ``jvpreg.jvp``, ``torch.func.jvp``, ``torch.autograd.forward_ad`` and
``torch.autograd.functional.jvp`` (the double-backward trick). Every method's JVP is checked
against jvpreg's once, so the table never compares wrong answers. A method that fails is
recorded as such (e.g. torch.func on train-mode BatchNorm) and the run goes on.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict

import torch

import jvpreg
from jvpreg.bench.report import command_line, geo_mean, measure_clocks, steady_malloc, write_results
from jvpreg.bench.timing import machine_description

METHODS = ("forward_B", "forward_2B", "jvpreg", "torch.func.jvp", "forward_ad", "autograd.functional.jvp")
AUTODIFF = ("torch.func.jvp", "forward_ad", "autograd.functional.jvp")


def _forward_ad(model, x, u):
    from torch.autograd import forward_ad as fwAD

    with fwAD.dual_level():
        out = model(fwAD.make_dual(x, u))
        return fwAD.unpack_dual(out)


def method_fns(model: torch.nn.Module, x: torch.Tensor, u: torch.Tensor) -> Dict[str, Callable[[], object]]:
    x2 = torch.cat([x, x])

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    return {
        "forward_B": no_grad(lambda: model(x)),
        "forward_2B": no_grad(lambda: model(x2)),
        # the default engine's steady state, whatever the number of warm-up calls
        "jvpreg": no_grad(lambda: jvpreg.jvp(model, (x,), (u,), engine="captured")),
        "torch.func.jvp": no_grad(lambda: torch.func.jvp(model, (x,), (u,))),
        "forward_ad": no_grad(lambda: _forward_ad(model, x, u)),
        "autograd.functional.jvp": lambda: torch.autograd.functional.jvp(model, x, u),
    }


def _jvp_of(result):
    if isinstance(result, tuple):
        return result[1]
    return None


def run(models, batch_size: int, image_size: int, repeats: int, warmup: int, device: str, mode: str,
        methods=METHODS, progress: bool = True, clock: str = "wall") -> dict:
    import torchvision

    from tqdm.auto import tqdm

    rows = []
    grid = [(m, meth) for m in models for meth in methods]
    bar = tqdm(total=len(grid), desc="bench jvp", disable=not progress)
    for name in models:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=1000).to(device)
        model.train() if mode == "train" else model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        x = torch.randn(batch_size, 3, image_size, image_size, device=device)
        u = torch.randn_like(x)
        fns = method_fns(model, x, u)
        ref = None
        row = {"model": name, "times": {}, "std": {}, "errors": {}, "rel_diff": {}}
        for meth in methods:
            bar.set_postfix_str(f"{name} / {meth}")
            try:
                torch.manual_seed(0)
                out = fns[meth]()
                jv = _jvp_of(out)
                if meth == "jvpreg":
                    ref = jv
                elif jv is not None and ref is not None:
                    row["rel_diff"][meth] = float((jv - ref).norm() / ref.norm())
                stats = measure_clocks(fns[meth], repeats=repeats, warmup=warmup, device=torch.device(device),
                                       clock=clock)
                row["times"][meth] = stats["median"]
                row["std"][meth] = stats["std"]
            except Exception as err:  # recorded, never fatal
                row["times"][meth] = None
                row["errors"][meth] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                if device != "cpu":
                    torch.cuda.empty_cache()
            bar.update(1)
        t = row["times"]
        alts = [t[m] for m in AUTODIFF if t.get(m)]
        row["fastest_autodiff"] = min(alts) if alts else None
        row["speedup_vs_fastest_autodiff"] = (min(alts) / t["jvpreg"]) if alts and t.get("jvpreg") else None
        row["jvpreg_over_forward_2B"] = (t["jvpreg"] / t["forward_2B"]) if t.get("jvpreg") and t.get("forward_2B") else None
        rows.append(row)
        del model
    bar.close()
    return {
        "rows": rows,
        "geomean_speedup_vs_fastest_autodiff": geo_mean(r["speedup_vs_fastest_autodiff"] for r in rows),
        "geomean_jvpreg_over_forward_2B": geo_mean(r["jvpreg_over_forward_2B"] for r in rows),
    }


def to_markdown(result: dict, meta: dict) -> str:
    cols = list(METHODS)
    lines = [
        f"# JVP engines side by side ({meta['device']}, {meta['mode']} mode)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']['cpu']} ({meta['machine']['cpu_cores']} cores, torch threads "
        f"{meta['machine']['torch_threads']}), GPU: {meta['machine']['gpu'] or 'none'}, torch {meta['machine']['torch']}  ",
        f"Batch {meta['batch_size']}, 3x{meta['image_size']}x{meta['image_size']}, float32, median of "
        f"{meta['repeats']} runs after {meta['warmup']} warm-up runs ({meta.get('clock', 'wall')} clock); times in ms.",
        "",
        "| model | " + " | ".join(cols) + " | jvpreg / fwd 2B | fastest autodiff / jvpreg |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for r in result["rows"]:
        cells = []
        for c in cols:
            v = r["times"].get(c)
            cells.append(f"{v * 1e3:.1f}" if v else "fails")
        ratio = r["jvpreg_over_forward_2B"]
        sp = r["speedup_vs_fastest_autodiff"]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + f" | {ratio:.2f} | {sp:.2f} |" if ratio and sp else
                     f"| {r['model']} | " + " | ".join(cells) + " | - | - |")
    lines += [
        "",
        f"**Geometric mean** — jvpreg / forward 2B: **{result['geomean_jvpreg_over_forward_2B']:.2f}** "
        f"(target ≤ 1.2); fastest autodiff / jvpreg: **{result['geomean_speedup_vs_fastest_autodiff']:.2f}x** "
        "(target ≥ 2.5).",
        "",
        "Max relative difference of each method's JVP to jvpreg's (float32):",
        "",
    ]
    for r in result["rows"]:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["rel_diff"].items())
        errs = "; ".join(f"{k}: {v}" for k, v in r["errors"].items())
        lines.append(f"- {r['model']}: {diffs}" + (f"; failures: {errs}" if errs else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jvpreg.bench jvp", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,vgg16,densenet121", help="comma-separated torchvision names")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", choices=("eval", "train"), default="eval")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or process CPU time (steadier on a shared machine; use with --threads 1)")
    ap.add_argument("--steady-malloc", action="store_true",
                    help="serve allocations from a never-trimmed heap (no page-fault noise on CPU)")
    ap.add_argument("--out", default="experiments/results/bench_jvp_{device}", help="output prefix (.md and .json)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steady_malloc:
        steady_malloc()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    result = run(models, args.batch_size, args.image_size, args.repeats, args.warmup, args.device, args.mode,
                 progress=not args.no_progress, clock=args.clock)
    meta = {
        "command": command_line("python -m jvpreg.bench jvp", sys.argv[1:] if argv is None else argv),
        "machine": machine_description(args.device),
        "device": args.device, "mode": args.mode, "batch_size": args.batch_size, "image_size": args.image_size,
        "repeats": args.repeats, "warmup": args.warmup, "clock": args.clock,
    }
    md = to_markdown(result, meta)
    print(md)
    paths = write_results(args.out.format(device=torch.device(args.device).type), md, {"meta": meta, **result})
    print("wrote " + " and ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
