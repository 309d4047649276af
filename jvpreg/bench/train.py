"""Training-step benchmark: plain step vs clone-mode Jacobian regularization vs autodiff alternatives.

``python -m jvpreg.bench train [--models resnet18,mlp] [--batch 32] [--repeats 10]`` times one full
training step (zero_grad, forward, backward, SGD step) per method and writes Markdown + JSON:

* ``plain``: task loss only.
* ``plain_2b``: the plain step on the doubled batch ``[x; x + u]`` (labels repeated): what a clone step would
  cost if the engine added nothing to the 2B-row forward and backward, the floor of the clone methods.
* ``clone``: task loss + lam * JacobianFrobenius (1 projection, whole batch) through the callbacks'
  own code path (:class:`jvpreg.callbacks.SharedForward` armed around the model call: one forward
  of the 2B-row batch, one backward), on the default engine (captured from the second step; the warm-up
  steps take the eager one and the capture); ``clone_eager`` and
  ``clone_compiled`` force the eager and the compiled engines (:mod:`jvpreg.clone.program.capture`); ``clone_graphed`` the
  compiled program replayed as CUDA graphs (``engine="graphed"``; on the CPU, the compiled one).
* ``clone_rows50``, ``clone_rows25``: ``clone`` with tangents on a random half / quarter of the rows
  (``row_subset=0.5`` / ``0.25``, :mod:`jvpreg.losses.row_subset`): the other rows run plainly, a step runs
  ``B + b`` rows.
* ``plain_compiled``: the plain step with the model under ``torch.compile`` (the reference for
  ``clone_compiled``, with the compiled engine's Inductor options: :func:`jvpreg.clone.program.capture.inductor_options`).
* ``double_backprop_compiled``: ``double_backprop`` through the ``torch.compile``-d model, which torch refuses
  (AOTAutograd has no double backward), so double backprop's best is the eager ``double_backprop``.
* ``double_backprop``: Hoffman et al. 2019 (facebookresearch/jacobian_regularizer): a random unit
  output projection ``v`` per sample, ``vᵀJ`` by ``autograd.grad(create_graph=True)``, penalty
  ``C ||vᵀJ||² / (2B)``, then the backward through that graph.
* ``forward_ad``: ``torch.autograd.forward_ad`` dual input, ``||J u||²`` differentiated in reverse.
* ``func_jvp``: ``torch.func.jvp`` of the module, ``||J u||²`` differentiated in reverse.
* ``functional_jvp``: ``torch.autograd.functional.jvp(create_graph=True)`` (the double-backward trick).

The four autodiff alternatives run with scaled-dot-product attention forced onto its math kernel
(``sdpa_kernel(SDPBackend.MATH)``): the fused CPU kernel has neither a double backward nor forward
AD, so on a ViT they would fail; the clone methods keep the fused kernel.

Methods that raise are recorded as ``fails`` with the error. For the JVP-based alternatives the
benchmark also checks their parameter gradients against the clone step's on the same batch and
direction, in float64 (``grad_check``; in float32 a ReLU unit within rounding of its kink can flip
between engines, see :meth:`Step.gradient`): ``torch.autograd.forward_ad`` runs on train-mode BatchNorm but its
tangent is not correctly differentiable in reverse mode (wrong gradients, see
``tests/test_losses.py::test_native_batchnorm_forward_ad_is_not_a_valid_reference``). Likewise
reverse mode through forward AD of LayerNorm (the ViT's ``func_jvp``): in float64, the derivative of
``||J u||²`` along a random parameter direction of Linear -> LayerNorm -> Linear is -5.78 by
``torch.func.jvp`` and -19.32 by finite differences and by the clone step.

Timing: every method gets ``warmup`` untimed steps, then ``repeats`` rounds of one timed step per
method each (round-robin, so load changes on a shared machine hit all methods alike); wall-clock
medians (what the targets use) and process CPU time are reported. On a busy machine use
``--threads 1``: with several OpenMP threads, a thread descheduled by another job stalls every
parallel region. ``--no-inplace`` turns in-place activations
(ResNet's ``ReLU(inplace=True)``) into out-of-place ones for every method. ``--device cuda`` times with CUDA
synchronisation and takes peak memory from the caching allocator (written for the GPU tables; not run here: no GPU).
``--autocast bf16`` runs every method's forward and penalty under ``torch.autocast`` (backward outside it, as in a
user's mixed-precision step); the float64 gradient check runs without it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..callbacks.shared import SharedForward
from jvpreg.clone.program.capture import inductor_options
from ..losses import JacobianFrobenius
from . import memory, report
from .capture import random_head, vit_small
from .timing import machine_description, measure

LAM = 0.01
METHODS = ("plain", "plain_2b", "clone", "clone_eager", "clone_rows50", "clone_rows25", "double_backprop", "forward_ad", "func_jvp", "functional_jvp",
           "plain_compiled", "clone_compiled", "clone_graphed", "double_backprop_compiled")
CLONE_ENGINES = {"clone": "auto", "clone_eager": "eager", "clone_compiled": "compiled", "clone_graphed": "graphed", "clone_rows50": "auto",
                 "clone_rows25": "auto"}
ROW_SUBSETS = {"clone_rows50": 0.5, "clone_rows25": 0.25}
JVP_METHODS = ("forward_ad", "func_jvp", "functional_jvp", "clone_eager", "clone_compiled")
DEFAULT_OUT = "experiments/results/bench_train_cpu"
AUTOCAST = {"none": None, "bf16": torch.bfloat16}


def build(name: str) -> tuple:
    """``(model, input_shape)`` for a benchmark model name."""
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10), (3, 32, 32)
    if name == "resnet18_64px":  # the memory target's case: ResNet-18 on 64x64 images
        import torchvision

        return torchvision.models.resnet18(num_classes=10), (3, 64, 64)
    if name == "resnet18_gn":  # GroupNorm(32) in place of BatchNorm
        import torchvision

        return torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(32, c)), (3, 32, 32)
    if name == "mlp":
        from ..models import MLP

        return MLP(in_features=784, hidden=(512, 512), num_classes=10), (1, 28, 28)
    if name == "mlp200":  # Hoffman et al.'s MNIST MLP
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                             nn.Linear(200, 10)), (1, 28, 28)
    if name == "vit":
        return vit_small(), (3, 32, 32)
    if name == "vit_257":  # the small ViT on 64x64 images with 4x4 patches: 257 tokens, attention-dominated
        import torchvision

        return random_head(torchvision.models.VisionTransformer(image_size=64, patch_size=4, num_layers=4, num_heads=4,
                                                                 hidden_dim=64, mlp_dim=128, num_classes=10)), (3, 64, 64)
    raise ValueError(f"bench train: unknown model {name!r}; expected 'resnet18', 'resnet18_64px', "
                     "'resnet18_gn', 'mlp', 'mlp200', 'vit' or 'vit_257'.")


class FixedDirection(JacobianFrobenius):
    """JacobianFrobenius along one given direction (gradient checks against the alternatives)."""

    def __init__(self, u: torch.Tensor):
        super().__init__(1)
        self.u = u

    def directions(self, x, context):
        return self.u[None]


class Step:
    """One method's training step on a private copy of the model (same initial weights for all)."""

    def __init__(self, method: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, u: torch.Tensor,
                 autocast: Optional[torch.dtype] = None):
        self.method, self.initial, self.x, self.y, self.u = method, model, x, y, u
        self.autocast = autocast
        self.model = copy.deepcopy(model).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.forward = (torch.compile(self.model, options=inductor_options(x.device.type))  # as the compiled engine
                        if method in ("plain_compiled", "double_backprop_compiled") else self.model)
        self.shared = self._shared(self.model)
        self.random_penalty = JacobianFrobenius(1)

    def __call__(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        with self.amp():
            loss = self.loss(self.model, self.shared, self.random_penalty)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def amp(self) -> contextlib.AbstractContextManager:
        """The forward's autocast region (``--autocast``; backward runs outside it, as in a user's AMP step)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.x.device.type, dtype=self.autocast)

    def _shared(self, model: nn.Module) -> Optional[SharedForward]:
        engine = CLONE_ENGINES.get(self.method)
        return None if engine is None else SharedForward(model, engine=engine)

    def gradient(self) -> Dict[str, torch.Tensor]:
        """Parameter gradients at the initial weights along the fixed direction ``u`` (no update), in float64.

        A ReLU network's JVP jumps where a pre-activation crosses 0, so in float32 two engines whose kernels round
        the primal differently can disagree at a unit whose pre-activation is within rounding of 0: one such unit
        (|x| = 5e-6) moved the compiled engine's float32 gradients of ResNet-18 by 1.4e-2. In float64 the engines
        agree to 1e-13, and a wrong gradient (forward AD through train-mode BatchNorm) still shows at 1e-1."""
        model = copy.deepcopy(self.initial).double().train()
        shared = self._shared(model)
        loss = self.loss(model, shared, FixedDirection(self.u.double()), batch=(self.x.double(), self.y, self.u.double()))
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        return {n: g for (n, _), g in zip(model.named_parameters(), grads) if g is not None}

    def loss(self, model: nn.Module, shared: Optional[SharedForward], penalty: JacobianFrobenius,
             batch: Optional[tuple] = None) -> torch.Tensor:
        """The step's loss on ``batch`` = ``(x, y, u)`` (default: the step's own)."""
        x, y, u = (self.x, self.y, self.u) if batch is None else batch
        b = x.shape[0]
        if self.method in ("plain", "plain_compiled"):
            return F.cross_entropy((self.forward if model is self.model else model)(x), y)
        if self.method == "plain_2b":
            return F.cross_entropy(model(torch.cat([x, x + u])), torch.cat([y, y]))
        if shared is not None:  # the callbacks' code path: hooks armed around the user's forward
            shared.arm([(penalty, LAM, 1.0)], row_subset=ROW_SUBSETS.get(self.method))
            try:
                out = model(x)  # plain f(x) for the user's code; the clone forward ran underneath
                return F.cross_entropy(out, y) + shared.total()
            finally:
                shared.disarm()
        with sdpa_kernel(SDPBackend.MATH):  # autodiff through fused attention has no double backward / forward AD
            return self._autodiff_loss(model, x, y, u, b)

    def _autodiff_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, u: torch.Tensor,
                       b: int) -> torch.Tensor:
        if self.method in ("double_backprop", "double_backprop_compiled"):
            # Hoffman et al.: random unit output projection, C ||v^T J||^2 / 2B
            xg = x.clone().requires_grad_()
            out = (self.forward if model is self.model else model)(xg)
            c = out.shape[1]
            v = torch.randn(b, c, dtype=out.dtype, device=out.device)
            v = v / v.norm(dim=1, keepdim=True)
            (jv,) = torch.autograd.grad(out, xg, v, create_graph=True)
            return F.cross_entropy(out, y) + LAM * 0.5 * c * jv.pow(2).sum() / b
        if self.method == "forward_ad":
            with fwAD.dual_level():
                out, t = fwAD.unpack_dual(model(fwAD.make_dual(x, u)))
                return F.cross_entropy(out, y) + LAM * t.pow(2).sum() / b
        if self.method == "func_jvp":
            out, t = torch.func.jvp(model, (x,), (u,))
            return F.cross_entropy(out, y) + LAM * t.pow(2).sum() / b
        if self.method == "functional_jvp":  # the double-backward trick
            out, t = torch.autograd.functional.jvp(model, x, u, create_graph=True)
            return F.cross_entropy(out, y) + LAM * t.pow(2).sum() / b
        raise ValueError(f"unknown method {self.method!r}")


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def saved_for_backward(step: "Step") -> float:
    """Bytes autograd keeps for backward in one step's loss, parameters left out (:func:`memory.saved_bytes`).

    Deterministic, unlike the RSS peak: the activations a step holds at the end of its forward, which is
    what the clone rules must keep to the 2B forward's (``tests/clone/test_grad.py`` checks them layer by
    layer).
    """
    def loss() -> torch.Tensor:
        with step.amp():
            return step.loss(step.model, step.shared, step.random_penalty)

    return memory.saved_bytes(loss, exclude=step.model.parameters())


def peak_memory(step: "Step", repeats: int = 5) -> Optional[float]:
    if step.x.device.type == "cuda":
        return _cuda_peak_memory(step, repeats)
    return _rss_peak_memory(step, repeats)


def _cuda_peak_memory(step: "Step", repeats: int) -> float:
    """Peak bytes the caching allocator hands out during one step above what is allocated before it, median of
    ``repeats`` steps (``torch.cuda.max_memory_allocated``: live tensors, deterministic)."""
    import statistics

    peaks = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peaks.append(float(torch.cuda.max_memory_allocated() - before))
    return statistics.median(peaks)


def _rss_peak_memory(step: "Step", repeats: int) -> Optional[float]:
    """Peak resident memory (bytes) one step adds above what the process holds before it (Linux), median of
    ``repeats`` steps.

    Free heap pages are returned to the OS first (``malloc_trim``) and the kernel's high-water mark is
    reset (``/proc/self/clear_refs``), so the figure is the step's own peak: activations saved for
    backward, gradients, temporaries. One step's figure moves with what the allocator keeps,
    hence the median. ``None`` where the kernel does not offer this.
    """
    import ctypes
    import gc
    import statistics

    peaks = []
    try:
        for _ in range(repeats):
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss0 = _proc_status_kib("VmRSS")
            step()
            peaks.append(float(_proc_status_kib("VmHWM") - rss0) * 1024.0)
    except (OSError, AttributeError):
        return None
    return statistics.median(peaks)


INTERRUPTED = "not run (interrupted)"


def _grad_check(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> float:
    """Largest relative gradient difference ``max_p ||g_p - r_p|| / ||r_p||``."""
    worst = 0.0
    for n, r in ref.items():
        g = got.get(n, torch.zeros_like(r))
        worst = max(worst, float((g - r).norm() / r.norm().clamp_min(1e-30)))
    return worst


class Checkpointed(nn.Module):
    """``block`` under ``torch.utils.checkpoint`` (non-reentrant): its activations recomputed in the backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


