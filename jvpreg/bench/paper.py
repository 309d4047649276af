"""The paper's timing tables ("timesX"/"timesW") over its 13 architectures, in PyTorch.

``python -m jvpreg.bench paper [options]`` (or ``python scripts/bench_paper.py``) times one JVP per
(shape, architecture, JVP kind, method) cell and writes ``<name>.json``, ``<name>.md`` (tables laid
out like the paper's) and ``<name>_speedup.png`` under ``--out``.

JVP kinds:

* ``x``: ``Rop(f, x, u) = J_f(x) u`` (table "timesX").
* ``w``: ``Rop(f(x), W¹, U)``, the JVP w.r.t. the *first* layer's weight in a random direction
  ``U`` (table "timesW"). The first layer is the first ``weight*`` parameter, in
  ``named_parameters()`` order, owned by a Conv/ConvTranspose/Linear/RNN module.

Methods (columns):

* ``batch_jacobian``: ``vmap(jacrev(f_i))`` per sample (the paper's eq. JVPtimes: one VJP per output
  row), then ``J u`` contracted afterwards.
* ``func_jvp``: ``torch.func.jvp`` (forward mode, functorch).
* ``forward_ad``: ``torch.autograd.forward_ad`` dual tensors (forward mode, eager autograd).
* ``double_vjp``: ``torch.autograd.functional.jvp`` (the double-VJP trick, eq. doubleVJP).
* ``clone``: ``jvpreg.jvp`` / ``jvpreg.jvp_params`` (clone mode, one forward of ``[x; x + s u]``).
* ``fwd_2b``: the plain forward of the same ``2B``-row batch: not a JVP, the physical limit
  (docs/design.md §3), so ``clone / fwd 2B`` is the engine's overhead.

Implementation choices (written down here; the math is in docs/design.md):

* Every method is run under the same conditions: parameters frozen (``requires_grad=False``) so
  that no method pays for a parameter-gradient graph it does not need, grad mode left on (the
  VJP-based methods build their own graphs), float32, models in eval mode unless ``--mode train``.
  ``--mode train`` puts BatchNorm in training mode but keeps dropout/stochastic depth off, so
  that all methods compute the same function (batch statistics, no random masks).
* Models are built once per shape (seeded) and reused across kinds and methods. Inputs ``x``,
  ``u`` and ``U`` are standard normal.
* Each cell is run once first: that call warms up and checks correctness (max relative difference
  ``max|J_m - J_clone| / max|J_clone|`` to the clone JVP, in the JSON). Then ``--warmup`` more
  warm-up calls and ``--repeats`` timed calls (``jvpreg.bench.timing.measure``: CUDA-synchronised,
  median/mean/std/min). ``--cell-budget`` caps a cell's wall time by lowering its repeats (never
  below 2); the repeats actually used are recorded per cell.
* Speed-up = time of the fastest alternative (JVP methods other than clone that succeeded and
  agree with clone within ``--rtol``) / time of clone, on ``--stat`` (median by default: robust to
  interference on a shared machine; the JSON also keeps the mean-based averages). Averages over
  architectures skip infinite (every alternative failed) and missing factors, as the paper's do.
* Failures never stop the run: each cell catches its exception, records ``oom`` (rendered
  ``-``, as in the paper) or ``fails`` with a short reason, frees memory and goes on. A
  batch Jacobian whose estimated size exceeds ``--memory-limit-gb`` is not attempted (``-*``).
* The paper's appendix does not state the batch size of its tables. Its VGG16 400×400 clone times
  bound it: one 400×400 VGG16 row is ~98 GFLOP, 3 rows (``[x; u; 0]``) in 0.046 s on a Quadro RTX
  8000 (16.3 TFLOP/s fp32 peak) is 6.4 TFLOP/s per sample, so B ≤ 2 and most likely B = 1 (the
  Titan X gives the same bound). The paper shapes therefore default to batch 1.
* ``unet`` needs H, W divisible by ``2**depth``: at 100×100 it is built with the deepest depth
  that fits (2); ``inception_v3`` needs ≥ 75×75 and is run at 75×75 when the shape is smaller. Both
  are recorded per row (``image_size``, ``model_kwargs``).
* On a shared CPU, ``--threads 1 --clock cpu`` times the process CPU clock of one torch thread, which
  other tenants' load does not inflate (both clocks are recorded per cell), and ``--steady-malloc``
  (default on CPU) keeps glibc from handing out fresh pages per call (see
  :func:`jvpreg.bench.report.steady_malloc`): otherwise the first method run in a process and the
  next pay different page-fault costs for the same buffers.
* Where ``clone / fwd 2B`` exceeds ``--profile-ratio`` or the speed-up is under
  ``--profile-speedup``, ``torch.profiler`` compares the clone call with the plain 2B forward
  (top ops by self time) and the MD lists the ops where clone spends the most extra time.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import math
import re
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn

import jvpreg

from . import report
from .timing import machine_description, sync

# --------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class Shape:
    """One input/output setting of the tables: ``x ∈ R^{3×S×S}``, ``y ∈ R^K``, batch ``B``."""

    name: str
    image_size: int
    num_classes: int
    batch_size: int
    in_channels: int = 3

    def label(self) -> str:
        return (f"x ∈ R^{{{self.in_channels}×{self.image_size}×{self.image_size}}}, y ∈ R^{{{self.num_classes}}}, "
                f"batch {self.batch_size}")


SHAPES: Dict[str, Shape] = {
    "small": Shape("small", 64, 20, 4),
    "paper100": Shape("paper100", 100, 20, 1),
    "paper400": Shape("paper400", 400, 1000, 1),
}
SHAPE_GROUPS: Dict[str, tuple] = {"small": ("small",), "paper": ("paper100", "paper400"),
                                  "paper100": ("paper100",), "paper400": ("paper400",)}

KINDS: Dict[str, str] = {"x": "Rop(f, x, u): JVP w.r.t. the input x",
                         "w": "Rop(f(x), W¹, U): JVP w.r.t. the first layer's weight W¹"}

# --------------------------------------------------------------------------------------------
# Problems and methods


@dataclass
class Problem:
    """Everything a method needs to build its JVP closure for one cell."""

    model: nn.Module
    kind: str  # "x" or "w"
    x: torch.Tensor
    u: torch.Tensor
    param_name: str
    U: torch.Tensor
    device: torch.device

    @property
    def W(self) -> torch.Tensor:
        return dict(self.model.named_parameters())[self.param_name]

    def f_of_w(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``w -> model(x)`` with the first-layer weight replaced by ``w``."""
        model, name, x = self.model, self.param_name, self.x
        return lambda w: torch.func.functional_call(model, {name: w}, (x,))


