#!/usr/bin/env python
"""Saved-for-backward and live-peak bytes of one training step per method (deterministic, unlike the RSS peak).

``python scripts/bench_memory.py [--models mlp:64,vit:32,resnet18_64px:64] [--out experiments/results/memory_cpu]``
uses :mod:`jvpreg.bench.train`'s steps and :mod:`jvpreg.bench.memory`'s counters: ``saved`` = distinct storages
autograd keeps for backward (parameters left out), ``live`` = peak bytes of live tensors during the step above those
live before it (``torch.profiler`` memory timeline).
"""
import argparse
import sys
import warnings

import torch

from jvpreg.bench import memory, report
from jvpreg.bench.timing import machine_description
from jvpreg.bench.train import Step, build, saved_for_backward

METHODS = ("plain", "plain_2b", "clone", "clone_rows50", "clone_rows25", "double_backprop")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp:64,vit:32,resnet18_64px:64")
    parser.add_argument("--out", default="experiments/results/memory_cpu")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rows = []
    for spec in args.models.split(","):
        name, _, b = spec.partition(":")
        torch.manual_seed(0)
        model, shape = build(name)
        x = torch.randn(int(b), *shape)
        y, u = torch.randint(0, 10, (int(b),)), torch.randn_like(x)
        for method in METHODS:
            step = Step(method, model, x, y, u)
            for _ in range(3):  # engine="auto" captures on the second step
                step()
            rows.append({"model": name, "batch": int(b), "method": method, "saved_bytes": saved_for_backward(step),
                         "live_bytes": memory.peak_live_bytes(step)})
            print(rows[-1], flush=True)
    ref = {(r["model"], r["method"]): r for r in rows}
    lines = ["# Saved-for-backward and live-peak memory of one training step (CPU)", "",
             f"Command: `{report.command_line('python scripts/bench_memory.py', sys.argv[1:] if argv is None else argv).strip()}`",
             "", f"Machine: {machine_description('cpu')['cpu']}, torch {torch.__version__}, 1 thread.", "",
             "| model | method | saved (MiB) | saved vs plain | saved vs plain 2B | live peak (MiB) | live vs plain | "
             "live vs plain 2B |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, p2 = ref[(r["model"], "plain")], ref[(r["model"], "plain_2b")]
        lines.append(f"| {r['model']} (B={r['batch']}) | {r['method']} | {r['saved_bytes'] / 2**20:.1f} | "
                     f"{r['saved_bytes'] / p['saved_bytes']:.2f}x | {r['saved_bytes'] / p2['saved_bytes']:.2f}x | "
                     f"{r['live_bytes'] / 2**20:.1f} | {r['live_bytes'] / p['live_bytes']:.2f}x | "
                     f"{r['live_bytes'] / p2['live_bytes']:.2f}x |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        report.write_results(args.out, md, {"machine": machine_description("cpu"), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
