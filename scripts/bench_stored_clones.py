"""What finding the clone batches a forward stores on its modules costs, searched afterwards vs noted when stored.

jvpreg.clone.eager.stored_clones searches the modules an eager clone forward ran once it ends; before 8698377 it noted
stores by assigning ``nn.Module.__setattr__`` around every clone forward, replayed ones included. This script
measures, on this machine, in one process:

1. the class assignment itself (``nn.Module.__setattr__`` set and put back; ``torch.autograd.Function.apply``, which
   the engine still sets, for comparison), and the search of a model's modules;
2. the callbacks' regularized training step (``jvpreg.bench.train``'s ``clone`` method: captured replays) with the
   search vs with the old assignment put back in, interleaved round-robin with the plain step on the 2B-row batch.

    python scripts/bench_stored_clones.py --models mlp200:64,vit,resnet18 --repeats 40 \
        --out experiments/results/stored_clones_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict

import torch
import torchvision
from torch import nn

from jvpreg.bench.timing import machine_description
from jvpreg.bench.train import Step, build
from jvpreg.clone.core.session import ROUTES, Session
from jvpreg.clone.eager import functions, stored_clones
from jvpreg.clone.eager.dispatch import dispatch


def per_call_us(fn: Callable[[], None], n: int = 300) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def subclasses(cls: type) -> int:
    return 1 + sum(subclasses(s) for s in cls.__subclasses__())


_PLAIN_SETATTR = nn.Module.__setattr__


def _noting_setattr(self: nn.Module, name: str, value) -> None:
    _PLAIN_SETATTR(self, name, value)


def _assign_setattr(session: Session = None) -> None:
    nn.Module.__setattr__ = _noting_setattr


def _restore_setattr(session: Session = None) -> None:
    nn.Module.__setattr__ = _PLAIN_SETATTR


#: the old way as a route of the clone forward's session: ``nn.Module.__setattr__`` assigned while it runs
SETATTR_ROUTE = (_assign_setattr, _restore_setattr)


def class_costs() -> Dict[str, float]:
    apply = torch.autograd.Function.__dict__["apply"]

    def toggle_setattr():
        _assign_setattr()
        _restore_setattr()

    def toggle_apply():
        torch.autograd.Function.apply = classmethod(functions._apply)
        torch.autograd.Function.apply = apply

    return {"nn.Module.__setattr__ set and put back (us)": per_call_us(toggle_setattr),
            "nn.Module subclasses": subclasses(nn.Module),
            "autograd.Function.apply set and put back (us)": per_call_us(toggle_apply),
            "autograd.Function subclasses": subclasses(torch.autograd.Function)}


def search_costs() -> Dict[str, Dict[str, float]]:
    out = {}
    for name, model in (("mlp200", build("mlp200")[0]), ("vit", build("vit")[0]),
                        ("resnet50", torchvision.models.resnet50())):
        def search():
            session = Session(dispatch)
            stored_clones.watch(session, model)
            stored_clones.release(session)

        out[name] = {"modules": sum(1 for _ in model.modules()), "search (us)": per_call_us(search)}
    return out


def steps(models: str, repeats: int) -> list:
    variants = ("search", "setattr assigned")  # the search runs in both: the second adds the assignment
    rows = []
    for spec in models.split(","):
        name, _, batch = spec.partition(":")
        model, shape = build(name)
        b = int(batch) if batch else 32
        x, y = torch.randn(b, *shape), torch.randint(0, 10, (b,))
        u = torch.randn_like(x)
        plain, clone = Step("plain_2b", model, x, y, u), Step("clone", model, x, y, u)
        for _ in range(5):
            plain(), clone()
        times = {"plain_2b": [], **{k: [] for k in variants}}
        for _ in range(repeats):
            for key in times:
                if key == "setattr assigned":
                    ROUTES.append(SETATTR_ROUTE)
                step = plain if key == "plain_2b" else clone
                start = time.perf_counter()
                try:
                    step()
                finally:
                    if key == "setattr assigned":
                        ROUTES.remove(SETATTR_ROUTE)
                times[key].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"model": f"{name} (B={b})", **{f"{k} (ms)": v for k, v in med.items()},
                     "search vs plain 2B": med["search"] / med["plain_2b"],
                     "setattr assigned vs plain 2B": med["setattr assigned"] / med["plain_2b"],
                     "saved per step (ms)": med["setattr assigned"] - med["search"]})
        print(rows[-1], flush=True)
    return rows


def markdown(result: dict) -> str:
    what = " ".join(p.replace("\n", " ") for p in __doc__.strip().split("\n\n")[1:3])
    lines = ["# Finding stored clone batches: searched afterwards vs noted by assigning nn.Module.__setattr__", "",
             " ".join(what.split()), "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}", "",
             "| class attribute | set and put back (us) | subclasses |", "|---|---:|---:|"]
    c = result["class_costs"]
    lines.append(f"| `nn.Module.__setattr__` | {c['nn.Module.__setattr__ set and put back (us)']:.1f} | "
                 f"{c['nn.Module subclasses']} |")
    lines.append(f"| `autograd.Function.apply` | {c['autograd.Function.apply set and put back (us)']:.1f} | "
                 f"{c['autograd.Function subclasses']} |")
    lines += ["", "| model | modules | search after an eager forward (us) |", "|---|---:|---:|"]
    for name, r in result["search_costs"].items():
        lines.append(f"| {name} | {r['modules']} | {r['search (us)']:.0f} |")
    lines += ["", "Regularized training step (`clone`: captured replays, the callbacks' path), medians over "
              "round-robin repeats:", "",
              "| model | plain 2B (ms) | search (ms) | setattr assigned (ms) | search vs plain 2B | "
              "setattr assigned vs plain 2B | saved per step (ms) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["steps"]:
        lines.append(f"| {r['model']} | {r['plain_2b (ms)']:.2f} | {r['search (ms)']:.2f} | "
                     f"{r['setattr assigned (ms)']:.2f} | {r['search vs plain 2B']:.2f}x | "
                     f"{r['setattr assigned vs plain 2B']:.2f}x | {r['saved per step (ms)']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp200:64,vit,resnet18")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = ("python scripts/bench_stored_clones.py --models " + args.models + f" --repeats {args.repeats}"
               + (f" --out {args.out}" if args.out else ""))
    m = machine_description()
    result = {"command": command,
              "machine": f"{m['cpu']}, {m['cpu_cores']} cores, torch {m['torch']} ({args.threads} thread(s)); load "
                         f"average at start {[round(v, 2) for v in os.getloadavg()]} (shared machine)",
              "class_costs": class_costs(), "search_costs": search_costs(), "steps": steps(args.models, args.repeats)}
    text = markdown(result)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}.md and {args.out}.json")


if __name__ == "__main__":
    main()