@dataclass(frozen=True)
class Method:
    """A column of the table.

    Attributes:
        name: CLI name (``--methods``).
        label: column header.
        build: ``build(problem) -> fn``; ``fn()`` returns the JVP ``(B, K)`` (or the forward
            output for baselines). Building may raise; so may calling.
        alternative: competes for "fastest alternative" (every JVP method except clone).
        is_jvp: returns a JVP, checked against clone's.
        memory: optional ``memory(problem) -> bytes`` estimate; cells above the limit are skipped.
    """

    name: str
    label: str
    build: Callable[[Problem], Callable[[], torch.Tensor]]
    alternative: bool = True
    is_jvp: bool = True
    memory: Optional[Callable[[Problem], int]] = None


def _build_clone(p: Problem):
    # engine="captured": the default engine's steady state from the first (checking) call on, also where the
    # cell budget leaves no warm-up call ("auto" would capture on the first timed one)
    if p.kind == "x":
        return lambda: jvpreg.jvp(p.model, (p.x,), (p.u,), engine="captured")[1]
    return lambda: jvpreg.jvp_params(p.model, (p.x,), {p.param_name: p.U}, engine="captured")[1]


def _build_fwd_2b(p: Problem):
    x2 = torch.cat([p.x, p.x + p.u])
    return lambda: p.model(x2)


def _build_func_jvp(p: Problem):
    if p.kind == "x":
        return lambda: torch.func.jvp(p.model, (p.x,), (p.u,))[1]
    f, W, U = p.f_of_w(), p.W, p.U
    return lambda: torch.func.jvp(f, (W,), (U,))[1]


def _build_forward_ad(p: Problem):
    import torch.autograd.forward_ad as fwAD

    model, x, u, name, W, U = p.model, p.x, p.u, p.param_name, p.W, p.U

    def run():
        with fwAD.dual_level():
            if p.kind == "x":
                out = model(fwAD.make_dual(x, u))
            else:
                out = torch.func.functional_call(model, {name: fwAD.make_dual(W, U)}, (x,))
            tangent = fwAD.unpack_dual(out).tangent
            if tangent is None:  # output independent of the input: zero JVP
                return torch.zeros_like(fwAD.unpack_dual(out).primal)
            return tangent

    return run


def _build_double_vjp(p: Problem):
    if p.kind == "x":
        return lambda: torch.autograd.functional.jvp(p.model, p.x, p.u)[1]
    f, W, U = p.f_of_w(), p.W, p.U
    return lambda: torch.autograd.functional.jvp(f, W, U)[1]


def _build_batch_jacobian(p: Problem):
    from torch.func import functional_call, jacrev, vmap

    model, x, name = p.model, p.x, p.param_name
    if p.kind == "x":
        def f1(xi):
            return model(xi.unsqueeze(0)).squeeze(0)

        u_flat = p.u.flatten(1).unsqueeze(-1)  # (B, D, 1)
        return lambda: (vmap(jacrev(f1))(x).flatten(2) @ u_flat).squeeze(-1)

    def f1w(w, xi):
        return functional_call(model, {name: w}, (xi.unsqueeze(0),)).squeeze(0)

    W, U_flat = p.W, p.U.flatten()
    return lambda: vmap(jacrev(f1w), in_dims=(None, 0))(W, x).flatten(2) @ U_flat


