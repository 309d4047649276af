"""``python -m jvpreg.bench meanflow``: one mean-flow training step (forward, JVP, backward, optimizer) by jvpreg
and by the reference formulations, on DiTs, medians over interleaved repeats in one process, with ratios.

Methods (:class:`jvpreg.losses.MeanFlowLoss`, same times, noise and labels):

* ``plain_fm``: a flow-matching step without JVP (forward + backward of ``B`` rows): the floor.
* ``jvpreg``: ``method="clone"``, ``shared_forward=False`` (the default): clone JVP without graph, then a forward
  with gradients. Attention runs on whatever backend ``F.scaled_dot_product_attention`` picks (flash on a GPU).
* ``jvpreg_shared``: ``shared_forward=True``: ``u`` and ``du/dt`` from one clone forward with gradients.
* ``torch.func``: ``torch.func.jvp`` (no graph) under the math attention backend, then a forward with gradients.
* ``autograd``: ``torch.autograd.functional.jvp`` (double backward) under the math backend, then the forward.

Each method's ``du/dt`` is checked against jvpreg's once (relative difference in the table), so the table never
compares wrong answers. Repeats are interleaved (one step of every method per round), so slow phases of a shared
machine hit every method alike.
"""
from __future__ import annotations

import contextlib

import argparse
import statistics
import sys
import time
from typing import Callable, Dict

import torch

from jvpreg.bench.report import command_line, load_average, write_results
from jvpreg.bench.timing import machine_description, sync
from jvpreg.losses import MeanFlowLoss
from jvpreg.models import DiT

METHODS = ("plain_fm", "jvpreg", "jvpreg_shared", "torch.func", "autograd")
#: name -> (DiT kwargs, image side)
SIZES = {
    "dit_s": (dict(dim=64, depth=4, heads=4, patch_size=2), 8),
    "dit_m": (dict(dim=128, depth=6, heads=4, patch_size=2), 16),
}


def _loss(method: str) -> MeanFlowLoss:
    kwargs = {"jvpreg": {}, "jvpreg_shared": dict(shared_forward=True), "torch.func": dict(method="torch.func"),
              "autograd": dict(method="autograd")}[method]
    return MeanFlowLoss(seed=0, label_dropout=0.1, engine="auto", **kwargs)


