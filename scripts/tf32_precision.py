"""JVP precision with TF32 convolutions (cuDNN's default for float32 on NVIDIA GPUs since Ampere), emulated on the CPU.

On an H100 the clone engine's float32 JVP differed from torch.func.jvp's by 1e-1 (ResNet-50) and 5e-2
(DenseNet-121). This script shows where that comes from without a GPU: each convolution's input and weight are
rounded to TF32 (10-bit mantissa, round to nearest even) and accumulated in float32, and the JVPs of the clone engine
and of torch.func.jvp, in float32 with and without TF32, are compared with the float64 JVP.

    python scripts/tf32_precision.py [--models resnet18,resnet50,densenet121] [--size 64] [--out PATH]

(``torch.backends.cudnn.allow_tf32 = False`` gives float32 convolutions on a GPU.)
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

import jvpreg
from jvpreg.bench import report
from jvpreg.bench.timing import machine_description

aten = torch.ops.aten


def to_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to TF32's 10-bit mantissa (round to nearest, ties to even); float32 storage."""
    if t is None or t.dtype != torch.float32:
        return t
    i = t.contiguous().view(torch.int32)
    return ((i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF).view(torch.float32).reshape(t.shape)


class TF32Convolutions(TorchDispatchMode):
    """Every ``aten.convolution`` with its input and weight rounded to TF32, as cuDNN's TF32 kernels read them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.convolution.default:
            args = (to_tf32(args[0]), to_tf32(args[1]), *args[2:])
        return func(*args, **(kwargs or {}))


def errors(name: str, size: int, batch: int = 2) -> dict:
    """Relative errors against the float64 JVP of one torchvision model (random weights, eval mode)."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    x, u = torch.randn(batch, 3, size, size), torch.randn(batch, 3, size, size)
    exact = getattr(torchvision.models, name)().eval().double()
    exact.load_state_dict(model.state_dict())
    _, ref = torch.func.jvp(exact, (x.double(),), (u.double(),))
    rel = lambda t: ((t.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    row = {"model": name, "input": f"{batch}x3x{size}x{size}"}
    for label, mode in (("fp32", None), ("tf32", TF32Convolutions)):
        with mode() if mode else contextlib.nullcontext():
            _, clone = jvpreg.jvp(model, (x,), (u,), engine="eager")
            _, func = torch.func.jvp(model, (x,), (u,))
        row[f"clone_{label}"], row[f"func_{label}"] = rel(clone), rel(func)
        row[f"clone_vs_func_{label}"] = ((clone - func).norm() / func.norm()).item()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,resnet50,densenet121")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", default="experiments/results/tf32_precision_cpu",
                        help="output path without extension ('' to skip writing)")
    args = parser.parse_args(argv)
    command = report.command_line("python scripts/tf32_precision.py", sys.argv[1:] if argv is None else argv)
    rows = []
    for name in args.models.split(","):
        rows.append(errors(name, args.size))
        r = rows[-1]
        print(f"{name}: clone fp32 {r['clone_fp32']:.1e}, torch.func fp32 {r['func_fp32']:.1e}, clone TF32 "
              f"{r['clone_tf32']:.1e}, torch.func TF32 {r['func_tf32']:.1e}", flush=True)
    machine = machine_description("cpu")
    lines = [
        "# JVP precision with TF32 convolutions (emulated on the CPU)", "",
        f"Command: `{command}`  ",
        f"Machine: {machine['cpu']} ({machine['cpu_cores']} cores), torch {machine['torch']}; random weights, eval "
        "mode.",
        "", "Relative error of each float32 JVP against the float64 JVP (`torch.func.jvp` of the float64 model); "
        "TF32: every convolution's input and weight rounded to a 10-bit mantissa, as cuDNN's TF32 kernels (the "
        "default for float32 convolutions on NVIDIA GPUs since Ampere) read them.", "",
        "| model | input | clone fp32 | torch.func fp32 | clone TF32 | torch.func TF32 | clone vs torch.func, TF32 |",
        "|:---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['input']} | {r['clone_fp32']:.1e} | {r['func_fp32']:.1e} | {r['clone_tf32']:.1e} "
              f"| {r['func_tf32']:.1e} | {r['clone_vs_func_tf32']:.1e} |" for r in rows]
    if args.out:
        paths = report.write_results(args.out, "\n".join(lines) + "\n", {"command": command, "rows": rows})
        print("wrote " + " and ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