def _jacobian_bytes(p: Problem) -> int:
    """Memory estimate of ``batch_jacobian``: the per-sample Jacobians ``(B, K, D)`` it materialises plus
    its reverse pass, which carries ``K`` cotangents at once (``vmap`` over ``jacrev``'s rows): about
    ``3 K`` times the largest activation of one sample (gradient in, gradient out, saved input).

    On CPU an allocation that large is not an exception but the kernel's OOM killer, which would end
    the whole run; cells above the limit are therefore not attempted (``-*``).
    """
    largest = [0]

    def hook(module, inputs, output):
        if isinstance(output, torch.Tensor):
            largest[0] = max(largest[0], output.numel() * output.element_size())

    leaves = [m for m in p.model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            k = p.model(p.x[:1]).numel()
    finally:
        for h in handles:
            h.remove()
    d = p.x[0].numel() if p.kind == "x" else p.U.numel()
    n = p.x.shape[0]
    return n * k * d * p.x.element_size() + 3 * k * largest[0]


METHODS: Dict[str, Method] = {
    m.name: m
    for m in (
        Method("batch_jacobian", "batch-jacobian", _build_batch_jacobian, memory=_jacobian_bytes),
        Method("func_jvp", "jvp (torch.func)", _build_func_jvp),
        Method("forward_ad", "forward_ad", _build_forward_ad),
        Method("double_vjp", "double vjp", _build_double_vjp),
        Method("clone", "clone (ours)", _build_clone, alternative=False),
        Method("fwd_2b", "fwd 2B", _build_fwd_2b, alternative=False, is_jvp=False),
    )
}
METHOD_ALIASES = {"jvp": "func_jvp", "torch_func": "func_jvp", "fwd2b": "fwd_2b", "jvpreg": "clone",
                  "batch_jac": "batch_jacobian", "double_backward": "double_vjp"}

# --------------------------------------------------------------------------------------------
# Models


def first_layer_weight(model: nn.Module) -> str:
    """Name of the first Conv/ConvTranspose/Linear/RNN ``weight*`` parameter (``named_parameters()`` order)."""
    layer_types = (nn.modules.conv._ConvNd, nn.Linear, nn.RNNBase, nn.Bilinear)
    for name, _ in model.named_parameters():
        owner_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        if isinstance(owner, layer_types) and leaf.startswith("weight"):
            return name
    raise ValueError(f"first_layer_weight: {type(model).__name__} has no Conv/Linear/RNN weight parameter.")


def model_setting(name: str, image_size: int) -> tuple:
    """``(image_size, model_kwargs)`` that ``name`` can run at, as close to ``image_size`` as possible."""
    from jvpreg.models.registry import MIN_IMAGE_SIZE

    size = max(image_size, MIN_IMAGE_SIZE.get(name, 1))
    kwargs: Dict[str, Any] = {}
    if name == "unet":
        depth = next((d for d in (4, 3, 2, 1) if size % 2 ** d == 0), None)
        if depth is None:
            raise ValueError(f"unet needs an even image size, got {size}")
        if depth != 4:
            kwargs["depth"] = depth
    return size, kwargs


def _set_mode(model: nn.Module, mode: str) -> nn.Module:
    model.train(mode == "train")
    if mode == "train":  # batch-statistics BN, but no random masks: every method computes one function
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
                m.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------
# One cell


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    msg = str(err).lower()
    return "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg


_REASONS = [
    (r"Batching rule not implemented for ([\w:]+(?:\.\w+)*)", r"no vmap batching rule for \1"),
    (r"doesn't match the broadcast shape", "vmap: shape mismatch in an in-place op"),
    (r"attempted to call in-place operation|mutate a captured Tensor|in-place operation.*captured",
     "in-place op on a captured tensor (e.g. BN running stats)"),
    (r"Trying to use forward AD with (\w+)", r"no forward-AD formula for \1"),
    (r"does not support forward-mode|forward-mode AD is not implemented|not implemented for forward",
     "no forward-mode formula"),
    (r"derivative for (\S+) is not implemented", r"derivative of \1 not implemented"),
    (r"vmap: .*?(\w+) is not supported", r"vmap: \1 not supported"),
]


def short_reason(err: BaseException, limit: int = 60) -> str:
    """A table-sized reason for a failure (known torch messages mapped to a few words)."""
    msg = str(err).strip()
    for pattern, repl in _REASONS:
        m = re.search(pattern, msg)
        if m:
            return m.expand(repl)[:limit]
    first = msg.splitlines()[0] if msg else ""
    text = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|a - ref| / max|ref|`` in float64 (``inf`` when shapes differ)."""
    if not isinstance(a, torch.Tensor) or a.shape != ref.shape:
        return float("inf")
    a64, r64 = a.detach().double(), ref.detach().double()
    den = r64.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((a64 - r64).abs().max() / den)


@dataclass
class Settings:
    """Knobs of a run (see ``--help`` for each)."""

    repeats: int = 10
    warmup: int = 2
    device: str = "cpu"
    mode: str = "eval"
    cell_budget: Optional[float] = None
    memory_limit_gb: Optional[float] = None
    rtol: float = 1e-3
    stat: str = "median"
    clock: str = "wall"
    profile: str = "auto"
    profile_ratio: float = 1.2
    profile_speedup: float = 2.5
    profile_iters: int = 3
    seed: int = 0


def _budgeted(first: float, s: Settings) -> tuple:
    """``(warmup, repeats)`` that keep one cell under ``s.cell_budget`` seconds (see module doc)."""
    warmup, repeats = s.warmup, s.repeats
    if s.cell_budget is None or first <= 0 or first * (warmup + repeats) <= s.cell_budget:
        return warmup, repeats
    warmup = 0 if first * 3 > s.cell_budget else min(warmup, 1)  # the check call already warmed up
    fit = int((s.cell_budget - first * warmup) / first + 1e-9)
    return warmup, max(min(2, repeats), min(repeats, fit))


def _free(device: torch.device, collect: bool = True) -> None:
    """Release memory: ``gc.collect`` (slow with torch loaded) only when asked, e.g. after a
    failure, whose traceback keeps the cell's tensors alive in a reference cycle."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _memory_limit(s: Settings, device: torch.device) -> Optional[float]:
    if s.memory_limit_gb is not None:
        return s.memory_limit_gb * 2 ** 30
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 0.5 * int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_cell(method: Method, problem: Problem, ref: Optional[torch.Tensor], s: Settings) -> tuple:
    """Time one (method, problem) cell; never raises. Returns ``(cell_dict, output_of_first_call)``."""
    device = problem.device
    cell: Dict[str, Any] = {"status": "ok"}
    out = fn = None
    failed = False
    try:
        if method.memory is not None:
            need, limit = method.memory(problem), _memory_limit(s, device)
            if limit is not None and need > limit:
                return ({"status": "oom", "estimated": True,
                         "reason": f"skipped: needs ~{need / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"}, None)
        fn = method.build(problem)
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        sync(device)
        first_wall = time.perf_counter() - t0
        first = (time.process_time() - c0) if s.clock == "cpu" else first_wall
        if method.is_jvp and ref is not None:
            cell["max_rel_diff"] = rel_diff(out, ref)
        warmup, repeats = _budgeted(first_wall, s)  # the budget is wall time
        cell.update(report.measure_clocks(fn, repeats=repeats, warmup=warmup, device=device, clock=s.clock))
        cell.update(first_call=first, warmup=warmup)
    except Exception as err:  # noqa: BLE001 - every failure is a table entry, never a crash
        out, failed = None, True
        cell = {"status": "oom" if _is_oom(err) else "fails", "reason": short_reason(err),
                "error": f"{type(err).__name__}: {str(err)[:600]}"}
        if cell["status"] == "oom":
            cell["reason"] = "out of memory"
    finally:
        fn = None
        _free(device, collect=failed)
    return cell, (out.detach() if isinstance(out, torch.Tensor) else None)


# --------------------------------------------------------------------------------------------
# Row summaries


def summarize_row(cells: Mapping[str, Mapping[str, Any]], stat: str, rtol: float) -> Dict[str, Any]:
    """Speed-up of clone over the fastest agreeing alternative and clone / fwd 2B for one row."""
    clone = cells.get("clone", {})
    out: Dict[str, Any] = {"speedup": None, "fastest": None, "clone_over_fwd2b": None, "excluded": []}
    alts = {}
    for name, c in cells.items():
        m = METHODS.get(name)
        if m is None or not m.alternative or c.get("status") != "ok":
            continue
        if c.get("max_rel_diff") is not None and not c["max_rel_diff"] <= rtol:
            out["excluded"].append(name)
            continue
        alts[name] = c[stat]
    n_checked = sum(1 for n, c in cells.items() if METHODS.get(n) and METHODS[n].alternative
                    and c.get("status") == "ok" and c.get("max_rel_diff") is not None)
    out["clone_suspect"] = bool(n_checked and len(out["excluded"]) * 2 > n_checked)
    if clone.get("status") == "ok" and not out["clone_suspect"]:
        if alts:
            out["fastest"] = min(alts, key=alts.get)
            out["speedup"] = alts[out["fastest"]] / clone[stat]
        elif any(c.get("status") in ("oom", "fails") for n, c in cells.items()
                 if METHODS.get(n) and METHODS[n].alternative):
            out["speedup"] = float("inf")  # every alternative failed, as the paper's ∞
        fwd = cells.get("fwd_2b", {})
        if fwd.get("status") == "ok":
            out["clone_over_fwd2b"] = clone[stat] / fwd[stat]
    return out


def speedup_bound(rows: Sequence[Mapping[str, Any]], stat: str, rtol: float) -> float:
    """Geometric mean over rows of (fastest agreeing alternative / fwd 2B): the speed-up clone would reach
    at zero overhead over the plain 2B forward (``nan`` when no row has both)."""
    vals = []
    for r in rows:
        cells = r["cells"]
        fwd = cells.get("fwd_2b", {})
        alts = [c[stat] for n, c in cells.items() if METHODS.get(n) and METHODS[n].alternative
                and c.get("status") == "ok" and (c.get("max_rel_diff") is None or c["max_rel_diff"] <= rtol)]
        if alts and fwd.get("status") == "ok":
            vals.append(min(alts) / fwd[stat])
    return report.geo_mean(vals)


def summarize(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Arithmetic/geometric averages per (shape, kind), from the run's statistic and from means."""
    groups: Dict[tuple, List] = defaultdict(list)
    for r in rows:
        groups[(r["shape"], r["kind"])].append(r)
    out: Dict[str, Any] = {}
    for (shape, kind), rs in groups.items():
        sp = [r["summary"]["speedup"] for r in rs]
        ratio = [r["summary"]["clone_over_fwd2b"] for r in rs]
        sp_mean = [r["summary_mean"]["speedup"] for r in rs]
        ratio_mean = [r["summary_mean"]["clone_over_fwd2b"] for r in rs]
        finite = [v for v in sp if v is not None and math.isfinite(v)]
        out.setdefault(shape, {})[kind] = {
            "speedup_arith": report.arith_mean(sp), "speedup_geo": report.geo_mean(sp),
            "speedup_n": len(finite), "speedup_inf": sum(1 for v in sp if v is not None and math.isinf(v)),
            "speedup_min": min(finite) if finite else None, "speedup_max": max(finite) if finite else None,
            "clone_over_fwd2b_arith": report.arith_mean(ratio), "clone_over_fwd2b_geo": report.geo_mean(ratio),
            "clone_over_fwd2b_max": max((v for v in ratio if v is not None), default=None),
            "from_means": {"speedup_arith": report.arith_mean(sp_mean), "speedup_geo": report.geo_mean(sp_mean),
                           "clone_over_fwd2b_geo": report.geo_mean(ratio_mean)},
            "models": len(rs),
        }
    return out


# --------------------------------------------------------------------------------------------
# Profiling (clone vs plain 2B forward)


def _top_ops(fn: Callable[[], Any], device: torch.device, iters: int, top: int = 10) -> tuple:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    per_op = {e.key: (getattr(e, attr) / iters / 1e3, e.count // iters) for e in events}  # ms/iter, calls/iter
    total = sum(v[0] for v in per_op.values())
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": k, "self_ms": round(v[0], 3), "calls": v[1]} for k, v in ranked], per_op, total


def profile_row(problem: Problem, s: Settings) -> Dict[str, Any]:
    """Top ops by self time for clone and for the plain 2B forward, and clone's largest excesses."""
    try:
        clone_top, clone_all, clone_total = _top_ops(_build_clone(problem), problem.device, s.profile_iters)
        fwd_top, fwd_all, fwd_total = _top_ops(_build_fwd_2b(problem), problem.device, s.profile_iters)
    except Exception as err:  # noqa: BLE001
        return {"error": short_reason(err)}
    finally:
        _free(problem.device)
    excess = sorted(((op, ms - fwd_all.get(op, (0.0, 0))[0], calls) for op, (ms, calls) in clone_all.items()),
                    key=lambda t: -t[1])[:6]
    return {"clone_top": clone_top, "fwd2b_top": fwd_top, "clone_self_ms": round(clone_total, 3),
            "fwd2b_self_ms": round(fwd_total, 3),
            "excess": [{"op": op, "extra_ms": round(ms, 3), "calls": c} for op, ms, c in excess if ms > 0]}


# --------------------------------------------------------------------------------------------
# The grid


def _parse_list(text: str, known: Mapping[str, Any], what: str, aliases: Mapping[str, str] | None = None) -> List[str]:
    if text.strip() == "all":
        return list(known)
    out = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        item = (aliases or {}).get(item, item)
        if item not in known:
            raise SystemExit(f"--{what}: unknown {what[:-1]} {item!r}; known: {', '.join(known)}")
        if item not in out:
            out.append(item)
    return out


def run_grid(shapes: Sequence[Shape], models: Sequence[str], methods: Sequence[str], kinds: Sequence[str],
             s: Settings, *, show_progress: bool = True) -> List[Dict[str, Any]]:
    """Time every (shape, model, kind, method) cell; returns one row dict per (shape, model, kind)."""
    from jvpreg.models import build_model

    device = torch.device(s.device)
    order = (["clone"] if "clone" in methods else []) + [m for m in methods if m != "clone"]
    rows: List[Dict[str, Any]] = []
    bar = report.progress(len(shapes) * len(models) * len(kinds) * len(order), "paper grid", show_progress)
    try:
        for shape in shapes:
            for name in models:
                size, kwargs = model_setting(name, shape.image_size)
                base = {"shape": shape.name, "model": name, "image_size": size, "model_kwargs": kwargs,
                        "batch_size": shape.batch_size, "num_classes": shape.num_classes}
                try:
                    torch.manual_seed(s.seed)
                    model = build_model(name, in_channels=shape.in_channels, num_classes=shape.num_classes,
                                        image_size=size, **kwargs)
                    model = _set_mode(model, s.mode).to(device)
                    param_name = first_layer_weight(model)
                    gen = torch.Generator().manual_seed(s.seed + 1)
                    x = torch.randn(shape.batch_size, shape.in_channels, size, size, generator=gen).to(device)
                    u = torch.randn(x.shape, generator=gen).to(device)
                    W = dict(model.named_parameters())[param_name]
                    U = torch.randn(W.shape, generator=gen).to(device=device, dtype=W.dtype)
                except Exception as err:  # noqa: BLE001 - a model that cannot be built is a failed row
                    for kind in kinds:
                        cells = {m: {"status": "oom" if _is_oom(err) else "fails", "reason": short_reason(err),
                                     "error": f"{type(err).__name__}: {str(err)[:600]}"} for m in order}
                        rows.append({**base, "kind": kind, "params": None, "first_layer": None, "cells": cells,
                                     "summary": summarize_row(cells, s.stat, s.rtol),
                                     "summary_mean": summarize_row(cells, "mean", s.rtol)})
                        bar.update(len(order))
                    _free(device)
                    continue
                n_params = sum(p.numel() for p in model.parameters())
                for kind in kinds:
                    problem = Problem(model, kind, x, u, param_name, U, device)
                    cells: Dict[str, Dict[str, Any]] = {}
                    ref = None
                    for mname in order:
                        bar.set_postfix_str(f"{shape.name}/{name}/{kind}/{mname}")
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            cell, out = run_cell(METHODS[mname], problem, ref, s)
                        if mname == "clone":
                            ref = out
                        del out
                        cells[mname] = cell
                        bar.update(1)
                    row = {**base, "kind": kind, "params": n_params, "first_layer": param_name, "cells": cells,
                           "summary": summarize_row(cells, s.stat, s.rtol),
                           "summary_mean": summarize_row(cells, "mean", s.rtol)}
                    ref = None
                    sm = row["summary"]
                    flagged = s.profile == "all" or (s.profile == "auto" and (
                        (sm["clone_over_fwd2b"] is not None and sm["clone_over_fwd2b"] > s.profile_ratio)
                        or (sm["speedup"] is not None and sm["speedup"] < s.profile_speedup)))
                    if flagged and cells.get("clone", {}).get("status") == "ok":
                        bar.set_postfix_str(f"{shape.name}/{name}/{kind}/profile")
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            row["profile"] = profile_row(problem, s)
                    rows.append(row)
                del model, x, u, W, U
                _free(device)
    finally:
        bar.close()
    return rows


# --------------------------------------------------------------------------------------------
# Rendering

_ALT_ORDER = ["batch_jacobian", "func_jvp", "forward_ad", "double_vjp"]


def _cell_text(c: Mapping[str, Any], stat: str, rtol: float) -> str:
    st = c.get("status")
    if st == "ok":
        mark = " ≠" if c.get("max_rel_diff") is not None and not c["max_rel_diff"] <= rtol else ""
        return report.fmt_seconds(c[stat]) + mark
    if st == "oom":
        return "-*" if c.get("estimated") else "-"
    return f"fails: {c.get('reason', '?')}"


def _columns(methods: Sequence[str]) -> List[str]:
    extra = [m for m in methods if m not in _ALT_ORDER + ["clone", "fwd_2b"]]
    return [m for m in _ALT_ORDER + extra + ["clone"] if m in methods]


def render_markdown(result: Mapping[str, Any], notes: str | None = None) -> str:
    """The Markdown report: one paper-style table per (shape, kind), details, failures, profiles, and the
    findings (``notes``, default: the run's stored ``notes``)."""
    notes = notes if notes is not None else result.get("notes")
    cfg, rows, machine = result["config"], result["rows"], result["machine"]
    stat, rtol = cfg["stat"], cfg["rtol"]
    methods = cfg["methods"]
    cols = _columns(methods)
    has_fwd = "fwd_2b" in methods
    lines = [f"# JVP timings over {len(cfg['models'])} architectures ({machine['device']}, "
             f"{', '.join(cfg['shapes'])}, {cfg['mode']} mode)", ""]
    lines += [f"Command: `{result['command']}`", ""]
    gpu = machine.get("gpu") or "none"
    lines += [f"Machine: {machine['cpu']} ({machine['cpu_cores']} cores, {machine['torch_threads']} torch threads), "
              f"GPU: {gpu}; torch {machine['torch']}, Python {machine['python']}. "
              f"Load average at start/end: {result.get('load_start')} / {result.get('load_end')}. "
              f"Wall time: {result['elapsed_s'] / 60:.1f} min. Code: {report.describe_git(result.get('git'))}.", ""]
    clock = ("process CPU time (`--clock cpu`: time other processes hold the core is not counted; "
             f"{machine['torch_threads']} torch thread(s))" if cfg.get("clock") == "cpu" else "wall-clock time")
    budget = f" (fewer where `--cell-budget {cfg['cell_budget']}` s applied; see the details table)" \
        if cfg.get("cell_budget") else ""
    lines += [f"Times are the **{stat}** {clock} over {cfg['repeats']} timed runs after a checking call and "
              f"{cfg['warmup']} warm-up runs{budget}, in seconds, float32, parameters frozen"
              + ("; CPU buffers on a steady heap (`--steady-malloc`)" if cfg.get("steady_malloc") else "")
              + ". Speed-up = fastest alternative / clone. `fwd 2B` is the plain forward of the same 2B-row "
              "batch `[x; x + s·u]` (not a JVP: the lower bound for clone mode).", ""]
    lines += ["Legend: `-` out of memory; `-*` not attempted, the batch Jacobian's estimated memory (Jacobians plus "
              f"a backward pass carrying K cotangents) exceeds the limit; `fails: …` the method raised (full messages below); `≠` the JVP differs from clone's by more "
              f"than {rtol:g} (max relative difference), excluded from the fastest alternative; `∞` every "
              "alternative failed (excluded from the averages).", ""]
    by_group: Dict[tuple, List] = defaultdict(list)
    for r in rows:
        by_group[(r["shape"], r["kind"])].append(r)
    shapes = {s["name"]: s for s in result["shapes"]}
    for (shape_name, kind), rs in by_group.items():
        sh = shapes[shape_name]
        lines += [f"## {KINDS[kind]} — {shape_name}: x ∈ R^{{3×{sh['image_size']}×{sh['image_size']}}}, "
                  f"y ∈ R^{{{sh['num_classes']}}}, batch {sh['batch_size']}", ""]
        headers = ["Model", "# params", "first layer"] + [METHODS[m].label for m in cols] + ["speed-up"]
        if has_fwd:
            headers += ["fwd 2B", "clone / fwd 2B"]
        body = []
        for r in rs:
            name = r["model"] + (f" ({r['image_size']}px)" if r["image_size"] != sh["image_size"] else "")
            name += "".join(f", {k}={v}" for k, v in r["model_kwargs"].items())
            sm = r["summary"]
            sp = report.fmt_ratio(sm["speedup"])
            if sm.get("clone_suspect"):
                sp = "clone ≠ alternatives"
            row = [name, report.fmt_count(r["params"]) if r["params"] else "?", f"`{r['first_layer']}`"]
            row += [_cell_text(r["cells"].get(m, {"status": "fails", "reason": "not run"}), stat, rtol) for m in cols]
            row += [f"**{sp}**" if sm["speedup"] is not None else sp]
            if has_fwd:
                row += [_cell_text(r["cells"].get("fwd_2b", {}), stat, rtol), report.fmt_ratio(sm["clone_over_fwd2b"])]
            body.append(row)
        summ = result["summary"][shape_name][kind]
        pad = [""] * (len(headers) - 1 - (3 if has_fwd else 1))
        tail = ["", "", report.fmt_ratio(summ["clone_over_fwd2b_arith"])] if has_fwd else []
        body.append(["**arithmetic average**"] + pad + [f"**{report.fmt_ratio(summ['speedup_arith'])}**"] + tail)
        tail = ["", "", report.fmt_ratio(summ["clone_over_fwd2b_geo"])] if has_fwd else []
        body.append(["**geometric average**"] + pad + [f"**{report.fmt_ratio(summ['speedup_geo'])}**"] + tail)
        lines += [report.md_table(headers, body, "lrl" + "r" * (len(headers) - 3)), ""]
        fm = summ["from_means"]
        bound = speedup_bound(rs, stat, rtol)
        n_within = sum(1 for r in rs if r["summary"]["clone_over_fwd2b"] is not None
                       and r["summary"]["clone_over_fwd2b"] <= cfg["profile_ratio"])
        if has_fwd:
            lines += [f"Bound: if clone cost exactly one 2B forward, the speed-up would be fastest alternative / "
                      f"fwd 2B, geometric mean **{report.fmt_ratio(bound)}** over these rows. clone / fwd 2B ≤ "
                      f"{cfg['profile_ratio']:g} in {n_within} of {len(rs)} rows.", ""]
        lines += [f"Averages over {summ['speedup_n']} finite speed-ups ({summ['speedup_inf']} infinite). "
                  f"Same averages from mean times: speed-up arith {report.fmt_ratio(fm['speedup_arith'])}, "
                  f"geo {report.fmt_ratio(fm['speedup_geo'])}; clone / fwd 2B geo "
                  f"{report.fmt_ratio(fm['clone_over_fwd2b_geo'])}.", ""]

    lines += ["## Details: mean ± std (timed runs), max relative difference to clone", ""]
    detail_cols = cols + (["fwd_2b"] if has_fwd else [])
    headers = ["Shape", "Kind", "Model"] + [METHODS[m].label for m in detail_cols]
    body = []
    for r in rows:
        row = [r["shape"], r["kind"], r["model"]]
        for m in detail_cols:
            c = r["cells"].get(m, {})
            if c.get("status") != "ok":
                row.append("-" if c.get("status") == "oom" else "fails")
                continue
            txt = f"{report.fmt_seconds(c['mean'])} ± {report.fmt_seconds(c['std'], 2)} (n={c['repeats']})"
            if c.get("max_rel_diff") is not None:
                txt += f", Δ={c['max_rel_diff']:.1e}"
            row.append(txt)
        body.append(row)
    lines += [report.md_table(headers, body, "lll" + "r" * len(detail_cols)), ""]

    fails = [(r, m, c) for r in rows for m, c in r["cells"].items() if c.get("status") != "ok"]
    if fails:
        lines += ["## Failures", ""]
        for r, m, c in fails:
            msg = c.get("error", c.get("reason", "")).replace("\n", " ")
            lines.append(f"- {r['shape']}/{r['model']}/{r['kind']}/{m}: {c['status']} — {msg[:300]}")
        lines.append("")

    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        lines += ["## Profiles: clone vs plain 2B forward (self time per call, ms)", "",
                  f"Rows with clone / fwd 2B > {cfg['profile_ratio']} or speed-up < {cfg['profile_speedup']}, "
                  f"profiled with torch.profiler over {cfg['profile_iters']} calls each.", ""]
        for r in profiled:
            p = r["profile"]
            lines.append(f"### {r['shape']}/{r['model']}/{r['kind']}")
            lines.append("")
            if "error" in p:
                lines += [f"profiling failed: {p['error']}", ""]
                continue
            lines.append(f"Total self time: clone {p['clone_self_ms']:.1f} ms, fwd 2B {p['fwd2b_self_ms']:.1f} ms. "
                         "Largest excesses of clone: " + ", ".join(
                             f"`{e['op']}` +{e['extra_ms']:.1f} ms ({e['calls']} calls)" for e in p["excess"][:5]) + ".")
            lines.append("")
            n = max(len(p["clone_top"]), len(p["fwd2b_top"]))
            body = []
            for i in range(min(n, 8)):
                a = p["clone_top"][i] if i < len(p["clone_top"]) else None
                b = p["fwd2b_top"][i] if i < len(p["fwd2b_top"]) else None
                body.append([f"`{a['op']}`" if a else "", f"{a['self_ms']:.2f} ({a['calls']})" if a else "",
                             f"`{b['op']}`" if b else "", f"{b['self_ms']:.2f} ({b['calls']})" if b else ""])
            lines += [report.md_table(["clone op", "ms (calls)", "fwd 2B op", "ms (calls)"], body, "lrlr"), ""]
    if result.get("notes_auto"):
        lines += ["## Automatic notes", ""] + [f"- {n}" for n in result["notes_auto"]] + [""]
    if notes:
        lines += ["## Findings", "", notes.strip(), ""]
    return "\n".join(lines)


def plot_speedups(result: Mapping[str, Any], path: str | Path) -> Path:
    """Bar chart: speed-up of clone over the fastest alternative per architecture, one bar per (shape, kind)."""
    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    series: Dict[str, List] = {}
    for r in rows:
        key = f"{'x' if r['kind'] == 'x' else 'W¹'}, {r['shape']}"
        series.setdefault(key, [None] * len(models))[models.index(r["model"])] = r["summary"]["speedup"]
    geo = ", ".join(f"{sh}/{k}: {report.fmt_ratio(v['speedup_geo'])}" for sh, d in result["summary"].items()
                    for k, v in d.items())
    title = (f"clone JVP speed-up over the fastest alternative ({result['machine']['device']}; "
             f"geo. mean {geo})")
    target = result["config"].get("profile_speedup")
    extra = [(target, f"target {target:g}×")] if target else []
    return report.bar_chart(path, models, series, title=title, ylabel="speed-up (×)", extra_lines=extra)


# --------------------------------------------------------------------------------------------
# CLI


def build_parser(prog: str = "python -m jvpreg.bench paper") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="The paper's JVP timing tables (timesX/timesW) over its 13 architectures.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="small",
                   help="comma list of: small (3x64x64->20, batch 4), paper (= paper100,paper400), "
                        "paper100 (3x100x100->20), paper400 (3x400x400->1000)")
    p.add_argument("--image-size", type=int, default=None, help="override every shape's input side")
    p.add_argument("--num-classes", type=int, default=None, help="override every shape's output size")
    p.add_argument("--batch-size", type=int, default=None, help="override every shape's batch size")
    p.add_argument("--models", default="all", help="comma list of architectures (default: the paper's 13)")
    p.add_argument("--methods", default="all", help="comma list of: " + ", ".join(METHODS))
    p.add_argument("--kinds", default="x,w", help="comma list of: x (input), w (first-layer weight)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per cell")
    p.add_argument("--warmup", type=int, default=2, help="warm-up runs per cell (after the checking call)")
    p.add_argument("--cell-budget", type=float, default=None,
                   help="seconds per cell; slow cells get fewer repeats (>= 2), recorded per cell")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", choices=("eval", "train"), default="eval",
                   help="eval, or train-mode BatchNorm (dropout stays off)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--stat", choices=("median", "mean", "min"), default="median", help="statistic of the tables")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall clock, or the process CPU clock (CPU only; robust to other processes on a "
                        "shared machine, use with --threads 1). Both are recorded per cell.")
    p.add_argument("--rtol", type=float, default=1e-3, help="max relative difference to clone counted as agreeing")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="skip batch Jacobians larger than this (default: GPU memory, or half the free RAM)")
    p.add_argument("--profile", choices=("auto", "all", "none"), default="auto",
                   help="profile clone vs fwd 2B for rows that miss the targets (auto), every row, or none")
    p.add_argument("--profile-ratio", type=float, default=1.2, help="auto-profile rows with clone/fwd2B above this")
    p.add_argument("--profile-speedup", type=float, default=2.5, help="auto-profile rows with speed-up below this")
    p.add_argument("--steady-malloc", choices=("auto", "on", "off"), default="auto",
                   help="keep CPU buffers on glibc's heap (no per-call page faults); auto = on for CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/paper", help="output directory")
    p.add_argument("--name", default=None, help="file stem (default: <device>_<shapes>)")
    p.add_argument("--notes", default=None, help="Markdown file appended to the report as 'Findings'")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="re-render the MD (with --notes) and PNG of an earlier run from its JSON; runs nothing")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m jvpreg.bench paper") -> int:
    """Run the grid and write ``<name>.json``, ``<name>.md`` and ``<name>_speedup.png``; returns 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    if args.from_json:
        return _rerender(Path(args.from_json), args)
    from jvpreg.models import PAPER_ARCHITECTURES, list_models

    shape_names: List[str] = []
    for item in _parse_list(args.shapes, SHAPE_GROUPS, "shapes"):
        shape_names += [n for n in SHAPE_GROUPS[item] if n not in shape_names]
    shapes = []
    for n in shape_names:
        sh = SHAPES[n]
        over = {k: v for k, v in (("image_size", args.image_size), ("num_classes", args.num_classes),
                                  ("batch_size", args.batch_size)) if v is not None}
        shapes.append(dataclasses.replace(sh, **over))
    known_models = {m: None for m in list(PAPER_ARCHITECTURES) + [m for m in list_models() if m not in PAPER_ARCHITECTURES]}
    models = list(PAPER_ARCHITECTURES) if args.models == "all" else _parse_list(args.models, known_models, "models")
    methods = _parse_list(args.methods, METHODS, "methods", METHOD_ALIASES)
    kinds = _parse_list(args.kinds, KINDS, "kinds")
    for flag in ("repeats", "warmup"):
        if getattr(args, flag) < (1 if flag == "repeats" else 0):
            raise SystemExit(f"--{flag}: expected >= {1 if flag == 'repeats' else 0}, got {getattr(args, flag)}")
    if args.clock == "cpu" and torch.device(args.device).type != "cpu":
        raise SystemExit("--clock cpu: only meaningful with --device cpu (GPU kernels run asynchronously).")
    if args.threads:
        torch.set_num_threads(args.threads)
    steady = args.steady_malloc == "on" or (args.steady_malloc == "auto" and torch.device(args.device).type == "cpu")
    steady = steady and report.steady_malloc()
    settings = Settings(clock=args.clock, repeats=args.repeats, warmup=args.warmup, device=args.device, mode=args.mode,
                        cell_budget=args.cell_budget, memory_limit_gb=args.memory_limit_gb, rtol=args.rtol,
                        stat=args.stat, profile=args.profile, profile_ratio=args.profile_ratio,
                        profile_speedup=args.profile_speedup, seed=args.seed)
    device = torch.device(args.device)
    name = args.name or f"{device.type}_{'_'.join(s.name for s in shapes)}"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = _dt.datetime.now().astimezone()
    load_start = report.load_average()
    t0 = time.perf_counter()
    rows = run_grid(shapes, models, methods, kinds, settings, show_progress=not args.quiet)
    elapsed = time.perf_counter() - t0

    notes_auto = []
    if "clone" not in methods:
        notes_auto.append("clone was not run: no reference JVP, no speed-ups.")
    if device.type == "cpu" and not any(s.name == "paper400" for s in shapes):
        notes_auto.append("the 3×400×400 → 1000 shape was not run (CPU run; pass --shapes paper to run it).")
    result = {
        "benchmark": "paper",
        "command": report.command_line(prog, argv),
        "argv": argv,
        "machine": machine_description(device),
        "git": report.git_state(),
        "started": started.isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "load_start": load_start,
        "load_end": report.load_average(),
        "config": {**dataclasses.asdict(settings), "models": models, "methods": methods, "kinds": kinds,
                   "shapes": [s.name for s in shapes], "steady_malloc": steady},
        "shapes": [dataclasses.asdict(s) for s in shapes],
        "rows": rows,
        "summary": summarize(rows),
        "notes_auto": notes_auto,
    }
    result["notes"] = Path(args.notes).read_text() if args.notes else None
    report.write_results(out_dir / name, render_markdown(result), result)
    if not args.no_plot:
        plot_speedups(result, out_dir / f"{name}_speedup.png")
    if not args.quiet:
        for sh, d in result["summary"].items():
            for k, v in d.items():
                print(f"{sh}/{k}: speed-up arith {report.fmt_ratio(v['speedup_arith'])} geo "
                      f"{report.fmt_ratio(v['speedup_geo'])}; clone/fwd2B arith "
                      f"{report.fmt_ratio(v['clone_over_fwd2b_arith'])} geo {report.fmt_ratio(v['clone_over_fwd2b_geo'])}")
        print(f"wrote {out_dir / name}.{{json,md}}" + ("" if args.no_plot else f" and {name}_speedup.png")
              + f" in {elapsed / 60:.1f} min")
    return 0


def _rerender(path: Path, args: argparse.Namespace) -> int:
    """``--from-json``: rewrite ``<stem>.md`` (and ``<stem>_speedup.png``) next to the JSON, with ``--notes``."""
    result = report.read_json(path)
    if args.notes:
        result["notes"] = Path(args.notes).read_text()
        report.write_json(path, result)
    stem = path.with_suffix("")
    stem.with_suffix(".md").write_text(render_markdown(result))
    if not args.no_plot:
        plot_speedups(result, f"{stem}_speedup.png")
    print(f"re-rendered {stem}.md" + ("" if args.no_plot else f" and {stem.name}_speedup.png"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