def step_fns(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
    """One optimizer step per call for every method (the optimizer is shared: only the time is of interest)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    fm = MeanFlowLoss(seed=0, equal_fraction=1.0)  # r = t: flow matching; its step below skips the JVP

    def plain():
        opt.zero_grad(set_to_none=True)
        r, t = fm.sample_times(x.shape[0], x)
        e = torch.randn_like(x)
        tb = t[:, None, None, None]
        loss = (net((1 - tb) * x + tb * e, r, t, y) - (e - x)).pow(2).flatten(1).sum(1).mean()
        loss.backward()
        opt.step()
        return loss

    def make(fn: MeanFlowLoss, math_attention: bool):
        def run():
            opt.zero_grad(set_to_none=True)
            with _attention(math_attention):
                out = fn(net, x, y)
                out.loss.backward()
            opt.step()
            return out.loss
        return run

    # the references as public code runs them: fused attention off on an accelerator (neither has its JVP)
    refs = x.device.type != "cpu"
    return {"plain_fm": plain, **{m: make(_loss(m), refs and m in ("torch.func", "autograd"))
                                  for m in METHODS if m != "plain_fm"}}


def _attention(math: bool):
    """SDPA's math kernel (``math``), else torch's choice (fused kernels where they run)."""
    if not math:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def check(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Dict[str, float]:
    """``||du/dt - du/dt_jvpreg|| / ||du/dt_jvpreg||`` of every method on one draw of ``(z, v, r, t)`` (``du/dt``
    itself: in the loss it is scaled by ``t - r`` and summed with ``v``, and float32 rounding can hide it there)."""
    g = torch.Generator().manual_seed(0)
    b = x.shape[0]
    z, v = (torch.randn(x.shape, generator=g).to(x) for _ in range(2))
    t = torch.rand(b, generator=g).to(x)
    r = t * torch.rand(b, generator=g).to(x)
    ref = _loss("jvpreg").velocity_and_derivative(net, z, v, r, t, {"y": y})[1]
    out = {}
    for m in METHODS:
        if m not in ("plain_fm", "jvpreg"):
            with _attention(x.device.type != "cpu" and m in ("torch.func", "autograd")):
                got = _loss(m).velocity_and_derivative(net, z, v, r, t, {"y": y})[1]
            out[m] = float((got - ref).norm() / ref.norm())
    return out


def run(sizes, batch_size: int, repeats: int, warmup: int, device: str, clock: str = "wall") -> dict:
    rows = []
    for name in sizes:
        kwargs, side = SIZES[name]
        torch.manual_seed(0)
        net = DiT(1, side, num_classes=10, zero_init=False, **kwargs).to(device)
        x = torch.randn(batch_size, 1, side, side, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        diffs = check(net, x, y)
        fns = step_fns(net, x, y)
        times: Dict[str, list] = {m: [] for m in METHODS}
        errors: Dict[str, str] = {}
        for _ in range(warmup):
            for m in METHODS:
                try:
                    fns[m]()
                except Exception as err:  # recorded, never fatal
                    errors[m] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        for _ in range(repeats):
            for m in METHODS:
                if m in errors:
                    continue
                sync(device)
                w0, c0 = time.perf_counter(), time.process_time()
                fns[m]()
                sync(device)
                times[m].append((time.process_time() - c0) if clock == "cpu" else (time.perf_counter() - w0))
        med = {m: (statistics.median(v) if v else None) for m, v in times.items()}
        params = sum(p.numel() for p in net.parameters())
        rows.append({"size": name, "dit": kwargs, "image": side, "params": params, "times": med,
                     "all_times": times, "errors": errors, "rel_diff_to_jvpreg": diffs,
                     "ratios_to_torch_func": {m: med[m] / med["torch.func"] for m in METHODS
                                              if med.get(m) and med.get("torch.func")}})
    return {"rows": rows}


def to_markdown(result: dict, meta: dict) -> str:
    m = meta["machine"]
    lines = [
        f"# Mean-flow training step, jvpreg vs the reference formulations ({meta['device']})",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {m['cpu']} ({m['cpu_cores']} cores, torch threads {m['torch_threads']}), GPU: {m['gpu'] or 'none'}, "
        f"torch {m['torch']}; load average before/after {meta['load_before']} / {meta['load_after']}  ",
        f"Batch {meta['batch_size']}, float32, class-conditional DiT, median of {meta['repeats']} interleaved "
        f"repeats after {meta['warmup']} warm-up rounds ({meta['clock']} clock); times in ms. A step is "
        "zero_grad + loss (times, noise, JVP, target, adaptive L2) + backward + AdamW.",
        "",
        "| size | params | tokens | " + " | ".join(METHODS) + " | jvpreg / torch.func | jvpreg_shared / torch.func |",
        "|---|---|---|" + "---|" * (len(METHODS) + 2),
    ]
    for r in result["rows"]:
        cells = [f"{r['times'][c] * 1e3:.1f}" if r["times"].get(c) else "fails" for c in METHODS]
        ra = r["ratios_to_torch_func"]
        tokens = (r["image"] // r["dit"]["patch_size"]) ** 2
        lines.append(f"| {r['size']} (dim {r['dit']['dim']}, depth {r['dit']['depth']}, {r['image']}x{r['image']}) "
                     f"| {r['params'] / 1e6:.2f}M | {tokens} | " + " | ".join(cells)
                     + f" | **{ra.get('jvpreg', float('nan')):.2f}** | {ra.get('jvpreg_shared', float('nan')):.2f} |")
    lines += ["", "Relative difference of each method's du/dt to jvpreg's (one draw of z, v, r, t; float32):", ""]
    for r in result["rows"]:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["rel_diff_to_jvpreg"].items())
        errs = "; ".join(f"{k}: {v}" for k, v in r["errors"].items())
        lines.append(f"- {r['size']}: {diffs}" + (f"; failures: {errs}" if errs else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jvpreg.bench meanflow", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="dit_s,dit_m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3, help="rounds before timing (the clone program is captured "
                                                          "on the second call)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or process CPU time (steadier on a shared machine; with --threads 1)")
    ap.add_argument("--out", default="experiments/results/bench_meanflow_{device}", help="output prefix (.md, .json)")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown sizes {unknown}; choose from {', '.join(SIZES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    result = run(sizes, args.batch_size, args.repeats, args.warmup, args.device, args.clock)
    meta = {"command": command_line("python -m jvpreg.bench meanflow", sys.argv[1:] if argv is None else argv),
            "machine": machine_description(args.device), "device": args.device, "batch_size": args.batch_size,
            "repeats": args.repeats, "warmup": args.warmup, "clock": args.clock, "load_before": load_before,
            "load_after": load_average()}
    md = to_markdown(result, meta)
    print(md)
    paths = write_results(args.out.format(device=torch.device(args.device).type), md, {"meta": meta, **result})
    print("wrote " + " and ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
