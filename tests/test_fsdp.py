"""Sharded data parallelism on CPU: 2 gloo processes against the unsharded network under DDP.

Each rank feeds its own rows to a sharded copy and to an unsharded copy of one network. The sharded
run's outputs, penalties, JVPs, running statistics and (all-gathered) parameter gradients must equal
the unsharded run's, whose gradients are averaged over the ranks as DDP averages them (≤ 1e-10 in
float64). JVPs are also checked against ``torch.func.jvp`` in eval mode. Also: FSDP2 mixed precision
(bf16 parameters, fp32 reduction) against a bf16 copy; the collectives of a regularized step against
a plain one; FSDP1 (``FullyShardedDataParallel``, what Lightning's ``FSDPStrategy`` wraps with); the
refusals. Each ``fully_shard``-ed child's forward body is captured (``jvpreg.clone.program.sharded_units``): its second
call replays, which the workers assert. One spawn per test (process start-up dominates the cost); an assertion
failing on a rank fails the test with its message.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import os
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("needs torch.distributed.fsdp.fully_shard (FSDP2)", allow_module_level=True)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import jvpreg
from jvpreg.losses import (JacobianFrobenius, JacobianSpectralNorm, JVPConstraint, ParameterSensitivity,
                           Stack, TangentProp, regularized_forward)

WORLD = 2
TOL = dict(rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- networks and shardings


def conv_bn() -> nn.Module:
    """Train-mode BatchNorm inside a nested-sharded block."""
    return nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
                         nn.Flatten(), nn.Linear(64, 3))


def transformer() -> nn.Module:
    """A pre-norm transformer encoder block (attention, LayerNorm, GELU) between two linear maps."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
    return nn.Sequential(nn.Linear(6, 16), layer, nn.Flatten(), nn.Linear(80, 3))


