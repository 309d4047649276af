"""The callbacks' regularized step with the input packed inside the captured program vs outside it.

:class:`jvpreg.callbacks.SharedForward` records ``(args, u, s) -> (f(x), J u, s)`` as one program
(:func:`jvpreg.clone.api.packed_call`): the clone batch ``[x; x + s u]`` is built and the output unpacked,
``(y_1 - y_0) / s``, inside it. Before, both ran as eager PyTorch and Python around the replay of the model's
program (``jvpreg.clone.pack`` and ``unpack``: a ``CloneTensor`` made, its output split, a NaN check read back).

This script measures, on this machine, in one process, interleaved round-robin (one step of each method per
round, medians over the rounds): the plain step on the 2B-row batch (the physical limit), the regularized step
(``jvpreg.bench.train``'s ``clone`` method: JacobianFrobenius, one projection) packed inside the program (now)
and outside it (before: ``SharedForward._packs_in_program`` forced to ``False``), and the same penalty by double
backprop (Hoffman et al. 2019), on each engine asked for.

    python scripts/bench_packed_forward.py --models mlp200:64,vit,resnet18 --engines auto --repeats 60 \
        --out experiments/results/packed_forward_cpu
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Dict, Iterator, List

import torch

from jvpreg.bench.report import write_results
from jvpreg.bench.timing import machine_description
from jvpreg.bench.train import Step, build
from jvpreg.callbacks.shared import SharedForward

ENGINE_METHODS = {"auto": "clone", "compiled": "clone_compiled", "eager": "clone_eager"}


@contextlib.contextmanager
def packed_outside() -> Iterator[None]:
    """The shared forward as before: the input packed, and the output unpacked, outside the program."""
    saved = SharedForward._packs_in_program
    SharedForward._packs_in_program = lambda self, *args: False
    try:
        yield
    finally:
        SharedForward._packs_in_program = saved


def steps(models: str, engines: str, repeats: int, warmup: int = 5) -> List[Dict[str, float]]:
    rows = []
    for spec in models.split(","):
        name, _, batch = spec.partition(":")
        model, shape = build(name)
        b = int(batch) if batch else 32
        torch.manual_seed(0)
        x, y = torch.randn(b, *shape), torch.randint(0, 10, (b,))
        u = torch.randn_like(x)
        runs = {"plain_2b": (Step("plain_2b", model, x, y, u), contextlib.nullcontext),
                "double_backprop": (Step("double_backprop", model, x, y, u), contextlib.nullcontext)}
        for engine in engines.split(","):
            method = ENGINE_METHODS[engine]
            runs[f"{engine}: packed inside"] = (Step(method, model, x, y, u), contextlib.nullcontext)
            runs[f"{engine}: packed outside"] = (Step(method, model, x, y, u), packed_outside)
        for step, context in runs.values():
            with context():
                for _ in range(warmup):  # the default engine: eager once, records on the 2nd step
                    step()
        times: Dict[str, List[float]] = {k: [] for k in runs}
        for _ in range(repeats):
            for key, (step, context) in runs.items():
                with context():
                    start = time.perf_counter()
                    step()
                    times[key].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"model": f"{name} (B={b})", **{f"{k} (ms)": v for k, v in med.items()}}
        for engine in engines.split(","):
            inside, outside = med[f"{engine}: packed inside"], med[f"{engine}: packed outside"]
            row[f"{engine}: inside vs plain 2B"] = inside / med["plain_2b"]
            row[f"{engine}: outside vs plain 2B"] = outside / med["plain_2b"]
            row[f"{engine}: saved per step (ms)"] = outside - inside
            row[f"{engine}: double backprop vs inside"] = med["double_backprop"] / inside
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(result: dict) -> str:
    what = " ".join(p.replace("\n", " ") for p in __doc__.strip().split("\n\n")[:3])
    lines = ["# The shared forward packed inside the captured program vs outside it", "", " ".join(what.split()), "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}", "",
             "| model | engine | plain 2B (ms) | packed inside (ms) | packed outside (ms) | inside / plain 2B | "
             "outside / plain 2B | saved per step (ms) | double backprop (ms) | double backprop / inside |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["steps"]:
        for engine in result["engines"]:
            lines.append(f"| {r['model']} | {engine} | {r['plain_2b (ms)']:.2f} | {r[f'{engine}: packed inside (ms)']:.2f} "
                         f"| {r[f'{engine}: packed outside (ms)']:.2f} | {r[f'{engine}: inside vs plain 2B']:.2f}x | "
                         f"{r[f'{engine}: outside vs plain 2B']:.2f}x | {r[f'{engine}: saved per step (ms)']:.2f} | "
                         f"{r['double_backprop (ms)']:.2f} | {r[f'{engine}: double backprop vs inside']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp200:64,vit,resnet18")
    parser.add_argument("--engines", default="auto", help="comma-separated: auto, compiled, eager")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    unknown = [e for e in args.engines.split(",") if e not in ENGINE_METHODS]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; expected a comma-separated list of {sorted(ENGINE_METHODS)}")
    torch.set_num_threads(args.threads)
    command = (f"python scripts/bench_packed_forward.py --models {args.models} --engines {args.engines} "
               f"--repeats {args.repeats} --threads {args.threads}" + (f" --out {args.out}" if args.out else ""))
    m = machine_description()
    load = [round(v, 2) for v in os.getloadavg()]
    rows = steps(args.models, args.engines, args.repeats)
    result = {"command": command, "engines": args.engines.split(","), "steps": rows,
              "machine": f"{m['cpu']}, {m['cpu_cores']} cores, torch {m['torch']} ({args.threads} thread(s)); load "
                         f"average at start {load}, at end {[round(v, 2) for v in os.getloadavg()]} (shared machine)"}
    text = markdown(result)
    print(text)
    if args.out:
        print("wrote {} and {}".format(*write_results(args.out, text, result)))


if __name__ == "__main__":
    main()