_BLOCKS = ("BasicBlock", "Bottleneck", "EncoderBlock")  # torchvision's residual and transformer blocks


def checkpoint_blocks(model: nn.Module) -> int:
    """Put each residual or transformer block of ``model`` under activation checkpointing; returns how many."""
    n = 0
    for mod in list(model.modules()):
        for key, child in list(mod._modules.items()):
            if type(child).__name__ in _BLOCKS:
                mod._modules[key] = Checkpointed(child)
                n += 1
    if n == 0:
        raise ValueError(f"--checkpoint-blocks: {type(model).__name__} has none of the blocks it wraps "
                         f"({', '.join(_BLOCKS)}); use resnet18, resnet18_64px, resnet18_gn, vit or vit_257.")
    return n


def run_model(name: str, batch: int, repeats: int, warmup: int, methods: List[str], inplace: bool = True,
              profile: bool = False, log=print, device: str = "cpu",
              autocast: Optional[torch.dtype] = None, checkpointing: bool = False) -> List[dict]:
    torch.manual_seed(0)
    model, shape = build(name)
    blocks = checkpoint_blocks(model) if checkpointing else 0
    model = model.to(device)
    if not inplace:  # same math; in-place activations become out-of-place for every method
        for mod in model.modules():
            if hasattr(mod, "inplace"):
                mod.inplace = False
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    u = torch.randn_like(x)
    rows: List[dict] = []
    steps: Dict[str, Step] = {}
    for method in methods:
        row = {"model": name, "method": method, "batch": batch, "input": list(shape), "checkpointed_blocks": blocks}
        try:
            step = Step(method, model, x, y, u, autocast)
            # fails fast, before any timing; at least 2 steps: engine="auto" captures on the second
            for _ in range(max(2, warmup)):
                step()
            steps[method] = step
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001  (recorded: the point is which alternatives fail)
            row.update(status="fails", error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
        rows.append(row)
    # Round-robin repeats (one timed step per method per round), so a change in the load of a shared
    # machine hits every method alike instead of biasing the ratios.
    wall: Dict[str, List[float]] = {m: [] for m in steps}
    cpu: Dict[str, List[float]] = {m: [] for m in steps}
    for _ in range(repeats):
        for method, step in steps.items():
            c0 = time.process_time()
            wall[method].append(measure(step, repeats=1, warmup=0, device=device)["median"])
            cpu[method].append(time.process_time() - c0)
    for row in rows:
        m = row["method"]
        if row["status"] == "ok":
            w = wall[m]
            row.update(median_s=statistics.median(w), mean_s=statistics.fmean(w), min_s=min(w),
                       std_s=statistics.pstdev(w) if len(w) > 1 else 0.0, repeats=len(w),
                       cpu_median_s=statistics.median(cpu[m]))
        log(f"  {name:<9} {m:<16} " + (f"{row['median_s'] * 1e3:9.1f} ms" if row["status"] == "ok"
                                         else f"fails ({row['error'][:90]})"))
    for row in rows:  # memory after timing: each step's own peak
        if row["status"] == "ok":
            row["peak_bytes"] = peak_memory(steps[row["method"]])
            row["saved_bytes"] = saved_for_backward(steps[row["method"]])
            if device == "cpu":  # (on a GPU the allocator's peak above is the live peak)
                row["live_bytes"] = memory.peak_live_bytes(steps[row["method"]])
    if profile:
        for row in rows:
            if row["status"] == "ok":
                row["profile"] = profile_breakdown(steps[row["method"]])
    if "clone" in steps:
        try:
            ref = steps["clone"].gradient()
            for row in rows:
                if row["method"] in JVP_METHODS and row["status"] == "ok":
                    err = _grad_check(ref, steps[row["method"]].gradient())
                    row["grad_check_rel_err"] = err
                    row["grad_check"] = "ok" if err < 1e-3 else "WRONG gradients"
        except KeyboardInterrupt:  # a time limit's SIGINT (gpu_benchmarks.sh) while the float64 copies compile:
            for row in rows:       # the timings stand, the table is written (main), the checks left say so
                if row["method"] in JVP_METHODS and row["status"] == "ok" and "grad_check" not in row:
                    row["grad_check"] = INTERRUPTED
    plain = next((r for r in rows if r["method"] == "plain" and r["status"] == "ok"), None)
    plain_2b = next((r for r in rows if r["method"] == "plain_2b" and r["status"] == "ok"), None)
    clone = next((r for r in rows if r["method"] == "clone" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok":
            continue
        if plain:
            row["vs_plain"] = row["median_s"] / plain["median_s"]
            row["cpu_vs_plain"] = row["cpu_median_s"] / plain["cpu_median_s"]
            if row.get("peak_bytes") and plain.get("peak_bytes"):
                row["memory_vs_plain"] = row["peak_bytes"] / plain["peak_bytes"]
            if row.get("saved_bytes") and plain.get("saved_bytes"):
                row["saved_vs_plain"] = row["saved_bytes"] / plain["saved_bytes"]
            if row.get("live_bytes") and plain.get("live_bytes"):
                row["live_vs_plain"] = row["live_bytes"] / plain["live_bytes"]
        if plain_2b:
            row["vs_plain_2b"] = row["median_s"] / plain_2b["median_s"]
        if clone:
            row["vs_clone"] = row["median_s"] / clone["median_s"]
            row["cpu_vs_clone"] = row["cpu_median_s"] / clone["cpu_median_s"]
    return rows


_ELEMENTWISE = {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::sum",
                "aten::div", "aten::div_", "aten::neg", "aten::mean", "aten::pow", "aten::rsqrt", "aten::where",
                "aten::threshold_backward", "aten::clamp_min", "aten::relu"}
_MEMORY = {"aten::fill_", "aten::zero_", "aten::copy_", "aten::cat", "aten::stack", "aten::empty", "aten::zeros",
           "aten::empty_strided", "aten::clone", "aten::index_put_"}


def _category(op: str) -> str:
    if "convolution_backward" in op:
        return "conv backward"
    if "convolution" in op or op in ("aten::mm", "aten::addmm", "aten::bmm"):
        return "conv/matmul"
    if "batch_norm" in op:
        return "batch_norm kernels"
    if op in _ELEMENTWISE:
        return "elementwise + reductions"
    if op in _MEMORY:
        return "fill/copy/cat/alloc"
    return "other aten"


def profile_breakdown(step: "Step", n: int = 3) -> Dict[str, Dict[str, float]]:
    """Self CPU time per step (ms) and op calls per step by category, from ``torch.profiler``."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(n):
            step()
    out: Dict[str, Dict[str, float]] = {}
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        c = out.setdefault(_category(e.key), {"ms": 0.0, "calls": 0.0})
        c["ms"] += e.self_cpu_time_total / 1e3 / n
        c["calls"] += e.count / n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def targets(rows: List[dict]) -> List[dict]:
    """Per model: clone step <= 2.0x plain (time) and <= 2.1x plain (peak memory); double backprop >= 1.5x clone."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {r["method"]: r for r in rows if r["model"] == model and r["status"] == "ok"}
        clone = mine.get("clone")
        if clone is None or "vs_plain" not in clone:
            continue
        out.append({"model": model, "target": "clone step <= 2.0x plain step", "value": clone["vs_plain"],
                    "met": clone["vs_plain"] <= 2.0})
        if clone.get("memory_vs_plain"):
            out.append({"model": model, "target": "clone peak memory <= 2.1x plain", "value": clone["memory_vs_plain"],
                        "met": clone["memory_vs_plain"] <= 2.1})
        if clone.get("saved_vs_plain"):
            out.append({"model": model, "target": "clone saved-for-backward bytes <= 2.1x plain",
                        "value": clone["saved_vs_plain"], "met": clone["saved_vs_plain"] <= 2.1})
        if clone.get("live_vs_plain"):
            out.append({"model": model, "target": "clone live-tensor peak <= 2.1x plain", "value": clone["live_vs_plain"],
                        "met": clone["live_vs_plain"] <= 2.1})
        if "double_backprop" in mine:
            v = mine["double_backprop"]["vs_clone"]
            t = {"model": model, "target": "double backprop >= 1.5x clone step", "value": v, "met": v >= 1.5}
            if "vs_plain_2b" in mine["double_backprop"]:  # the most a method that runs the 2B-row step can reach
                t["bound"] = mine["double_backprop"]["vs_plain_2b"]
            out.append(t)
        if "clone_compiled" in mine and "double_backprop" in mine:  # jvpreg's fastest engine; torch.compile has no
            v = mine["double_backprop"]["median_s"] / mine["clone_compiled"]["median_s"]  # double backward to compete
            out.append({"model": model, "target": "double backprop >= 1.5x compiled clone step", "value": v,
                        "met": v >= 1.5})
        if "clone_compiled" in mine and "plain_compiled" in mine:
            v = mine["clone_compiled"]["median_s"] / mine["plain_compiled"]["median_s"]
            out.append({"model": model, "target": "compiled clone step / compiled plain step (lower than clone/plain)",
                        "value": v, "met": v < clone["vs_plain"]})
    return out


def markdown(result: dict) -> str:
    device = result.get("device", "cpu")
    lines = [f"# Training-step benchmark ({'CPU' if device == 'cpu' else device})", "",
             "One full step (zero_grad, forward, backward, SGD step), median over round-robin repeats. `clone` is "
             "task loss + lambda * JacobianFrobenius (1 projection, whole batch) through the callbacks' "
             "shared forward; the others are the autodiff alternatives (see `jvpreg/bench/train.py`). "
             "Models in train mode (ResNet-18: train-mode BatchNorm)."
             + (f" Forward and penalty under `torch.autocast` ({result['autocast']}), backward outside it; the "
                "gradient check runs in float64 without autocast." if result.get("autocast") else "")
             + ("" if result["inplace_activations"] else " In-place activations made out-of-place for every "
                "method (`--no-inplace`).")
             + (" Every residual and transformer block under `torch.utils.checkpoint` (non-reentrant; "
                "`--checkpoint-blocks`): the clone methods recompute them as clone forwards; the captured and compiled "
                "engines replay each block as a checkpointed sub-program." if result.get("checkpoint_blocks") else ""),
             "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['cpu_cores']} cores, "
             f"torch {result['machine']['torch']} ({result['machine']['torch_threads']} threads); load average "
             f"at start {result['load_average_start']}, at end {result['load_average_end']} (shared machine)."
             + (" Steady heap (`--steady-malloc`): buffers reused, no page faults per fresh allocation."
                if result.get("steady_malloc") else ""), "",
             "Wall-clock medians are what the targets use; process CPU time (all threads) is shown too, as it "
             "is less sensitive to other jobs on a shared machine. Peak memory is the RSS high-water mark a step "
             "adds (median of 5 steps; it moves 10-30% between runs); saved is what autograd keeps for backward "
             "(distinct storages, parameters left out; deterministic); live peak is the most bytes of live tensors "
             "during a step above those live before it, from the allocator's events (`torch.profiler` memory "
             "timeline): what the step needs, without what glibc keeps or returns to the OS."
             + ("" if device == "cpu" else f" On {device}, peak memory is the caching allocator's peak "
                "(`torch.cuda.max_memory_allocated`) above what is allocated before the step, which is also its live "
                "peak (that column stays empty)."), "",
             "`plain_2b` is the plain step on the doubled batch: the floor of a clone step (the physical limit).", "",
             "| model | method | median step (ms) | vs plain | vs plain 2B | vs clone | CPU time (ms) | CPU vs plain | "
             "CPU vs clone | peak memory (MiB) | memory vs plain | saved (MiB) | saved vs plain | live peak (MiB) | "
             "live vs plain | status |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    def ratio(r: dict, key: str) -> str:  # a ratio cell; empty where its reference did not run
        return f"{r[key]:.2f}x" if key in r else ""

    def mib(r: dict, key: str) -> str:
        return f"{r[key] / 2**20:.1f}" if r.get(key) else ""

    for r in result["results"]:
        if r["status"] == "ok":
            status = "ok" + (f"; grad check: {r['grad_check']} (rel. err {r['grad_check_rel_err']:.1e})"
                             if "grad_check_rel_err" in r else f"; grad check: {r['grad_check']}"
                             if "grad_check" in r else "")
            lines.append(f"| {r['model']} (B={r['batch']}) | {r['method']} | {r['median_s'] * 1e3:.1f} | "
                         f"{ratio(r, 'vs_plain')} | {ratio(r, 'vs_plain_2b')} | {ratio(r, 'vs_clone')} | "
                         f"{r['cpu_median_s'] * 1e3:.1f} | {ratio(r, 'cpu_vs_plain')} | {ratio(r, 'cpu_vs_clone')} | "
                         f"{mib(r, 'peak_bytes')} | {ratio(r, 'memory_vs_plain')} | {mib(r, 'saved_bytes')} | "
                         f"{ratio(r, 'saved_vs_plain')} | {mib(r, 'live_bytes')} | {ratio(r, 'live_vs_plain')} | {status} |")
        else:
            lines.append(f"| {r['model']} (B={r['batch']}) | {r['method']} | fails |" + " |" * 12
                         + f" `{r['error']}` |")
    lines += ["", "Targets:", ""]
    for t in result["targets"]:
        bound = (f" (double backprop / plain 2B step = {t['bound']:.2f}x: the most any method that runs the 2B-row "
                 "forward and backward can reach)" if "bound" in t else "")
        lines.append(f"- {t['model']}: {t['target']}: {t['value']:.2f}x — {'met' if t['met'] else 'MISSED'}{bound}")
    profiled = [r for r in result["results"] if "profile" in r]
    if profiled:
        lines += ["", "Where the time goes (`--profile`: torch.profiler self CPU time per step, aten ops by "
                  "category; the profiler adds overhead, compare within a column):", "",
                  "| model | method | " + " | ".join(_PROFILE_COLUMNS) + " | total |",
                  "|---|---|" + "---:|" * (len(_PROFILE_COLUMNS) + 1)]
        for r in profiled:
            cells = [r["profile"].get(c, {"ms": 0.0, "calls": 0.0}) for c in _PROFILE_COLUMNS]
            total = sum(v["ms"] for v in r["profile"].values())
            lines.append(f"| {r['model']} | {r['method']} | "
                         + " | ".join(f"{c['ms']:.0f} ms ({c['calls']:.0f} ops)" for c in cells) + f" | {total:.0f} ms |")
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


_PROFILE_COLUMNS = ("conv backward", "conv/matmul", "batch_norm kernels", "elementwise + reductions",
                    "fill/copy/cat/alloc", "other aten")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvpreg.bench train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet18,mlp200:64,vit",
                        help="comma-separated name[:batch] of resnet18, resnet18_64px (64x64 images), resnet18_gn (GroupNorm), mlp, mlp200, vit, vit_257 (257 tokens)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda[:N] (CUDA-synchronised timing; peak memory from the caching allocator's "
                             "statistics; not run here: no GPU)")
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none",
                        help="run every method's forward (and the penalty) under torch.autocast at this dtype; "
                             "the gradient check stays in float64 without autocast")
    parser.add_argument("--no-inplace", action="store_true",
                        help="make in-place activations (ResNet's ReLU(inplace=True)) out-of-place for every method")
    parser.add_argument("--checkpoint-blocks", action="store_true",
                        help="put every residual and transformer block under torch.utils.checkpoint (activation "
                             "checkpointing) for every method")
    parser.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown per method")
    parser.add_argument("--steady-malloc", action="store_true",
                        help="never-trimmed glibc heap, as jemalloc/tcmalloc or a caching allocator keep one: no "
                             "page faults on every fresh buffer (they cost methods with more temporaries more)")
    parser.add_argument("--note", action="append", default=[], help="a note for the Markdown report (repeatable)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output path without extension ('' to skip writing)")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        parser.error(f"unknown method(s) {bad}; expected a subset of {list(METHODS)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here (torch {torch.__version__})")
    if args.threads:
        torch.set_num_threads(args.threads)
    steady = bool(args.steady_malloc and report.steady_malloc())
    command = report.command_line("python -m jvpreg.bench train", sys.argv[1:] if argv is None else argv)
    load0 = [round(v, 2) for v in os.getloadavg()]
    print(f"bench train: {args.models} batch {args.batch}, {args.repeats} repeats, {torch.get_num_threads()} threads"
          + (f", {args.autocast} autocast" if args.autocast != "none" else ""))
    rows: List[dict] = []
    interrupted = False
    for spec in args.models.split(","):  # name or name:batch
        name, _, b = spec.partition(":")
        rows += run_model(name, int(b) if b else args.batch, args.repeats, args.warmup, methods,
                          inplace=not args.no_inplace, profile=args.profile, device=args.device,
                          autocast=AUTOCAST[args.autocast], checkpointing=args.checkpoint_blocks)
        interrupted = any(r.get("grad_check") == INTERRUPTED for r in rows)
        if interrupted:  # write what was measured, then stop as interrupted
            print("bench train: interrupted during the gradient checks; writing the timings measured so far")
            break
    result = {"command": command.strip(), "machine": machine_description(args.device), "device": args.device,
              "autocast": None if args.autocast == "none" else args.autocast,
              "load_average_start": load0,
              "inplace_activations": not args.no_inplace, "checkpoint_blocks": args.checkpoint_blocks,
              "threads": torch.get_num_threads(), "steady_malloc": steady,
              "load_average_end": [round(v, 2) for v in os.getloadavg()], "lambda": LAM,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": list(args.note), "results": rows}
    result["targets"] = targets(rows)
    md = markdown(result)
    print()
    print(md)
    if args.out:
        paths = report.write_results(args.out, md, result)
        print("wrote " + " and ".join(map(str, paths)))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