class InPlaceResidual(nn.Module):
    """A unit's output updated in place by its caller (``h += x``): FSDP2 warns when a unit returns a view, whose
    in-place update would drop the pre-backward hook it put there."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        h += x
        return self.b(torch.relu(h))


NETS = {"conv_bn": (conv_bn, (8, 1, 4, 4)), "transformer": (transformer, (8, 5, 6)),
        "in_place_residual": (InPlaceResidual, (8, 6))}
# Weight directions: every weight of the conv net; every parameter of the transformer.
WEIGHTS = {"conv_bn": ("*weight",), "transformer": ("*",), "in_place_residual": ("*",)}


def shard(net: nn.Module, **kw) -> nn.Module:
    """``fully_shard`` every child with parameters (nested groups), then the root."""
    for child in net.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kw)
    fully_shard(net, **kw)
    return net


def penalties(net: str):
    """``name -> factory`` of every penalty; seeded so that both copies draw the same directions."""
    shape = NETS[net][1]
    fixed = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)[: shape[0] // WORLD]
    out = {
        "jacobian_frobenius": lambda: JacobianFrobenius(2, seed=0),
        "spectral": lambda: JacobianSpectralNorm(seed=0),
        "spectral_3_iterations": lambda: JacobianSpectralNorm(3, seed=0),
        "constraint": lambda: JVPConstraint(fixed, "zero"),
        "sensitivity": lambda: ParameterSensitivity(WEIGHTS[net], n_projections=2, seed=0),
        "stack": lambda: Stack([JacobianFrobenius(seed=1), ParameterSensitivity(WEIGHTS[net], seed=2)],
                               weights=[1.0, 0.5]),
    }
    if len(shape) == 4:
        out["tangent_prop"] = lambda: TangentProp(("rotate", "scale"))
    return out


# --------------------------------------------------------------------------- the root cause, in one process


def test_gradient_hook_on_a_clone_fires():
    """FSDP2 unshards a layer's weights for backward from a hook on the layer's output: a hook
    registered on a clone output must fire (it was put on an alias no gradient reaches)."""
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x, u = torch.randn(2, 3, dtype=torch.float64), torch.randn(1, 2, 3, dtype=torch.float64)
    (xc,), s = jvpreg.clone.pack((x,), (u,))
    seen = []

    def f(xc):
        y = xc @ w
        y.register_hook(lambda g: seen.append(tuple(g.shape)))
        return y

    y = jvpreg.clone.call(f, (xc,))
    out, tan = jvpreg.clone.unpack(y, s)
    (out.sum() + tan.pow(2).sum()).backward()
    assert seen == [(2, 2, 3)]  # the physical (K, *L) gradient


# --------------------------------------------------------------------------- process plumbing


def _entry(rank: int, store: str, worker: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        globals()[worker](rank, *args)
    finally:
        dist.destroy_process_group()
    _exit_quietly()


def _exit_quietly() -> None:
    """End a worker that succeeded without interpreter teardown: under load, a background thread left at
    exit sometimes aborts the process ('terminate called without an active exception') after its work is
    done, which mp.spawn reports as a failure. Failures still raise before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: str, *args) -> None:
    """Run ``worker(rank, *args)`` on 2 gloo processes; an exception on any rank fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:  # a file store: no port to race for
        mp.spawn(_entry, args=(os.path.join(tmp, "store"), worker, args), nprocs=WORLD, join=True)


def _close(a, b, what: str, **tol) -> None:
    torch.testing.assert_close(a, b, **(tol or TOL), msg=lambda m: f"rank {dist.get_rank()}, {what}: {m}")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _ddp_average(net: nn.Module) -> None:
    for p in net.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= WORLD


def _inputs(shape, rank: int, dtype=torch.float64) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return x[rank::WORLD].contiguous()  # each rank its own rows


# --------------------------------------------------------------------------- workers


def _check_penalty(rank: int, net_name: str, pen_name: str) -> None:
    build, shape = NETS[net_name]
    torch.manual_seed(0)
    net = build().double().train()
    ref, sharded = copy.deepcopy(net), shard(copy.deepcopy(net))
    x = _inputs(shape, rank)
    make = penalties(net_name)[pen_name]
    results = []
    for model in (ref, sharded):
        pen = make()
        for step in range(2):  # the spectral vectors and the seeded generators move on between steps
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out, value = regularized_forward(model, x, pen)
                (out.pow(2).mean() + value).backward()
            views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
            assert not views, f"{net_name}/{pen_name}: a clone output was taken for a view: {views[0]}"
            if model is ref:
                _ddp_average(ref)
            results.append((out.detach(), value.detach(), {n: _full(p.grad).clone() for n, p in
                                                            model.named_parameters() if p.grad is not None}))
    where = f"{net_name}/{pen_name}"
    for step, ((out_r, val_r, g_r), (out_s, val_s, g_s)) in enumerate(zip(results[:2], results[2:])):
        _close(out_s, out_r, f"{where} step {step} output")
        _close(val_s, val_r, f"{where} step {step} penalty")
        assert g_s.keys() == g_r.keys(), f"{where}: gradients of {sorted(g_s)} vs {sorted(g_r)}"
        for n in g_r:
            _close(g_s[n], g_r[n], f"{where} step {step} grad {n}")
    for (n, b_r), b_s in zip(ref.named_buffers(), sharded.buffers()):
        _close(b_s, b_r, f"{where} buffer {n}")
    _assert_units_captured(sharded, where)


def _assert_units_captured(sharded: nn.Module, where: str) -> None:
    """The second step replayed each fully_shard-ed child's forward body from a captured program (the root, whose
    forward calls the units between FSDP's hooks, runs eagerly)."""
    from jvpreg.clone.program import capture

    for name, unit in sharded.named_children():
        if isinstance(unit, fsdp.FSDPModule):
            progs = capture.programs(unit).values()
            assert any(p.gm is not None for p in progs), f"{where}: unit {name} was not captured: " + \
                "; ".join(p.reason for p in progs)


def _check_jvp(rank: int, net_name: str) -> None:
    build, shape = NETS[net_name]
    torch.manual_seed(0)
    net = build().double()
    ref, sharded = copy.deepcopy(net), shard(copy.deepcopy(net))
    x = _inputs(shape, rank)
    u = torch.randn((3, *x.shape), generator=torch.Generator().manual_seed(2 + rank), dtype=x.dtype)
    for mode in ("eval", "train"):
        ref.train(mode == "train")
        sharded.train(mode == "train")
        for _ in range(2):  # the first call of a signature runs eagerly, the second records and replays
            y_s, t_s = jvpreg.jvp(sharded, (x,), (u,), batched_tangents=True)
        _assert_units_captured(sharded, f"{net_name} {mode} jvp")
        y_r, t_r = jvpreg.jvp(ref, (x,), (u,), batched_tangents=True)
        _close(y_s, y_r, f"{net_name} {mode} jvp output")
        _close(t_s, t_r, f"{net_name} {mode} jvp")
        if mode == "eval":
            for j in range(u.shape[0]):
                with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention kernel has no forward AD
                    _, t_f = torch.func.jvp(ref, (x,), (u[j],))
                _close(t_s[j], t_f, f"{net_name} eval jvp vs torch.func, direction {j}")


