"""Kernels per call: the plain forward of the 2B batch against a captured JVP, and training steps, on either path.

On a GPU a small-op model is launch-bound: each ATen op launches at least one kernel, so the time of a call follows
its kernel count more than its arithmetic. On the H100 the captured engine cost 1.8-3.2x the 2B forward on the four
small-op models (``experiments/results/gpu/bench_capture_small_fp32.md``) where it costs 1.0-1.5x on this CPU. This
script counts, without a GPU, what a call dispatches: every ATen op that reaches a kernel (views, allocations,
wrapped Python scalars and profiler markers left out; jvpreg's own operators counted by the ATen ops they run), for

* the whole call, not only the captured program: the scale choice, the guards' reads, the packing and unpacking;
* on the CPU's path and on an *accelerator's*, run on the ``meta`` device, which takes the same code paths as a GPU
  (the scales chosen by kernels and recorded in the program, the non-finite fixes kept: the inputs' finiteness is
  not read on a device) and has shapes without values (``tests/test_no_host_sync.py``);
* one training step (zero_grad, forward, backward, SGD with momentum) of ``jvpreg.bench train``'s methods on the
  accelerator path: plain, plain on the 2B batch, the regularized step (captured clone) and double backprop.

    python scripts/op_counts.py [--suites small,rnn] [--train mlp200:64,resnet18:32,vit:32]
                                [--out experiments/results/op_counts]
"""
from __future__ import annotations

import argparse
import collections
import math
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import jvpreg
from jvpreg.bench import report
from jvpreg.bench import train as bench_train
from jvpreg.bench.capture import SUITES
from jvpreg.bench.timing import machine_description
from jvpreg.clone.rules import kernels as jvp_kernels

META = torch.device("meta")
#: ops that launch no kernel: views, allocations, a Python scalar wrapped as a CPU tensor, profiler markers
FREE = frozenset({
    "detach", "alias", "view", "_unsafe_view", "t", "expand", "expand_as", "unsqueeze", "squeeze", "reshape",
    "_reshape_alias", "select", "slice", "permute", "transpose", "as_strided", "split", "split_with_sizes", "chunk",
    "unbind", "unflatten", "flatten", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
    "new_empty_strided", "scalar_tensor", "_record_function_enter_new", "_record_function_exit"})
#: reads of a value by the host: no kernel, but on a GPU a wait for every kernel queued before it
HOST_READS = frozenset({"_local_scalar_dense", "item", "equal", "is_nonzero"})
_OPERATORS = {name: fn for name, fn in jvp_kernels._IMPLS.values()}  # jvpreg::<name> -> its Python implementation


