"""The operators of :mod:`jvpreg.clone.rules.kernels` and :mod:`jvpreg.clone.rules.batch_norm`: values and written-out
backwards against autograd in float64."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jvpreg.clone.rules import batch_norm, kernels

D = torch.float64
EPS = 1e-5
_BN_BACKWARD = torch.ops.aten.native_batch_norm_backward.default


def _cuda_bn_backward(grad, x, weight, *rest):
    """``native_batch_norm_backward`` as CUDA's kernel returns it: an empty weight gradient when no weight is
    passed (the CPU's kernel computes it), seen on an H100 with torch 2.11."""
    out = _BN_BACKWARD(grad, x, weight, *rest)
    return out if weight is not None or out[1] is None else (out[0], out[1].new_empty(0), out[2])


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu-kernel", "cuda-kernel-contract"])
def bn_kernel(request, monkeypatch):
    """Run a test with torch's BatchNorm backward kernel as this CPU has it, and as CUDA's behaves, with the
    backward's form each device takes (:func:`jvpreg.clone.rules.batch_norm.few_launches`)."""
    if request.param == "cuda":
        monkeypatch.setattr(batch_norm, "_bn_backward", _cuda_bn_backward)
        monkeypatch.setattr(batch_norm, "few_launches", lambda t: True)
    return request.param


def _stats(a):
    dims = (0,) + tuple(range(2, a.dim()))
    var, mean = torch.var_mean(a, dim=dims, correction=0)
    return mean, torch.rsqrt(var + EPS)


def _bn_tangent(d, a, w):
    """The op with the statistics of ``a`` recomputed from it (so gradcheck's perturbations of ``a`` move them)."""
    mean, invstd = (s.detach() for s in _stats(a))
    return batch_norm.batch_norm_tangent(d, a, w, mean, invstd, EPS)[0]


def _bn_tangent_composite(d, a, w):
    """``gamma * r * (d_j - mean(d_j) - xhat * mean(d_j * xhat))`` from differentiable primitive ops."""
    dims = (0,) + tuple(range(2, a.dim()))
    mean, invstd = _stats(a)
    view = lambda p: p.reshape(-1, *([1] * (a.dim() - 2)))
    xhat = (a - view(mean)) * view(invstd)
    rd = tuple(i + 1 for i in dims)
    dn = d - d.mean(rd, keepdim=True) - xhat * (d * xhat).mean(rd, keepdim=True)
    scale = view(invstd) if w is None else view(invstd * w)
    return scale * dn


@pytest.mark.parametrize("shape, blocks, affine", [((6, 3), 1, True),
                                                   pytest.param((4, 3, 5, 5), 2, True, marks=pytest.mark.slow),
                                                   ((3, 2, 4), 1, False), ((2, 3, 3, 2, 2), 1, True)],
                         ids=["bn1d", "bn2d-two-tangents", "no-weight", "bn3d"])
def test_batch_norm_tangent_values_and_gradients(shape, blocks, affine, bn_kernel):
    torch.manual_seed(0)
    a = torch.randn(shape, dtype=D, requires_grad=True)
    d = torch.randn(blocks, *shape, dtype=D, requires_grad=True)
    w = torch.randn(shape[1], dtype=D, requires_grad=True) if affine else None
    torch.testing.assert_close(_bn_tangent(d, a, w), _bn_tangent_composite(d, a, w), rtol=1e-12, atol=1e-12)
    inputs = (d, a, w) if affine else (d, a)
    fn = (lambda d_, a_, w_: _bn_tangent(d_, a_, w_)) if affine else (lambda d_, a_: _bn_tangent(d_, a_, None))
    assert torch.autograd.gradcheck(fn, inputs)
    g = torch.randn(blocks, *shape, dtype=D)
    ref = (lambda d_, a_, w_: _bn_tangent_composite(d_, a_, w_)) if affine else \
        (lambda d_, a_: _bn_tangent_composite(d_, a_, None))
    got = torch.autograd.grad(fn(*inputs), inputs, g)
    want = torch.autograd.grad(ref(*inputs), inputs, g)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_batch_norm_tangent_create_graph_gives_the_same_gradients():
    """Under create_graph the backward runs through torch's double backward of the kernel: same first order."""
    torch.manual_seed(1)
    a = torch.randn(5, 3, 4, 4, dtype=D, requires_grad=True)
    d = torch.randn(1, 5, 3, 4, 4, dtype=D, requires_grad=True)
    w = torch.randn(3, dtype=D, requires_grad=True)
    g = torch.randn_like(d)
    plain = torch.autograd.grad(_bn_tangent(d, a, w), (d, a, w), g)
    graph = torch.autograd.grad(_bn_tangent(d, a, w), (d, a, w), g, create_graph=True)
    assert all(x.requires_grad for x in graph)
    for x, y in zip(plain, graph):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def _clone_bn_composite(z, w, b):
    """``[BN(a); BN(a) + t_j]`` with ``t_j`` of ``d_j = z_j - a`` (:func:`_bn_tangent_composite`), differentiable."""
    a = z[0]
    mean, invstd = _stats(a)
    view = lambda p: p.reshape(-1, *([1] * (a.dim() - 2)))
    out0 = (a - view(mean)) * view(invstd)
    if w is not None:
        out0 = out0 * view(w) + view(b)
    return torch.cat([out0.unsqueeze(0), out0 + _bn_tangent_composite(z[1:] - a, a, w)])


@pytest.mark.parametrize("shape, blocks, affine", [((6, 3), 2, True),
                                                   pytest.param((4, 3, 5, 5), 3, True, marks=pytest.mark.slow),
                                                   ((3, 2, 4), 2, False)],
                         ids=["bn1d", "bn2d-two-tangents", "no-weight"])
def test_batch_norm_blocks_values_and_gradients(shape, blocks, affine, bn_kernel):
    """Clone-BN in one operator: values and gradients (written out, and under create_graph) against the composite
    of differentiable primitive ops, in float64; through the operator and through its autograd.Function."""
    torch.manual_seed(0)
    z = torch.randn(blocks, *shape, dtype=D, requires_grad=True)
    w = torch.randn(shape[1], dtype=D, requires_grad=True) if affine else None
    b = torch.randn(shape[1], dtype=D, requires_grad=True) if affine else None
    inputs = tuple(t for t in (z, w, b) if t is not None)
    direct = kernels.DIRECT[torch.ops.jvpreg.batch_norm_blocks.default]

    def through(op):
        return lambda *args: op(args[0], *(args[1:] if affine else (None, None)), None, None, 0.1, EPS)[0]

    ref = lambda *args: _clone_bn_composite(args[0], *(args[1:] if affine else (None, None)))  # noqa: E731
    torch.testing.assert_close(through(batch_norm.batch_norm_blocks)(*inputs), ref(*inputs), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(through(batch_norm.batch_norm_blocks), inputs)
    g = torch.randn(blocks, *shape, dtype=D)
    want = torch.autograd.grad(ref(*inputs), inputs, g)
    for fn, create_graph in ((through(batch_norm.batch_norm_blocks), False), (through(direct), False),
                             (through(batch_norm.batch_norm_blocks), True)):
        got = torch.autograd.grad(fn(*inputs), inputs, g, create_graph=create_graph)
        assert all(x.requires_grad for x in got) == create_graph
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed-tokens"])
def test_batch_norm_blocks_primal_and_running_statistics_are_the_plain_forwards(layout):
    """Block 0 and the updated running statistics are bit-identical to ``nn.BatchNorm`` on the primal alone, in every
    input layout (BatchNorm's ``.out`` kernel reads a transposed input wrong: there the functional kernel runs), and
    every block keeps the plain output's layout."""
    torch.manual_seed(0)
    if layout == "transposed-tokens":
        a, bn = torch.randn(4, 49, 16).transpose(1, 2), nn.BatchNorm1d(16)
    else:
        a, bn = torch.randn(4, 8, 5, 5), nn.BatchNorm2d(8)
        if layout == "channels_last":
            a = a.contiguous(memory_format=torch.channels_last)
    plain = copy.deepcopy(bn)
    want = plain(a)
    z = torch.stack([a, a + torch.randn_like(a)]) if layout != "transposed-tokens" else \
        torch.stack([a.transpose(1, 2), torch.randn(4, 49, 16)]).transpose(2, 3)
    out, _, _, _, _, new_mean, new_var = batch_norm.batch_norm_blocks(z, bn.weight, bn.bias, bn.running_mean,
                                                                   bn.running_var, 0.1, bn.eps)
    assert torch.equal(out[0], want)
    assert torch.equal(new_mean, plain.running_mean) and torch.equal(new_var, plain.running_var)
    assert out[1].stride() == out[0].stride() == want.stride()


def test_batch_norm_relu_blocks_equals_the_two_operators():
    """The fused operator (:mod:`jvpreg.clone.program.passes` puts it where a relu alone reads a BatchNorm): the same blocks,
    pattern and gradients as ``relu_blocks(batch_norm_blocks(z)[0])``, a NaN primal entry passed as relu does."""
    torch.manual_seed(0)
    z = torch.randn(2, 6, 3, 4, 4, dtype=D)
    z[:, 0, 0, 0, 0] = float("nan")  # a NaN in one channel: that channel's statistics and outputs are NaN
    z.requires_grad_()
    w, b = torch.randn(3, dtype=D, requires_grad=True), torch.randn(3, dtype=D, requires_grad=True)
    fused = batch_norm.batch_norm_relu_blocks(z, w, b, None, None, 0.1, EPS)
    bn = batch_norm.batch_norm_blocks(z, w, b, None, None, 0.1, EPS)[0]
    two = kernels.relu_blocks(bn)
    torch.testing.assert_close(fused[0], two[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(fused[1], two[1])
    g = torch.randn_like(bn)
    for x, y in zip(torch.autograd.grad(fused[0], (z, w, b), g), torch.autograd.grad(two[0], (z, w, b), g)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    finite = torch.randn(2, 6, 3, 4, 4, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: batch_norm.batch_norm_relu_blocks(t, w, b, None, None, 0.1, EPS)[0],
                                    (finite,))


def test_relu_blocks_values_gradients_and_nan_convention():
    """``out_j = 1[a > 0] z_j``; backward ``keep * g``; a NaN primal entry passes values and gradients, as relu
    does (``relu(NaN) = NaN`` and its backward reads the NaN result as not clamped)."""
    torch.manual_seed(0)
    z = torch.randn(3, 4, 5, dtype=D, requires_grad=True)
    out, keep = kernels.relu_blocks(z)
    torch.testing.assert_close(out, (z[0] > 0) * z)
    assert keep.dtype == torch.bool and torch.equal(keep, z[0] > 0)
    assert torch.autograd.gradcheck(lambda t: kernels.relu_blocks(t)[0], (z,))
    assert torch.autograd.gradgradcheck(lambda t: kernels.relu_blocks(t)[0], (z,))

    nan = torch.tensor([[float("nan"), -1.0, 2.0], [5.0, 6.0, 7.0]], dtype=D, requires_grad=True)
    out, _ = kernels.relu_blocks(nan)
    assert torch.equal(out[1], torch.tensor([5.0, 0.0, 7.0], dtype=D))
    (grad,) = torch.autograd.grad(out[1].sum(), nan)
    x = torch.tensor([float("nan"), -1.0, 2.0], dtype=D, requires_grad=True)
    (want,) = torch.autograd.grad(torch.relu(x), x, torch.ones(3, dtype=D))
    assert torch.equal(grad[1], want)


def test_torch_func_grad_through_jvp_still_works_where_the_operators_would_apply():
    """The operators' autograd has no functorch support: under ``torch.func.grad`` the rules take their aten path
    (this failed with an autograd.Function/setup_context error) and the gradient equals plain autograd's."""
    import jvpreg
    from jvpreg.clone.rules.cpa import BOOL_MASK_NUMEL
    from torch import nn
    from torch.func import functional_call

    torch.manual_seed(0)
    width = BOOL_MASK_NUMEL // 4
    model = nn.Sequential(nn.Linear(6, width), nn.BatchNorm1d(width, track_running_stats=False), nn.ReLU(),
                          nn.Linear(width, 3)).to(D)
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def penalty(p):
        return jvpreg.jvp(lambda z: functional_call(model, p, (z,)), (x,), (u,))[1].pow(2).sum()

    got = torch.func.grad(penalty)(params)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    want = torch.autograd.grad(penalty(leaves), list(leaves.values()))
    for (k, g), w in zip(got.items(), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=k)


def _gn_tangent(d, a, w, groups):
    n, c = a.shape[:2]
    _, mean, rstd = torch.native_group_norm(a.detach(), None, None, n, c, a.numel() // (n * c), groups, EPS)
    return kernels.group_norm_tangent(d, a, w, mean, rstd, groups, EPS)[0]


def _gn_tangent_composite(d, a, w, groups):
    """The GroupNorm rule's primitive-op form (torch.func transforms, compiling): what the operator must equal."""
    return kernels.group_norm_tangent_composite(d, a, w, groups, EPS)


@pytest.mark.parametrize("shape, groups, blocks, affine", [((3, 6, 4, 4), 3, 1, True), ((2, 4, 5), 2, 2, True),
                                                           ((2, 6, 3, 3), 6, 1, False), ((4, 4, 2, 2), 1, 1, True)],
                         ids=["gn2d", "gn1d-two-tangents", "instance-like-no-weight", "one-group"])
def test_group_norm_tangent_values_and_gradients(shape, groups, blocks, affine):
    torch.manual_seed(0)
    a = torch.randn(shape, dtype=D, requires_grad=True)
    d = torch.randn(blocks, *shape, dtype=D, requires_grad=True)
    w = torch.randn(shape[1], dtype=D, requires_grad=True) if affine else None
    torch.testing.assert_close(_gn_tangent(d, a, w, groups), _gn_tangent_composite(d, a, w, groups),
                               rtol=1e-12, atol=1e-12)
    inputs = (d, a, w) if affine else (d, a)
    fn = (lambda *xs: _gn_tangent(*xs, groups)) if affine else (lambda d_, a_: _gn_tangent(d_, a_, None, groups))
    ref = (lambda *xs: _gn_tangent_composite(*xs, groups)) if affine else \
        (lambda d_, a_: _gn_tangent_composite(d_, a_, None, groups))
    assert torch.autograd.gradcheck(fn, inputs)
    g = torch.randn(blocks, *shape, dtype=D)
    for x, y in zip(torch.autograd.grad(fn(*inputs), inputs, g), torch.autograd.grad(ref(*inputs), inputs, g)):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_group_norm_tangent_second_order():
    """Under create_graph the operator differentiates its primitive-op form: second derivatives are exact too (it
    raised before: torch has no derivative for ``native_group_norm_backward``)."""
    torch.manual_seed(0)
    a = torch.randn(2, 4, 3, dtype=D, requires_grad=True)
    d = torch.randn(1, 2, 4, 3, dtype=D, requires_grad=True)
    w = torch.randn(4, dtype=D, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda *xs: _gn_tangent(*xs, 2), (d, a, w))


def _ln_tangent(d, a, w, normalized_shape):
    _, mean, rstd = torch.native_layer_norm(a.detach(), normalized_shape, None, None, EPS)
    return kernels.layer_norm_tangent(d, a, w, mean, rstd, list(normalized_shape), EPS)


@pytest.mark.parametrize("shape, normalized_shape, blocks, affine", [pytest.param((3, 5, 6), (6,), 1, True,
                                                                                  marks=pytest.mark.slow),
                                                                     pytest.param((2, 4, 3, 5), (3, 5), 2, True,
                                                                                  marks=pytest.mark.slow),
                                                                     ((7, 4), (4,), 1, False)],
                         ids=["tokens", "two-dims-two-tangents", "rows-no-weight"])
def test_layer_norm_tangent_values_gradients_and_second_order(shape, normalized_shape, blocks, affine):
    """Against the primitive-op form with statistics recomputed from ``a``, to the second derivative: torch's double
    backward of ``native_layer_norm_backward`` (the rule's tangent before this operator) holds the statistics fixed
    in its own derivative, so ``gradgradcheck`` failed on it (a wrong Hessian-vector product of a penalty)."""
    torch.manual_seed(0)
    a = torch.randn(shape, dtype=D, requires_grad=True)
    d = torch.randn(blocks, *shape, dtype=D, requires_grad=True)
    w = torch.randn(normalized_shape, dtype=D, requires_grad=True) if affine else None
    inputs = (d, a, w) if affine else (d, a)
    fn = lambda d_, a_, w_=None: _ln_tangent(d_, a_, w_, normalized_shape)
    ref = lambda d_, a_, w_=None: kernels.layer_norm_tangent_composite(d_, a_, w_, len(normalized_shape), EPS)
    torch.testing.assert_close(fn(*inputs), ref(*inputs), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)
    g = torch.randn_like(d)
    for x, y in zip(torch.autograd.grad(fn(*inputs), inputs, g), torch.autograd.grad(ref(*inputs), inputs, g)):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)



@pytest.mark.parametrize("wrt", ["d", "a", "w", "a,w", "d,w"])
def test_layer_norm_tangent_gradients_of_each_subset_of_inputs(wrt):
    """The backward computes only what is asked for (``u = r P(d)`` and the row means only for ``a`` or ``gamma``):
    every subset of inputs that requires grad gets the primitive-op form's gradients, in float64."""
    torch.manual_seed(0)
    a, d, w = torch.randn(3, 5, 6, dtype=D), torch.randn(2, 3, 5, 6, dtype=D), torch.randn(6, dtype=D)
    inputs = {"d": d, "a": a, "w": w}
    for name in wrt.split(","):
        inputs[name].requires_grad_()
    wanted = [inputs[name] for name in wrt.split(",")]
    g = torch.randn_like(d)
    got = torch.autograd.grad(_ln_tangent(d, a, w, (6,)), wanted, g)
    want = torch.autograd.grad(kernels.layer_norm_tangent_composite(d, a, w, 1, EPS), wanted, g)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_direct_entries_cover_every_operator_and_match_it_bitwise():
    """The replay calls :data:`kernels.DIRECT` (the operators' own functions as an autograd.Function): one per jvpreg
    operator, same values and gradients bit for bit as the custom operator."""
    ops = {getattr(torch.ops.jvpreg, name).default for name in dir(torch.ops.jvpreg)
           if isinstance(getattr(torch.ops.jvpreg, name, None), torch._ops.OpOverloadPacket)}
    assert ops and ops <= set(kernels.DIRECT)
    torch.manual_seed(0)
    a = torch.randn(3, 5, 6, dtype=D, requires_grad=True)
    d = torch.randn(2, 3, 5, 6, dtype=D, requires_grad=True)
    _, mean, rstd = torch.native_layer_norm(a.detach(), [6], None, None, EPS)
    g = torch.randn_like(d)
    w = torch.randn(6, dtype=D, requires_grad=True)
    cases = [(torch.ops.jvpreg.layer_norm_tangent.default, (d, a, w, mean, rstd, [6], EPS), (d, a, w), lambda o: o),
             (torch.ops.jvpreg.relu_blocks.default, (d,), (d,), lambda o: o[0])]
    for op, args, wrt, first in cases:
        want = first(op(*args))
        got = first(kernels.DIRECT[op](*args))
        assert torch.equal(got, want)
        for x, y in zip(torch.autograd.grad(got, wrt, g), torch.autograd.grad(want, wrt, g)):
            assert torch.equal(x, y)


def test_operators_apply_under_autograd_and_in_programs_compiled_for_the_cpu_only(monkeypatch):
    """Compiled programs call the operators on the CPU (Inductor's bool-mask stores are slow there); on other
    devices they leave the decomposed rules to Inductor's fusion."""
    cpu, meta = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True, device="meta")
    assert kernels.applies(cpu) and kernels.applies(meta)
    assert not kernels.applies(torch.ones(3))  # no graph to differentiate
    with torch.no_grad():
        assert not kernels.applies(cpu)
    monkeypatch.setattr(kernels, "compiling", lambda: True)  # a capture for engine="compiled"
    assert kernels.applies(cpu) and not kernels.applies(meta)