def _check_ancestor_managed(rank: int) -> None:
    """The regularized module is a child whose weights the sharded root manages (hooks, as the callbacks)."""
    from jvpreg.callbacks.shared import SharedForward

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)), nn.Linear(6, 3)).double()
    ref, sharded = copy.deepcopy(net), copy.deepcopy(net)
    fully_shard(sharded[1])
    fully_shard(sharded)  # the root manages sharded[0]'s weights
    x = _inputs((8, 4), rank)
    results = []
    for model in (ref, sharded):
        hooks = SharedForward(model[0])
        hooks.arm([(JacobianFrobenius(seed=0), 1.0, 1.0), (ParameterSensitivity("*weight", seed=1), 1.0, 1.0)])
        out = model(x)
        (out.pow(2).mean() + hooks.total()).backward()
        hooks.remove()
        if model is ref:
            _ddp_average(ref)
        results.append([out.detach()] + [_full(p.grad) for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        _close(b, a, f"ancestor-managed, tensor {i}")
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' of Linear is still a sharded DTensor when "
                       r"Sequential runs: no fully_shard-ed module around this forward unshards it"):
        regularized_forward(sharded[0], x, ParameterSensitivity("0.weight"))


def worker_exact(rank: int) -> None:
    _check_ancestor_managed(rank)
    for net_name in NETS:
        _check_jvp(rank, net_name)
        for pen_name in penalties(net_name):
            _check_penalty(rank, net_name, pen_name)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_penalties_and_jvps_match_unsharded_ddp():
    """Every penalty, conv + train-mode BatchNorm, a transformer block and a unit output updated in place,
    nested ``fully_shard``; no unit's clone output is taken for a view."""
    spawn("worker_exact")


# --------------------------------------------------------------------------- mixed precision


def worker_mixed_precision(rank: int) -> None:
    """bf16 parameters, fp32 gradient reduction: equals a bf16 copy under DDP with fp32 averaging.

    The transformer, not the BatchNorm net: PyTorch's CPU batch_norm refuses bf16 weights with the
    fp32 running statistics that FSDP's parameter-only cast leaves (plain forward included)."""
    build, shape = NETS["transformer"]
    torch.manual_seed(0)
    net = build().train()
    ref = copy.deepcopy(net).to(torch.bfloat16)
    sharded = shard(copy.deepcopy(net), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32))
    x = _inputs(shape, rank, torch.float32).to(torch.bfloat16)
    for make in (lambda: JacobianFrobenius(2, seed=0),
                 lambda: ParameterSensitivity(WEIGHTS["transformer"], relative=False, seed=0)):
        results = []
        for model in (ref, sharded):
            model.zero_grad(set_to_none=True)
            out, value = regularized_forward(model, x, make())
            (out.float().pow(2).mean() + value).backward()
            grads = {n: _full(p.grad).float() for n, p in model.named_parameters()}
            if model is ref:
                for g in grads.values():
                    dist.all_reduce(g)
                    g /= WORLD
            results.append((out, value, grads))
        (out_r, val_r, g_r), (out_s, val_s, g_s) = results
        what = type(make()).__name__
        assert out_s.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in g_s.values())
        _close(out_s, out_r, f"bf16 {what} output", rtol=0, atol=0)
        _close(val_s, val_r, f"bf16 {what} penalty", rtol=0, atol=0)
        for n in g_r:
            _close(g_s[n], g_r[n], f"bf16 {what} grad {n}", rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_mixed_precision_bf16_params_fp32_reduce():
    spawn("worker_mixed_precision")


# --------------------------------------------------------------------------- collectives


COUNTED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_reduce")


@contextlib.contextmanager
def count_collectives():
    """``{name: calls}`` of the ``torch.distributed`` collectives FSDP2 uses, while in the context."""
    counts = {name: 0 for name in COUNTED if hasattr(dist, name)}
    saved = {name: getattr(dist, name) for name in counts}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)
        return call

    for name in counts:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def worker_collectives(rank: int, report: str) -> None:
    """One training step's collectives: plain vs one clone forward carrying 1 + 3 + 2 blocks."""
    build, shape = NETS["transformer"]
    torch.manual_seed(0)
    net = shard(build().double().train())
    x = _inputs(shape, rank)
    reg = Stack([JacobianFrobenius(3, seed=0), ParameterSensitivity(WEIGHTS["transformer"], 2, relative=False)])
    steps = {"plain": lambda: net(x).pow(2).mean(),
             "regularized": lambda: (lambda o, p: o.pow(2).mean() + p)(*regularized_forward(net, x, reg))}
    found = {}
    for name, step in [("warm-up", steps["plain"])] + list(steps.items()):
        net.zero_grad(set_to_none=True)
        with count_collectives() as counts:
            step().backward()
        found[name] = dict(counts)
    groups = sum(1 for m in net.modules() if isinstance(m, fsdp.FSDPModule))
    assert found["regularized"] == found["plain"], f"rank {rank}: {found}"
    # FSDP2 all-gathers through all_gather_single (torch 2.15) or all_gather_into_tensor (torch 2.11)
    gathers = found["plain"].get("all_gather_single", 0) + found["plain"].get("all_gather_into_tensor", 0)
    assert gathers >= groups, found
    if rank == 0:
        with open(report, "w") as f:
            f.write(f"groups={groups} " + " ".join(f"{k}={v}" for k, v in found["plain"].items()))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp2_one_all_gather_per_group_serves_every_block(tmp_path):
    """The tangent blocks ride in the same forward: as many collectives as a plain step."""
    report = tmp_path / "collectives.txt"
    spawn("worker_collectives", str(report))
    print(report.read_text())


