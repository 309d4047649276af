"""``python -m jvpreg.bench <name> [options]``: run one benchmark (jvp, train, row_subset, paper, spectral, meanflow, clients, ...)."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "jvp": ("jvpreg.bench.jvp", "JVP engines side by side on ResNet-50 / VGG-16 / DenseNet-121 (issue: engine)"),
    "capture": ("jvpreg.bench.capture", "clone engines (eager, captured, compiled) vs the plain 2B forward and autodiff"),
    "train": ("jvpreg.bench.train", "regularized training step vs plain step and double backprop"),
    "row_subset": ("jvpreg.bench.row_subset", "tangents on a row subset: step cost, gradient variance, effect after training"),
    "paper": ("jvpreg.bench.paper", "the paper's timing tables over 13 architectures"),
    "spectral": ("jvpreg.bench.spectral", "top-k singular values: clone JVPs vs torch.func"),
    "meanflow": ("jvpreg.bench.meanflow", "mean-flow training step: clone JVP vs torch.func / autograd references"),
    "clients": ("jvpreg.bench.clients", "real client models (diffusers, timm, HF, ...) on their users' call forms"),
    "operators": ("jvpreg.bench.operators", "per-operator slow-down of clone mode (the paper's speed-up figure)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m jvpreg.bench {" + ",".join(BENCHMARKS) + "} [options]\n")
        for name, (_, doc) in BENCHMARKS.items():
            print(f"  {name:<9} {doc}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown benchmark {argv[0]!r}")
            return 2
        return 0
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
