"""``jvpreg.jvp`` inside ``torch.func`` transforms (grad, vjp, jacrev, jvp) and forward-mode AD: exact, whichever
engine is asked for.

A transform wraps its tensors (forward AD makes dual ones), which a recorded program cannot hold, and jvpreg's
operators have neither functorch support nor forward-mode formulas: inside one, every engine runs the clone forward
eagerly (``engine="captured"``/``"compiled"`` say so by a warning; ``"auto"`` promised no program), also when a
program of the same call signature was recorded outside before. The references: ``torch.func`` of ``torch.func.jvp``
in float64 (forward AD inside reverse mode; math attention; LayerNorm written in primitive ops, since torch's own
second-order derivative of its forward-AD formula is wrong: pytorch/pytorch#196700, and 12.7 against 41.3 by central
differences here, where jvpreg's agrees), or, for train-mode BatchNorm, whose buffers ``torch.func`` cannot mutate,
central differences of the exact JVP computed by forward-mode AD.
"""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad as fwAD
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.clone import JVPCaptureWarning
from jvpreg.clone.program import capture

D = torch.float64


class CompositeLayerNorm(nn.Module):
    """``nn.LayerNorm``'s function in primitive ops (the references' LayerNorm, with the same weight and bias)."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.weight, self.bias, self.eps = norm.weight, norm.bias, norm.eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class Attention(nn.Module):
    """LayerNorm, a packed q/k/v projection (its value blocks are views into a larger tensor), SDPA, GELU."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return nn.functional.gelu(self.out(nn.functional.scaled_dot_product_attention(q, k, v)))


class GRUHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(4, 6, batch_first=True), nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


MODELS = {
    "mlp-tanh": (lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), (4, 8)),
    "cnn-eval-batchnorm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                                                 nn.SiLU(), nn.Flatten(), nn.Linear(16, 3)).eval(), (3, 2, 6, 6)),
    "attention": (Attention, (2, 5, 8)),
    "gru": (GRUHead, (3, 5, 4)),
}


def _model(name):
    torch.manual_seed(0)
    build, shape = MODELS[name]
    model = build().to(D)
    x, u = torch.randn(shape, dtype=D), torch.randn(shape, dtype=D)
    return model, x, u


def _penalty(model, u, engine):
    return lambda a: jvpreg.jvp(model, (a,), (u,), engine=engine)[1].pow(2).sum()


def _reference(model):
    """``model`` with its LayerNorms in primitive ops (shared parameters)."""
    ref = copy.copy(model)
    if isinstance(model, Attention):
        ref.norm = CompositeLayerNorm(model.norm)
    return ref


def _reference_penalty(model, u):
    ref = _reference(model)
    return lambda a: torch.func.jvp(ref, (a,), (u,))[1].pow(2).sum()


def _transformed(transform, f, x):
    """``transform`` of the scalar function ``f`` at ``x``, as a tensor of ``x``'s shape."""
    if transform == "grad":
        return torch.func.grad(f)(x)
    if transform == "vjp":
        value, pullback = torch.func.vjp(f, x)
        return pullback(torch.ones_like(value))[0]
    return torch.func.jacrev(f)(x)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
@pytest.mark.parametrize("engine", ["eager", pytest.param("auto", marks=pytest.mark.slow), "captured"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("attention", "gru") else n
                                  for n in MODELS])
def test_gradient_of_a_jvp_penalty_inside_torch_func(name, engine, transform):
    """The gradient w.r.t. the input of ``|J u|^2`` through each transform equals torch.func's of torch.func.jvp; a
    program recorded before (two calls outside: ``"auto"`` records on the second) does not replay inside."""
    model, x, u = _model(name)
    with sdpa_kernel(SDPBackend.MATH):
        want = _transformed(transform, _reference_penalty(model, u), x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPCaptureWarning)
        for _ in range(2):
            jvpreg.jvp(model, (x,), (u,), engine=engine)
        got = [_transformed(transform, _penalty(model, u, engine), x) for _ in range(2)]
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12 * float(want.detach().abs().max()))