class KernelCount(TorchDispatchMode):
    """Counts the ops dispatched below autograd by name; a jvpreg operator by the ATen ops its implementation runs."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func._schema.name.split("::")
        if namespace == "jvpreg" and name in _OPERATORS:
            with self:
                return _OPERATORS[name](*args, **kwargs)
        self.ops[name] += 1
        return func(*args, **kwargs)

    @property
    def kernels(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in FREE and name not in HOST_READS)

    @property
    def host_reads(self) -> int:
        return sum(n for name, n in self.ops.items() if name in HOST_READS)

    def launching(self) -> collections.Counter:
        return collections.Counter({name: n for name, n in self.ops.items() if name not in FREE | HOST_READS})


def counted(fn) -> KernelCount:
    """The ops of one call of ``fn()``."""
    mode = KernelCount()
    with mode:
        fn()
    return mode


def _extra(ops: KernelCount, base: KernelCount) -> str:
    """The ops ``ops`` runs more often than ``base``, most first."""
    return ", ".join(f"{op} +{n}" for op, n in (ops.launching() - base.launching()).most_common())


def jvp_row(suite: str, name: str) -> dict:
    """Kernels of the plain 2B forward (its batch ``[x; x + u]`` built too) and of a replayed captured JVP call, on
    the CPU's path and on an accelerator's (``meta``)."""
    build, shape = SUITES[suite][name]
    row = {"suite": suite, "model": name, "input": "x".join(map(str, shape))}
    for path, device in (("cpu", torch.device("cpu")), ("accelerator", META)):
        torch.manual_seed(0)
        model = build().eval().to(device)
        for p in model.parameters():
            p.requires_grad_(False)
        x, u = torch.randn(shape, device=device), torch.randn(shape, device=device)
        with torch.no_grad():  # as an analysis call or `bench capture` runs it
            for _ in range(3):  # a capture, then replays
                jvpreg.jvp(model, (x,), (u,), engine="captured")
            plain = counted(lambda: model(torch.cat([x, x + u])))
            call = counted(lambda: jvpreg.jvp(model, (x,), (u,), engine="captured"))
        row[f"forward_2B_{path}"] = plain.kernels
        row[f"captured_{path}"] = call.kernels
        row[f"host_reads_{path}"] = call.host_reads
        row[f"extra_{path}"] = _extra(call, plain)
    return row


TRAIN_METHODS = ("plain", "plain_2b", "clone", "double_backprop")


def train_row(spec: str) -> dict:
    """Kernels of one training step of each of :data:`TRAIN_METHODS` (``jvpreg.bench train``'s steps, one-projection
    Jacobian penalty for the clone step) on the accelerator path, after two steps (a capture, a replay)."""
    name, _, batch = spec.partition(":")
    model, shape = bench_train.build(name)
    batch = int(batch or 32)
    torch.manual_seed(0)
    model = model.to(META)
    x = torch.randn(batch, *shape, device=META)
    y = torch.randint(0, 10, (batch,), device=META)
    u = torch.randn_like(x)
    row = {"model": name, "batch": batch}
    counts = {}
    for method in TRAIN_METHODS:
        step = bench_train.Step(method, model, x, y, u)
        for _ in range(2):
            step()
        counts[method] = counted(step)
        row[method] = counts[method].kernels
    row["extra_clone"] = _extra(counts["clone"], counts["plain_2b"])
    return row


def _geo(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def markdown(command: str, jvp_rows: list, train_rows: list) -> str:
    machine = machine_description("cpu")
    lines = ["# Kernels per call: the plain 2B forward, a captured JVP and a training step", "",
             f"Command: `{command}`  ",
             f"Machine: {machine['cpu']} (the counts do not depend on it); torch {torch.__version__}, float32, one "
             "tangent. Counted by a `TorchDispatchMode`: every ATen op that reaches a kernel (views, allocations, "
             "wrapped Python scalars and profiler markers left out; jvpreg's operators by the ATen ops they run). "
             "*Accelerator path*: the same calls on the `meta` device, which takes a GPU's code paths (scales chosen "
             "by kernels inside the JVP program, non-finite fixes kept) without a GPU. *Host reads*: values read by "
             "Python (free on the CPU; a wait for the device on a GPU: 0 on the accelerator path). On a GPU, where "
             "small models are launch-bound, time follows these counts (`scripts/op_counts.py`).", ""]
    if jvp_rows:
        lines += ["## One JVP call (eval, `jvpreg.jvp(model, (x,), (u,), engine=\"captured\")`, replayed)", "",
                  report.md_table(["model", "input", "fwd 2B", "captured, CPU", "ratio", "host reads", "fwd 2B, acc.",
                                   "captured, acc.", "ratio, acc.", "extra ops on the accelerator path"],
                                  [[r["model"], r["input"], r["forward_2B_cpu"], r["captured_cpu"],
                                    f"{r['captured_cpu'] / r['forward_2B_cpu']:.2f}", r["host_reads_cpu"],
                                    r["forward_2B_accelerator"], r["captured_accelerator"],
                                    f"{r['captured_accelerator'] / r['forward_2B_accelerator']:.2f}",
                                    r["extra_accelerator"]] for r in jvp_rows], "lrrrrrrrrl")]
        lines.append("")
        for suite in dict.fromkeys(r["suite"] for r in jvp_rows):
            rows = [r for r in jvp_rows if r["suite"] == suite]
            cpu = _geo(r["captured_cpu"] / r["forward_2B_cpu"] for r in rows)
            acc = _geo(r["captured_accelerator"] / r["forward_2B_accelerator"] for r in rows)
            lines.append(f"- {suite}: geometric mean, captured / fwd 2B: CPU path **{cpu:.2f}**, accelerator path "
                         f"**{acc:.2f}**")
        lines += ["", "Fused kernels count as one op: on the CPU the plain forward of the ViT runs torch's transformer "
                  "fast path (one op per layer) and the LSTM oneDNN's fused layer; on `meta` neither exists and their "
                  "decomposition is counted, so `fwd 2B, acc.` over-counts what a GPU launches for them (cuDNN's "
                  "RNN, the fast path) and their accelerator-path ratios are lower than a GPU's. The captured "
                  "program never takes those fused paths.", ""]
    if train_rows:
        lines += ["## One training step on the accelerator path (`jvpreg.bench train`'s steps)", "",
                  report.md_table(["model", "batch", "plain", "plain 2B", "clone (captured)", "double backprop",
                                   "clone / plain 2B", "double backprop / clone",
                                   "extra ops of the clone step over plain 2B"],
                                  [[r["model"], r["batch"], r["plain"], r["plain_2b"], r["clone"], r["double_backprop"],
                                    f"{r['clone'] / r['plain_2b']:.2f}", f"{r['double_backprop'] / r['clone']:.2f}",
                                    r["extra_clone"]] for r in train_rows], "lrrrrrrrl"), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default="small,rnn", help="model suites of `jvpreg.bench capture` ('' for none)")
    parser.add_argument("--train", default="mlp200:64,resnet18:32,vit:32",
                        help="name:batch of `jvpreg.bench train` models ('' for none)")
    parser.add_argument("--out", default="experiments/results/op_counts",
                        help="output path without extension ('' to skip writing)")
    args = parser.parse_args(argv)
    command = report.command_line("python scripts/op_counts.py", sys.argv[1:] if argv is None else argv)
    jvp_rows, train_rows = [], []
    for suite in filter(None, args.suites.split(",")):
        if suite not in SUITES:
            parser.error(f"unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
        for name in SUITES[suite]:
            jvp_rows.append(jvp_row(suite, name))
            r = jvp_rows[-1]
            print(f"{name}: forward 2B {r['forward_2B_cpu']}, captured {r['captured_cpu']} kernels (CPU path); "
                  f"{r['forward_2B_accelerator']}, {r['captured_accelerator']} (accelerator path)", flush=True)
    for spec in filter(None, args.train.split(",")):
        train_rows.append(train_row(spec))
        r = train_rows[-1]
        print(f"{spec} step: " + ", ".join(f"{m} {r[m]}" for m in TRAIN_METHODS) + " kernels", flush=True)
    text = markdown(command, jvp_rows, train_rows)
    print(text)
    if args.out:
        paths = report.write_results(args.out, text, {"command": command, "jvp": jvp_rows, "train": train_rows})
        print("wrote " + " and ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