# --------------------------------------------------------------------------- FSDP1 and refusals


class SkipsSecond(nn.Module):
    """Calls only its first child: a weight direction on the second is never applied."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.first(x)


def worker_fsdp1_and_refusals(rank: int) -> None:
    """FSDP1 (what Lightning's FSDPStrategy wraps with): input directions exact, weight directions refused;
    tensor-parallel parameters and unapplied weight directions refused with their fix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    build, shape = NETS["conv_bn"]
    torch.manual_seed(0)
    net = build().double().train()
    ref = copy.deepcopy(net)
    wrapped = FSDP(copy.deepcopy(net), auto_wrap_policy=ModuleWrapPolicy({nn.Conv2d, nn.Linear}),
                   device_id=torch.device("cpu"), use_orig_params=True)
    x = _inputs(shape, rank)
    for pen_name in ("jacobian_frobenius", "spectral", "tangent_prop"):
        make = penalties("conv_bn")[pen_name]
        values = []
        for model in (ref, wrapped):
            model.zero_grad(set_to_none=True)
            out, value = regularized_forward(model, x, make())
            (out.pow(2).mean() + value).backward()
            values.append((out.detach(), value.detach()))
        _ddp_average(ref)
        _close(values[1][0], values[0][0], f"FSDP1 {pen_name} output")
        _close(values[1][1], values[0][1], f"FSDP1 {pen_name} penalty")
        with FSDP.summon_full_params(wrapped, with_grads=True):
            for (n, a), b in zip(ref.named_parameters(), wrapped.parameters()):
                _close(b.grad, a.grad, f"FSDP1 {pen_name} grad {n}")
    with pytest.raises(NotImplementedError, match=r"prepare\(model, x, terms\): parameter '_fsdp_wrapped_module\..*' "
                       r"belongs to a FullyShardedDataParallel \(FSDP1\) flat parameter; .* Shard with "
                       r"torch\.distributed\.fsdp\.fully_shard"):
        regularized_forward(wrapped, x, ParameterSensitivity("*weight"))

    lin = parallelize_module(nn.Linear(4, 4).double(), init_device_mesh("cpu", (WORLD,)), RowwiseParallel())
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' is a DTensor with placements \(Shard\(dim=1\),\) "
                       r"that fully_shard \(FSDP2\) does not produce \(tensor parallelism\?\)"):
        regularized_forward(lin, torch.randn(2, 4, dtype=torch.float64), JacobianFrobenius())

    skips = SkipsSecond().double()
    fully_shard(skips.second)
    fully_shard(skips)
    with pytest.raises(RuntimeError, match=r"the fully_shard-ed module\(s\) second managing the perturbed parameters "
                       r"were not called during the forward"):
        regularized_forward(skips, torch.randn(2, 4, dtype=torch.float64), ParameterSensitivity("second.weight"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp1_input_directions_exact_weight_directions_and_tensor_parallel_refused():
    spawn("worker_fsdp1_and_refusals")