def test_jacobian_of_the_jvp_inside_jacrev():
    """A vector-valued function of the JVP: ``jacrev`` of ``x -> J(x) u`` (the derivative of the JVP along x)."""
    model, x, u = _model("mlp-tanh")
    got = torch.func.jacrev(lambda a: jvpreg.jvp(model, (a,), (u,), engine="auto")[1])(x)
    want = torch.func.jacrev(lambda a: torch.func.jvp(model, (a,), (u,))[1])(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_an_asked_for_program_inside_a_transform_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(capture, "_WARNED", set())  # said once per process: not yet in this test
    model, x, u = _model("mlp-tanh")
    programs = len(capture.programs(model))
    with pytest.warns(JVPCaptureWarning, match="inside a torch.func transform"):
        torch.func.grad(_penalty(model, u, "captured"))(x)
    assert len(capture.programs(model)) == programs, "a program was recorded from wrapped tensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error", JVPCaptureWarning)
        torch.func.grad(_penalty(model, u, "captured"))(x)  # said once
        torch.func.grad(_penalty(model, u, "auto"))(x)      # "auto": no program promised, nothing to say


def test_parameter_gradients_through_functional_call_match_torch_func():
    """The JAX-style step: ``torch.func.grad`` w.r.t. a parameter dict of a penalty whose forward is
    ``functional_call`` (attention, LayerNorm's written-out operator replaced by its primitive-op form inside)."""
    model, x, u = _model("attention")
    params = {k: p.detach().clone() for k, p in model.named_parameters()}

    def penalty(jvp, net):
        return lambda p: jvp(lambda z: functional_call(net, p, (z,)), (x,), (u,))[1].pow(2).sum()

    got = torch.func.grad(penalty(jvpreg.jvp, model))(params)
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.func.grad(penalty(torch.func.jvp, _reference(model)))(params)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12 * float(want[k].abs().max()), msg=k)


def test_layer_norm_second_order_agrees_with_central_differences():
    """Where torch.func is wrong (pytorch/pytorch#196700: ``grad`` of ``torch.func.jvp`` through ``nn.LayerNorm``),
    jvpreg's gradient of ``|J u|^2`` is the derivative central differences give."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(8).to(D)
    x, u, v = (torch.randn(2, 5, 8, dtype=D) for _ in range(3))
    penalty = _penalty(norm, u, "auto")
    got = (torch.func.grad(penalty)(x) * v).sum()
    h = 1e-6
    torch.testing.assert_close(got, (penalty(x + h * v) - penalty(x - h * v)) / (2 * h), rtol=1e-7, atol=0)


def test_jvp_params_inside_torch_func_grad():
    """``jvpreg.jvp_params`` (a direction in a layer's weight) differentiated w.r.t. the input by torch.func.grad."""
    model, x, _ = _model("mlp-tanh")
    w = torch.randn_like(model[0].weight)
    got = torch.func.grad(lambda a: jvpreg.jvp_params(model, (a,), {"0.weight": w})[1].pow(2).sum())(x)

    def reference(a):
        params = dict(model.named_parameters())
        return torch.func.jvp(lambda v: functional_call(model, {**params, "0.weight": v}, (a,)),
                              (params["0.weight"].detach(),), (w,))[1].pow(2).sum()

    torch.testing.assert_close(got, torch.func.grad(reference)(x), rtol=1e-10, atol=1e-13)


def test_train_mode_batchnorm_with_its_buffers_passed_in():
    """Train-mode BatchNorm under ``torch.func.grad``: with its buffers passed to ``functional_call`` (torch.func
    cannot mutate a captured buffer) the parameter gradient of the penalty matches central differences of the exact
    penalty (forward-mode AD), and the running statistics are updated once, from the primal rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.SiLU(), nn.Flatten(), nn.Linear(64, 3)).to(D)
    x, u = torch.randn(3, 2, 6, 6, dtype=D), torch.randn(3, 2, 6, 6, dtype=D)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    buffers = {k: b.clone() for k, b in model.named_buffers()}

    def penalty(p, b):
        return jvpreg.jvp(lambda z: functional_call(model, (p, b), (z,)), (x,), (u,))[1].pow(2).sum()

    got = torch.func.grad(penalty)(params, buffers)  # buffers passed in: the transform lets them be written
    plain = copy.deepcopy(model)
    plain(x)
    torch.testing.assert_close(buffers["1.running_mean"], plain[1].running_mean, rtol=0, atol=0)
    torch.testing.assert_close(buffers["1.running_var"], plain[1].running_var, rtol=0, atol=0)

    def exact(p):  # |J u|^2 by forward-mode AD on a copy (train mode: batch statistics)
        m = copy.deepcopy(model)
        with torch.no_grad():
            for k, v in p.items():
                m.get_parameter(k).copy_(v)
        with fwAD.dual_level():
            return fwAD.unpack_dual(m(fwAD.make_dual(x, u))).tangent.pow(2).sum()

    torch.manual_seed(1)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    h = 1e-6
    fd = (exact({k: p + h * v[k] for k, p in params.items()})
          - exact({k: p - h * v[k] for k, p in params.items()})) / (2 * h)
    directional = sum((got[k] * v[k]).sum() for k in params)
    torch.testing.assert_close(directional, fd, rtol=1e-6, atol=0)


@pytest.mark.parametrize("engine", ["eager", pytest.param("auto", marks=pytest.mark.slow), "captured"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("attention", "gru") else n
                                  for n in MODELS])
def test_directional_derivative_of_the_jvp_by_forward_mode(name, engine):
    """``d/dt J(x + t v) u`` by ``torch.func.jvp`` over ``jvpreg.jvp`` and by forward-mode AD's dual tensors equals
    torch.func's nested JVP (LayerNorm in primitive ops), also where a program was recorded outside first."""
    model, x, u = _model(name)
    v = torch.randn_like(x)
    ref = _reference(model)
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.func.jvp(lambda a: torch.func.jvp(ref, (a,), (u,))[1], (x,), (v,))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPCaptureWarning)
        for _ in range(2):
            jvpreg.jvp(model, (x,), (u,), engine=engine)
        got = torch.func.jvp(lambda a: jvpreg.jvp(model, (a,), (u,), engine=engine)[1], (x,), (v,))[1]
        with fwAD.dual_level():
            dual = fwAD.unpack_dual(jvpreg.jvp(model, (fwAD.make_dual(x, v),), (u,), engine=engine)[1]).tangent
    for g in (got, dual):
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))


