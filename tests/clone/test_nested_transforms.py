"""``torch.func`` transforms inside a model's forward (:mod:`jvpreg.clone.eager.nested_transforms`): exact or a clear error.

functorch wraps a transform's inputs in C++, where a clone batch lost its subclass: a per-sample ``vmap`` gave a JVP
0.59 off and an input-gradient feature 0.61 off, silently. References: ``torch.func.jvp`` in float64.
"""
import warnings

import pytest
import torch
from torch import nn

import jvpreg
from jvpreg.clone import JVPCaptureWarning, JVPFallbackWarning, UnsupportedOpError

D = torch.float64


class PerSampleVmap(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.vmap(lambda r: torch.tanh(self.lin(r)) * r.relu())(x)


class InputGradientFeature(nn.Module):
    """``grad_x f(x) * x`` (score-like features), by ``torch.func.grad`` per sample under ``vmap``, or whole."""

    def __init__(self, per_sample: bool):
        super().__init__()
        self.lin, self.per_sample = nn.Linear(4, 1), per_sample

    def energy(self, r):
        return torch.tanh(self.lin(r)).sum()

    def forward(self, x):
        g = torch.vmap(torch.func.grad(self.energy))(x) if self.per_sample else torch.func.grad(self.energy)(x)
        return g * x


class ValueAndGrad(InputGradientFeature):
    def forward(self, x):
        g, value = torch.func.grad_and_value(self.energy)(x)
        return g * value


MODELS = {"vmap": PerSampleVmap, "grad": lambda: InputGradientFeature(False),
          "vmap-of-grad": lambda: InputGradientFeature(True), "grad_and_value": lambda: ValueAndGrad(False)}


@pytest.mark.parametrize("engine", ["eager", "auto", "captured"])
@pytest.mark.parametrize("name", list(MODELS))
def test_vmap_and_grad_inside_a_forward_are_exact(name, engine):
    torch.manual_seed(0)
    model = MODELS[name]().to(D)
    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    want = torch.func.jvp(model, (x,), (u,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPFallbackWarning)
        warnings.simplefilter("ignore", JVPCaptureWarning)
        for _ in range(3):
            out, tangent = jvpreg.jvp(model, (x,), (u,), engine=engine)
            torch.testing.assert_close(out, want[0], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(tangent, want[1], rtol=1e-10, atol=1e-13)


def test_the_gradient_of_a_penalty_through_a_vmapped_forward():
    torch.manual_seed(0)
    model = PerSampleVmap().to(D)
    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPFallbackWarning)
        got = torch.autograd.grad(jvpreg.jvp(model, (x,), (u,))[1].pow(2).sum(), list(model.parameters()))
    params = dict(model.named_parameters())
    want = torch.func.grad(lambda p: torch.func.jvp(lambda z: torch.func.functional_call(model, p, (z,)), (x,),
                                                    (u,))[1].pow(2).sum())({k: v.detach() for k, v in params.items()})
    for g, (k, w) in zip(got, want.items()):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13, msg=k)


@pytest.mark.parametrize("transform", ["jacrev", "vjp", "jvp", "jacfwd"])
def test_other_transforms_on_a_clone_batch_raise_a_clear_error(transform):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(D)

    def f(r):
        return torch.tanh(lin(r))

    calls = {"jacrev": lambda x: torch.func.jacrev(f)(x).sum(-1),
             "vjp": lambda x: torch.func.vjp(f, x)[1](torch.ones_like(x))[0],
             "jvp": lambda x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
             "jacfwd": lambda x: torch.func.jacfwd(f)(x).sum(-1)}
    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    with pytest.raises(UnsupportedOpError, match="torch.func transform .* received a clone batch"):
        jvpreg.jvp(calls[transform], (x,), (u,))


class ClosureVmap(nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(3, 4, 4, dtype=D))

    def forward(self, x):
        return torch.vmap(lambda w: torch.tanh(x @ w))(self.weights).sum(0)


def test_a_clone_batch_captured_by_a_transformed_closure_raises():
    """``vmap(lambda w: tanh(x @ w))(W)``: the clone batch ``x`` reaches the transform by closure (10.3 off before)."""
    torch.manual_seed(0)
    x, u = torch.randn(5, 4, dtype=D), torch.randn(5, 4, dtype=D)
    with pytest.raises(UnsupportedOpError, match="captured it by closure, not as an argument"):
        jvpreg.jvp(ClosureVmap(), (x,), (u,), engine="eager")


def test_a_parameter_direction_captured_by_a_vmapped_closure_raises():
    """``jvp_params`` swaps the weight for a clone, which the per-sample function reads by closure."""
    torch.manual_seed(0)
    model = PerSampleVmap().to(D)
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(UnsupportedOpError, match="captured it by closure"):
        jvpreg.jvp_params(model, (x,), {"lin.weight": torch.randn_like(model.lin.weight)}, engine="eager")


def test_jvp_inside_torch_func_grad_is_not_mistaken_for_a_closure():
    """The level check counts from where the clone forward began: a clone forward inside ``torch.func.grad`` runs."""
    torch.manual_seed(0)
    model = PerSampleVmap().to(D)
    x, u = torch.randn(3, 4, dtype=D), torch.randn(3, 4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JVPFallbackWarning)
        got = torch.func.grad(lambda a: jvpreg.jvp(model, (a,), (u,), engine="eager")[1].pow(2).sum())(x)
    want = torch.func.grad(lambda a: torch.func.jvp(model, (a,), (u,))[1].pow(2).sum())(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
