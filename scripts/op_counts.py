"""ATen ops per call: the plain forward of the 2B-row batch against the captured engine's JVP program.

On a GPU a small-op model is launch-bound: each ATen op launches at least one kernel, so the time of a call follows
its op count more than its arithmetic. On the H100 the captured engine cost 1.8-3.2x the 2B forward on the four
small-op models (``experiments/results/gpu/bench_capture_small_fp32.md``) where it costs 1.03-1.46x on this CPU; the
ratio of op counts, measured here without a GPU, is the quantity to bring down for the GPU.

    python scripts/op_counts.py [--suites small,gpu] [--out experiments/results/op_counts]
"""
from __future__ import annotations

import argparse
import collections
import math
import sys

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import jvpreg
from jvpreg.bench import report
from jvpreg.bench.capture import SUITES
from jvpreg.bench.timing import machine_description
from jvpreg.clone import capture

_FREE = {"detach", "alias", "view", "_unsafe_view", "t", "expand", "expand_as", "unsqueeze", "squeeze", "reshape",
         "select", "slice", "permute", "transpose", "as_strided", "split", "split_with_sizes", "chunk", "unbind",
         "unflatten", "flatten", "lift_fresh", "empty", "empty_strided", "empty_like"}  # views and allocations


def graph_ops(gm) -> collections.Counter:
    """The ATen ops of an FX graph by name (``aten.addmm.default`` -> ``addmm``), calls of the graph's
    ``call_function`` nodes; ``operator.getitem`` and the like left out."""
    ops = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            ops[node.target._schema.name.split("::")[-1]] += 1
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverloadPacket):
            ops[node.target._qualified_op_name.split("::")[-1]] += 1
    return ops


def kernels(ops: collections.Counter) -> int:
    """Ops that launch a kernel on a GPU: all but views and allocations (copies count)."""
    return sum(n for name, n in ops.items() if name not in _FREE)


def model_row(suite: str, name: str) -> dict:
    build, shape = SUITES[suite][name]
    torch.manual_seed(0)
    model = build().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x, u = torch.randn(shape), torch.randn(shape)
    plain = graph_ops(make_fx(model, tracing_mode="real", pre_dispatch=True)(torch.cat([x, x + u])))  # as captured
    for _ in range(2):
        jvpreg.jvp(model, (x,), (u,), engine="captured")
    (program,) = [p for p in capture.programs(model).values() if p.gm is not None]
    clone = graph_ops(program.gm)
    extra = clone - plain
    return {"model": name, "input": "x".join(map(str, shape)), "forward_2B": kernels(plain),
            "captured": kernels(clone), "forward_2B_all": sum(plain.values()), "captured_all": sum(clone.values()),
            "extra": ", ".join(f"{op} +{n}" for op, n in extra.most_common() if op not in _FREE)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default="small")
    parser.add_argument("--out", default="experiments/results/op_counts",
                        help="output path without extension ('' to skip writing)")
    args = parser.parse_args(argv)
    command = report.command_line("python scripts/op_counts.py", sys.argv[1:] if argv is None else argv)
    rows = []
    for suite in args.suites.split(","):
        if suite not in SUITES:
            parser.error(f"unknown suite {suite!r}; expected one of {', '.join(SUITES)}")
        for name in SUITES[suite]:
            rows.append(model_row(suite, name))
            r = rows[-1]
            print(f"{name}: forward 2B {r['forward_2B']}, captured {r['captured']} ops", flush=True)
    machine = machine_description("cpu")
    ratio = lambda r, k: r[k] / r["forward_2B"]  # noqa: E731
    lines = ["# ATen ops per call: the captured engine's program against the plain 2B forward", "",
             f"Command: `{command}`  ",
             f"Machine: {machine['cpu']} (the counts do not depend on it); torch {torch.__version__}, eval mode, "
             "float32. `forward 2B`: the ATen graph of the plain forward of `[x; x + u]` (make_fx, pre-dispatch, as "
             "the capture traces); `captured`: the captured engine's program (what each replay runs). Ops that "
             "launch no kernel on a GPU (views, allocations) are left out of the first columns; `all` "
             "counts every op; `extra`: the ops the program runs more often than the plain 2B forward.", "",
             "| model | input | forward 2B | captured | captured / fwd 2B | all: fwd 2B, captured | extra ops in the "
             "captured program |", "|:---|---:|---:|---:|---:|---:|:---|"]
    lines += [f"| {r['model']} | {r['input']} | {r['forward_2B']} | {r['captured']} | {ratio(r, 'captured'):.2f} | "
              f"{r['forward_2B_all']}, {r['captured_all']} | {r['extra']} |" for r in rows]
    geo = math.exp(sum(math.log(ratio(r, "captured")) for r in rows) / len(rows))
    lines += ["", f"Geometric mean, captured / fwd 2B: **{geo:.2f}**"]
    print(lines[-1])
    if args.out:
        paths = report.write_results(args.out, "\n".join(lines) + "\n", {"command": command, "rows": rows})
        print("wrote " + " and ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