def test_train_mode_batchnorm_under_forward_mode_ad():
    """Train-mode BatchNorm (jvpreg's operator on the CPU, which has no forward-mode formula) with a dual input:
    the derivative of the JVP along ``v`` equals central differences of jvpreg's JVP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.SiLU(), nn.Flatten(), nn.Linear(64, 3)).to(D)
    x, u, v = (torch.randn(3, 2, 6, 6, dtype=D) for _ in range(3))
    with fwAD.dual_level():
        got = fwAD.unpack_dual(jvpreg.jvp(model, (fwAD.make_dual(x, v),), (u,))[1]).tangent
    h = 1e-5
    fd = (jvpreg.jvp(model, (x + h * v,), (u,))[1] - jvpreg.jvp(model, (x - h * v,), (u,))[1]) / (2 * h)
    torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-8 * float(fd.abs().max()))


STORAGE_READS = {  # rules that read a tensor's storage, which a transform's wrapper does not have
    "t_": lambda a: a.tanh().mul(2).t_().sin(),
    "unsqueeze_": lambda a: a.tanh().mul(2).unsqueeze_(0).sin(),
    "as_strided_scatter": lambda a: torch.as_strided_scatter(a.tanh(), a.sin()[:2, :2], (2, 2), (4, 1), 1).cos(),
}


@pytest.mark.parametrize("name", list(STORAGE_READS))
def test_rules_that_read_storage_run_inside_torch_func_grad(name):
    """In-place views and ``as_strided_scatter`` inside ``torch.func.grad`` (they read the storage, which crashed on
    its wrappers): the gradient equals plain autograd's through the same JVP (torch.func itself refuses these)."""
    torch.manual_seed(0)
    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)

    def penalty(a):
        return jvpreg.jvp(STORAGE_READS[name], (a,), (u,))[1].pow(2).sum()

    got = torch.func.grad(penalty)(x)
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(penalty(leaf), leaf)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
