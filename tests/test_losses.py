"""Tests for jvpreg.losses: every penalty against a float64 forward-mode reference, Stack, errors.

References use ``torch.autograd.forward_ad`` (reverse-over-forward) in float64 with the SAME
directions (drawn by a twin penalty with the same seed). PyTorch's native batch_norm forward-AD
tangent is not correctly differentiable in reverse mode (wrong parameter gradients, see
``test_native_batchnorm_forward_ad_is_not_a_valid_reference``), so the references replace every
BatchNorm by the same normalisation written with elementary ops.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

from jvpreg.losses import (JacobianFrobenius, JacobianSpectralNorm, JVPConstraint, JVPPenalty, ParameterSensitivity,
                           PenaltyContext, Stack, TangentProp, image_tangents, regularized_forward)

F64 = torch.float64


# --------------------------------------------------------------------------- reference machinery


class ManualBN(nn.Module):
    """Train-mode BatchNorm from elementary ops (shares the wrapped module's parameters)."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        super().__init__()
        self.bn = bn

    def forward(self, h):
        dims = [0] + list(range(2, h.dim()))
        mean = h.mean(dims, keepdim=True)
        var = h.var(dims, unbiased=False, keepdim=True)
        shape = [1, -1] + [1] * (h.dim() - 2)
        return (h - mean) / torch.sqrt(var + self.bn.eps) * self.bn.weight.view(shape) + self.bn.bias.view(shape)


def reference_model(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).to(F64)
    for mod in list(ref.modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and child.training:
                setattr(mod, cname, ManualBN(child))
    return ref


def ref_name(name: str) -> str:
    return name.replace(".bn.", ".")


def ref_jvps(ref: nn.Module, x, U=None, P=None):
    """``(y, [J u_j + J_W U_j])`` by forward-mode AD, differentiable w.r.t. the parameters."""
    k = U.shape[0] if U is not None else next(iter(P.values())).shape[0]
    named = {ref_name(n): (n, p) for n, p in ref.named_parameters()}
    tangents = []
    for j in range(k):
        with fwAD.dual_level():
            xin = fwAD.make_dual(x, U[j]) if U is not None else x
            swapped = {named[n][0]: fwAD.make_dual(named[n][1], u[j]) for n, u in (P or {}).items()}
            out = torch.func.functional_call(ref, swapped, (xin,)) if swapped else ref(xin)
            y, t = fwAD.unpack_dual(out)
            tangents.append(t if t is not None else torch.zeros_like(y))
    return y, tangents


def grads(model: nn.Module):
    return {ref_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(got, want, rtol=1e-9, atol=1e-11):
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n].to(F64), want[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def mlp_tanh():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3))


def cnn_bn():
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 3), nn.Tanh(),
                         nn.Flatten(), nn.Linear(8, 3))


def mlp_bn():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 10), nn.BatchNorm1d(10), nn.SiLU(), nn.Dropout(0.0),
                         nn.Linear(10, 3))


MODELS = {"mlp_tanh": mlp_tanh, "cnn_bn": cnn_bn, "mlp_bn": mlp_bn}


def setup_case(model_name, seed=0, batch=6):
    torch.manual_seed(seed)
    model = MODELS[model_name]().to(F64).train()
    x = torch.randn(batch, 1, 4, 4, dtype=F64)
    y = torch.randint(0, 3, (batch,))
    return model, x, y


def twin_directions(pen: JVPPenalty, x, model=None, rows=None):
    twin = copy.deepcopy(pen)
    ctx = PenaltyContext(x=x, model=model, rows=rows or x.shape[0])
    return twin.directions(x, ctx), twin.param_directions(model, ctx) if model is not None else None


# --------------------------------------------------------------------------- settings

LAM = 0.3

# Each setting: the penalty (seeded) and the reference penalty as a function of (tangents, x, U, P).
SETTINGS = [
    dict(id="frobenius-gauss-k2", make=lambda: JacobianFrobenius(2, seed=1),
         ref=lambda ts, x, U, P: sum(t.pow(2).sum() for t in ts) / (len(ts) * x.shape[0])),
    dict(id="frobenius-rademacher", make=lambda: JacobianFrobenius(1, "rademacher", seed=2),
         ref=lambda ts, x, U, P: ts[0].pow(2).sum() / x.shape[0]),
    dict(id="frobenius-hoffman", make=lambda: JacobianFrobenius(3, normalize="hoffman", seed=3),
         ref=lambda ts, x, U, P: 0.5 * sum(t.pow(2).sum() for t in ts) / (3 * x.shape[0])),
    dict(id="constraint-zero", make=lambda: JVPConstraint(lambda x, y: torch.ones_like(x)),
         ref=lambda ts, x, U, P: ts[0].pow(2).sum() / x.shape[0]),
    dict(id="constraint-nonneg", make=lambda: JVPConstraint(torch.ones(1, 4, 4), kind="nonneg", margin=0.1, power=2),
         ref=lambda ts, x, U, P: F.relu(0.1 - ts[0]).pow(2).sum() / x.shape[0]),
    dict(id="constraint-nonpos", make=lambda: JVPConstraint(torch.ones(1, 4, 4), kind="nonpos"),
         ref=lambda ts, x, U, P: F.relu(ts[0]).sum() / x.shape[0]),
    dict(id="constraint-target", make=lambda: JVPConstraint(torch.ones(16).reshape(1, 4, 4), kind="target",
                                                            target=torch.tensor([0.5, -0.5, 0.0])),
         ref=lambda ts, x, U, P: (ts[0] - torch.tensor([0.5, -0.5, 0.0], dtype=F64)).pow(2).sum() / x.shape[0]),
    dict(id="constraint-lipschitz", make=lambda: JVPConstraint(lambda x, y: x.flip(0), kind="lipschitz", lipschitz=0.05),
         ref=lambda ts, x, U, P: F.relu(ts[0].flatten(1).norm(dim=1) / U[0].flatten(1).norm(dim=1) - 0.05).sum()
         / x.shape[0]),
    dict(id="tangent-prop", make=lambda: TangentProp(),
         ref=lambda ts, x, U, P: sum(t.pow(2).sum() for t in ts) / x.shape[0]),
    dict(id="tangent-prop-sobel", make=lambda: TangentProp(("rotate", "scale"), gradient="sobel"),
         ref=lambda ts, x, U, P: sum(t.pow(2).sum() for t in ts) / x.shape[0]),
    dict(id="sensitivity", make=lambda: ParameterSensitivity(params=("*.weight",), n_projections=2, seed=4),
         ref=lambda ts, x, U, P: sum(t.pow(2).sum() for t in ts) / (2 * x.shape[0])),
    dict(id="spectral", make=lambda: JacobianSpectralNorm(seed=5),
         ref=lambda ts, x, U, P: ts[0].pow(2).flatten(1).sum(1).mean()),
]


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("setting", SETTINGS, ids=[s["id"] for s in SETTINGS])
def test_penalty_value_and_gradient_match_float64_reference(setting, model_name):
    model, x, y = setup_case(model_name)
    pen = setting["make"]()  # "*.weight" includes the BatchNorm weights (clone-BN gamma directions)
    U, P = twin_directions(pen, x, model)
    ref = reference_model(model)

    out, value = pen(model, x)
    (F.cross_entropy(out, y) + LAM * value).backward()

    y_ref, ts = ref_jvps(ref, x, U.detach() if U is not None else None, P)
    value_ref = setting["ref"](ts, x, U, P)
    (F.cross_entropy(y_ref, y) + LAM * value_ref).backward()

    torch.testing.assert_close(out, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(value, value_ref, rtol=1e-9, atol=1e-12)
    assert_close_grads(grads(model), grads(ref))


def test_batchnorm_weight_direction_gradient_matches_reference():
    """A bias before train-mode BatchNorm gets exactly zero gradient, also through a gamma direction."""
    model, x, y = setup_case("cnn_bn")
    pen = ParameterSensitivity(params=("1.weight",), seed=4)
    U, P = twin_directions(pen, x, model)
    ref = reference_model(model)
    out, value = pen(model, x)
    (F.cross_entropy(out, y) + LAM * value).backward()
    y_ref, ts = ref_jvps(ref, x, None, P)
    (F.cross_entropy(y_ref, y) + LAM * ts[0].pow(2).sum() / x.shape[0]).backward()
    assert_close_grads(grads(model), grads(ref))
    assert model[0].bias.grad.abs().max() < 1e-12


def test_float32_penalty_gradient_close_to_float64():
    model, x, y = setup_case("cnn_bn")
    pen = JacobianFrobenius(2, seed=0)
    m32 = copy.deepcopy(model).float()
    out, v = copy.deepcopy(pen)(m32, x.float())
    (F.cross_entropy(out, y) + LAM * v).backward()
    out64, v64 = pen(model, x)
    (F.cross_entropy(out64, y) + LAM * v64).backward()
    torch.testing.assert_close(v.double(), v64, rtol=1e-5, atol=1e-7)
    for (n, p32), p64 in zip(m32.named_parameters(), model.parameters()):
        torch.testing.assert_close(p32.grad.double(), p64.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_native_batchnorm_forward_ad_is_not_a_valid_reference():
    """Why the references use ManualBN: reverse-over-forward through F.batch_norm gives a wrong gradient.

    Upstream PyTorch issue (repro): the bias before a train-mode BatchNorm cannot change the output,
    so every gradient w.r.t. it is zero; through the native op's forward-AD tangent it is not.
    """
    torch.manual_seed(0)
    x, u = torch.randn(6, 3, dtype=F64), torch.randn(6, 3, dtype=F64)
    b = torch.zeros(3, dtype=F64, requires_grad=True)
    results = {}
    for name, f in (("native", lambda h: F.batch_norm(h, None, None, training=True)),
                    ("manual", lambda h: (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5))):
        with fwAD.dual_level():
            t = fwAD.unpack_dual(f(fwAD.make_dual(x, u) + b)).tangent
            loss = t.pow(3).sum()
        results[name] = torch.autograd.grad(loss, b)[0]
    assert results["manual"].abs().max() < 1e-12
    assert results["native"].abs().max() > 1e-3  # if this fails, PyTorch fixed it: native refs become valid


def test_primal_output_and_running_stats_equal_plain_forward():
    model, x, _ = setup_case("cnn_bn")
    plain = copy.deepcopy(model)
    y_plain = plain(x)
    out, _ = Stack([JacobianFrobenius(2), TangentProp(), ParameterSensitivity("0.weight")])(model, x)
    torch.testing.assert_close(out, y_plain, rtol=0, atol=1e-13)
    for b1, b2 in zip(model.buffers(), plain.buffers()):
        torch.testing.assert_close(b1, b2, rtol=0, atol=1e-13)
    assert int(model[1].num_batches_tracked) == 1


def test_dropout_uses_one_mask_for_every_block():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5)).train()
    x = torch.rand(8, 20) + 0.5
    u = torch.randn(8, 20)
    pen = JVPConstraint(u, kind="target", target=0.0)
    seen = {}

    class Spy(JVPConstraint):
        def penalty(self, jvp, context):
            seen["jvp"], seen["out"] = jvp.detach(), context.output.detach()
            return super().penalty(jvp, context)

    spy = Spy(u, kind="target", target=0.0)
    out, _ = spy(model, x)
    mask = out / x * 0.5  # 1 where kept, 0 where dropped
    assert set(mask.unique().tolist()) <= {0.0, 1.0} and 0 < mask.mean() < 1
    torch.testing.assert_close(seen["jvp"][0], mask * u / 0.5)
    del pen


def test_stack_runs_one_forward_and_matches_separate_penalties():
    model, x, _ = setup_case("mlp_tanh")
    calls = []
    model[1].register_forward_hook(lambda m, a, o: calls.append(a[0].as_subclass(torch.Tensor).shape))
    members = [JacobianFrobenius(2, seed=0), TangentProp(("rotate",)), ParameterSensitivity("*weight", seed=1)]
    stack = Stack(copy.deepcopy(members), weights=[1.0, 0.5, 2.0])
    out, total, parts = stack(model, x, return_parts=True)
    assert len(calls) == 1 and calls[0][0] == 1 + 2 + 1 + 1  # (1 + sum k) blocks in one call
    separate = [m(model, x)[1].detach().item() for m in members]
    assert list(parts) == ["jacobian_frobenius", "tangent_prop", "parameter_sensitivity"]
    for got, want in zip(parts.values(), separate):
        assert got.detach().item() == pytest.approx(want, rel=1e-9)
    assert total.detach().item() == pytest.approx(separate[0] + 0.5 * separate[1] + 2.0 * separate[2], rel=1e-9)


def test_stack_duplicate_names_get_suffixes_and_nesting_flattens():
    model, x, _ = setup_case("mlp_tanh")
    inner = Stack([JacobianFrobenius(seed=0)], weights=[2.0])
    stack = Stack([inner, JacobianFrobenius(seed=0)])
    assert [w for _, w, _ in stack.terms] == [2.0, 1.0]
    _, total, parts = stack(model, x, return_parts=True)
    assert list(parts) == ["jacobian_frobenius", "jacobian_frobenius_1"]
    parts = {k: v.detach().item() for k, v in parts.items()}
    assert total.detach().item() == pytest.approx(2 * parts["jacobian_frobenius"] + parts["jacobian_frobenius_1"])


def test_batch_fraction_scores_first_rows_with_zero_tangents_elsewhere():
    model, x, y = setup_case("mlp_tanh", batch=8)
    pen = JacobianFrobenius(1, seed=0)
    U, _ = twin_directions(pen, x)
    out, value = regularized_forward(model, x, pen, batch_fraction=0.3)  # m = ceil(2.4) = 3
    _, ts = ref_jvps(reference_model(model), x, U)
    torch.testing.assert_close(value, ts[0][:3].pow(2).sum() / 3, rtol=1e-10, atol=0)


def test_hoffman_normalisation_matches_their_estimator_in_expectation():
    """Same expectation as facebookresearch/jacobian_regularizer's JacobianReg: (1/2) mean_b ||J_b||_F^2."""
    torch.manual_seed(0)
    model = mlp_tanh().to(F64)
    x = torch.randn(4, 1, 4, 4, dtype=F64)
    jac = torch.func.vmap(torch.func.jacrev(lambda z: model(z[None])[0]))(x).detach()
    exact = 0.5 * jac.pow(2).sum() / x.shape[0]
    ours = JacobianFrobenius(4000, normalize="hoffman", seed=0)
    U, _ = twin_directions(ours, x)
    torch.testing.assert_close(U.flatten(2).norm(dim=-1), torch.full((4000, 4), 4.0, dtype=F64))  # sqrt(D) = 4
    _, value = ours(model, x)
    # their estimator: output-space unit vectors v per sample, R = (1/2) C ||v^T J||^2 / (nproj B)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4000, 4, 3, generator=g, dtype=F64)
    v = v / v.norm(dim=-1, keepdim=True)
    theirs = 0.5 * 3 * torch.einsum("nbc,bcd->nbd", v, jac.flatten(2)).pow(2).sum() / (4000 * 4)
    assert value.detach().item() == pytest.approx(float(exact), rel=0.05)
    assert float(theirs) == pytest.approx(float(exact), rel=0.05)


def test_frobenius_is_unbiased_for_the_jacobian_norm():
    torch.manual_seed(0)
    model = mlp_tanh().to(F64)
    x = torch.randn(3, 1, 4, 4, dtype=F64)
    jac = torch.func.vmap(torch.func.jacrev(lambda z: model(z[None])[0]))(x).detach()
    _, value = JacobianFrobenius(3000, "rademacher", seed=0)(model, x)
    assert value.detach().item() == pytest.approx(float(jac.detach().pow(2).sum() / 3), rel=0.05)


def _smooth_image(h, w, dx=0.0, dy=0.0, theta=0.0, log_scale=0.0):
    """Anisotropic Gaussian blob sampled at I(p + t v(p)) for each transformation, analytically."""
    ys, xs = torch.meshgrid(torch.arange(h, dtype=F64) - (h - 1) / 2, torch.arange(w, dtype=F64) - (w - 1) / 2,
                            indexing="ij")
    c, s = math.cos(theta), math.sin(theta)
    px, py = c * xs - s * ys, s * xs + c * ys  # rotation by theta: v = (-y, x) at t = 0
    px, py = px * math.exp(log_scale) + dx, py * math.exp(log_scale) + dy  # scale: v = (x, y); shifts
    return torch.exp(-((px - 1.5) ** 2) / 60.0 - ((py + 1.0) ** 2) / 40.0)


@pytest.mark.parametrize("transform,kw", [("translate_x", "dx"), ("translate_y", "dy"), ("rotate", "theta"),
                                          ("scale", "log_scale")])
def test_tangent_vectors_match_finite_differences(transform, kw):
    img = _smooth_image(24, 24)[None, None]
    t = 1e-4
    fd = (_smooth_image(24, 24, **{kw: t}) - _smooth_image(24, 24, **{kw: -t})) / (2 * t)
    for method in ("central", "sobel"):
        tan = image_tangents(img, (transform,), method)[0, 0, 0]
        inner = (slice(3, -3), slice(3, -3))
        err = (tan[inner] - fd[inner]).norm() / fd[inner].norm()
        assert err < (0.03 if method == "central" else 0.05), (method, float(err))


@pytest.mark.slow
def test_spectral_power_iteration_converges_to_top_singular_value():
    torch.manual_seed(0)
    model = mlp_tanh().to(F64)
    x = torch.randn(3, 1, 4, 4, dtype=F64)
    jac = torch.func.vmap(torch.func.jacrev(lambda z: model(z[None])[0]))(x).flatten(2).detach()
    sigma2 = torch.linalg.matrix_norm(jac, ord=2).pow(2).mean()
    pen = JacobianSpectralNorm(seed=0)
    values = []
    for _ in range(60):
        _, v = pen(model, x)
        v.backward()  # the backward advances the vectors (one power iteration per step)
        values.append(v.detach().item())
    assert values[0] < values[-1] <= float(sigma2) * (1 + 1e-9)
    assert values[-1] == pytest.approx(float(sigma2), rel=1e-6)
    pen2 = JacobianSpectralNorm(n_iter=40, seed=0)  # extra iterations inside one call
    _, v2 = pen2(model, x)
    assert v2.detach().item() == pytest.approx(float(sigma2), rel=1e-4)


def test_spectral_extra_iterations_leave_batchnorm_buffers_alone():
    model, x, _ = setup_case("cnn_bn")
    plain = copy.deepcopy(model)
    plain(x)
    JacobianSpectralNorm(n_iter=3, seed=0)(model, x)
    for b1, b2 in zip(model.buffers(), plain.buffers()):
        torch.testing.assert_close(b1, b2, rtol=0, atol=1e-13)


def test_spectral_vectors_follow_batch_shape_and_round_trip():
    model = mlp_tanh()
    pen = JacobianSpectralNorm(seed=0)
    pen(model, torch.randn(5, 1, 4, 4))[1].backward()
    v5 = pen.vectors.clone()
    pen(model, torch.randn(3, 1, 4, 4))[1].backward()  # smaller batch: leading rows, others kept
    assert pen.vectors.shape == (5, 1, 4, 4)
    torch.testing.assert_close(pen.vectors[3:], v5[3:])
    pen(model, torch.randn(7, 1, 4, 4))  # larger batch: fresh rows appended
    assert pen.vectors.shape == (7, 1, 4, 4)
    torch.testing.assert_close(pen.vectors.flatten(1).norm(dim=1), torch.ones(7))
    model2 = nn.Sequential(nn.Flatten(), nn.Linear(8, 3))
    pen(model2, torch.randn(2, 8))  # new sample shape: reinitialised
    assert pen.vectors.shape == (2, 8)
    fresh = JacobianSpectralNorm(seed=0)
    fresh.load_state_dict(pen.state_dict())
    torch.testing.assert_close(fresh.vectors, pen.vectors)
    torch.testing.assert_close(torch.randn(3, generator=fresh.generator(torch.device("cpu"))),
                               torch.randn(3, generator=pen.generator(torch.device("cpu"))))


def test_seeded_generator_state_round_trips():
    pen = JacobianFrobenius(seed=7)
    x = torch.randn(2, 3)
    pen.directions(x, PenaltyContext(x=x))
    state = copy.deepcopy(pen.state_dict())
    nxt = pen.directions(x, PenaltyContext(x=x))
    other = JacobianFrobenius(seed=7)
    other.load_state_dict(state)
    torch.testing.assert_close(other.directions(x, PenaltyContext(x=x)), nxt)


def test_output_key_selects_a_tensor_of_a_tuple_output():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            h = self.lin(x)
            return {"logits": h, "features": torch.tanh(h)}

    torch.manual_seed(0)
    model, x = Two().to(F64), torch.randn(5, 4, dtype=F64)
    out, value = JacobianFrobenius(seed=0, output_key="logits")(model, x)
    assert set(out) == {"logits", "features"}
    U, _ = twin_directions(JacobianFrobenius(seed=0), x)
    torch.testing.assert_close(value, (U[0] @ model.lin.weight.T).pow(2).sum() / 5)
    with pytest.raises(TypeError, match=r"the model returned a dict; pass output_key="):
        JacobianFrobenius()(model, x)
    with pytest.raises(ValueError, match=r"output_key='nope' does not select an output"):
        JacobianFrobenius(output_key="nope")(model, x)


# --------------------------------------------------------------------------- errors

INIT_ERRORS = [
    (lambda: JacobianFrobenius(0), ValueError, r"JacobianFrobenius\(\.\.\.\): expected n_projections to be an int >= 1, got 0"),
    (lambda: JacobianFrobenius(1.5), TypeError, r"expected n_projections to be an int >= 1, got float 1.5"),
    (lambda: JacobianFrobenius(distribution="uniform"), ValueError,
     r"expected distribution to be one of 'gaussian', 'rademacher'; got 'uniform'"),
    (lambda: JacobianFrobenius(normalize="l2"), ValueError, r"expected normalize to be one of None, 'hoffman'; got 'l2'"),
    (lambda: JacobianFrobenius(seed=-1), ValueError, r"expected seed to be an int >= 0, got -1"),
    (lambda: JacobianFrobenius(name=""), TypeError, r"expected name to be a non-empty str, got ''"),
    (lambda: JacobianFrobenius(output_key=1.0), TypeError, r"expected output_key to be None, an int or a str, got 1.0"),
    (lambda: JVPConstraint(3), TypeError, r"expected direction to be a callable direction\(x, y\) or a tensor, got int"),
    (lambda: JVPConstraint(torch.ones(2), kind="odd"), ValueError,
     r"expected kind to be one of 'zero', 'nonneg', 'nonpos', 'target', 'lipschitz'; got 'odd'"),
    (lambda: JVPConstraint(torch.ones(2), kind="target"), ValueError, r"kind='target' needs target="),
    (lambda: JVPConstraint(torch.ones(2), kind="target", target="a"), TypeError,
     r"expected target to be a number, a tensor or a callable, got str"),
    (lambda: JVPConstraint(torch.ones(2), target=1.0), ValueError,
     r"target is only used with kind='target', got kind='zero'"),
    (lambda: JVPConstraint(torch.ones(2), kind="lipschitz"), ValueError, r"kind='lipschitz' needs lipschitz=L"),
    (lambda: JVPConstraint(torch.ones(2), kind="lipschitz", lipschitz=0), ValueError,
     r"expected lipschitz to be a number in \(0.0, inf\], got 0"),
    (lambda: JVPConstraint(torch.ones(2), lipschitz=1.0), ValueError,
     r"lipschitz is only used with kind='lipschitz', got kind='zero'"),
    (lambda: JVPConstraint(torch.ones(2), margin=-1), ValueError, r"expected margin to be a number in \[0.0, inf\], got -1"),
    (lambda: JVPConstraint(torch.ones(2), power=0), ValueError, r"expected power to be a number in \(0.0, inf\], got 0"),
    (lambda: TangentProp(()), ValueError, r"TangentProp\(\.\.\.\): expected at least one transform"),
    (lambda: TangentProp(("shear",)), ValueError,
     r"expected each transform to be one of 'translate_x', 'translate_y', 'rotate', 'scale'; got 'shear'"),
    (lambda: TangentProp(("rotate", "rotate")), ValueError, r"transforms repeat: \('rotate', 'rotate'\)"),
    (lambda: TangentProp([1]), TypeError, r"expected transforms to be a str or a sequence of str, got \[1\]"),
    (lambda: TangentProp(gradient="scharr"), ValueError, r"expected gradient to be one of 'central', 'sobel'; got 'scharr'"),
    (lambda: ParameterSensitivity(()), ValueError, r"expected at least one parameter name pattern, got an empty sequence"),
    (lambda: ParameterSensitivity(3), TypeError, r"expected params to be a str or a sequence of str patterns, got 3"),
    (lambda: ParameterSensitivity(relative=1), TypeError, r"expected relative to be a bool, got 1"),
    (lambda: ParameterSensitivity(n_projections=0), ValueError, r"expected n_projections to be an int >= 1, got 0"),
    (lambda: JacobianSpectralNorm(n_iter=0), ValueError, r"expected n_iter to be an int >= 1, got 0"),
    (lambda: JacobianSpectralNorm(eps=-1.0), ValueError, r"expected eps to be a number in \[0.0, inf\], got -1.0"),
    (lambda: Stack([]), ValueError, r"Stack\(penalties\): expected a non-empty list of JVPPenalty modules"),
    (lambda: Stack([nn.Linear(2, 2)]), TypeError, r"expected JVPPenalty modules, got Linear at index 0"),
    (lambda: Stack([JacobianFrobenius()], weights=[1.0, 2.0]), ValueError, r"expected 1 weights \(one per penalty\), got 2"),
    (lambda: Stack([JacobianFrobenius()], weights=[-1.0]), ValueError,
     r"expected weights\[0\] to be a number in \[0.0, inf\], got -1.0"),
    (lambda: Stack([JacobianFrobenius()], weights=2.0), TypeError, r"expected weights to be a sequence of 1 numbers"),
    (lambda: Stack([JacobianFrobenius()], batch_fractions=[0.0]), ValueError,
     r"expected batch_fractions\[0\] to be a number in \(0.0, 1.0\], got 0.0"),
]


@pytest.mark.parametrize("make,exc,match", INIT_ERRORS, ids=[f"init-{i}" for i in range(len(INIT_ERRORS))])
def test_init_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_init_does_not_mutate_arguments():
    direction, target, params = torch.ones(4), torch.zeros(3), ["a*", "b*"]
    c = JVPConstraint(direction, kind="target", target=target)
    c.fixed_direction.add_(1)
    c.fixed_target.add_(1)
    ParameterSensitivity(params)
    assert direction.eq(1).all() and target.eq(0).all() and params == ["a*", "b*"]


def test_call_errors():
    model = mlp_tanh()
    x = torch.randn(2, 1, 4, 4)
    with pytest.raises(TypeError, match=r"clone mode needs a floating-point input with a batch dim, got Tensor of "
                                        r"dtype torch.int64"):
        JacobianFrobenius()(model, torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"TangentProp\(name='tangent_prop'\): expected images of shape "
                                         r"\(B, \.\.\., H, W\), got shape \(2, 16\)"):
        TangentProp()(nn.Linear(16, 2), torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"params=\('conv\*',\) match no parameter of Sequential; its parameters are: "
                                         r"1.weight, 1.bias, 3.weight, 3.bias"):
        ParameterSensitivity("conv*")(model, x)
    with pytest.raises(ValueError, match=r"direction has shape \(3,\); expected x's shape \(2, 1, 4, 4\)"):
        JVPConstraint(torch.ones(3))(model, x)
    with pytest.raises(TypeError, match=r"direction\(x, y\) must return a tensor, got list"):
        JVPConstraint(lambda x, y: [1.0])(model, x)
    with pytest.raises(TypeError, match=r"regularized_forward\(model, x, penalties\): expected a JVPPenalty, a Stack "
                                        r"or a non-empty list of JVPPenalty, got str"):
        regularized_forward(model, x, "jacobian")
    with pytest.raises(ValueError, match=r"expected batch_fraction to be a number in \(0.0, 1.0\], got 1.5"):
        regularized_forward(model, x, JacobianFrobenius(), batch_fraction=1.5)
    with pytest.raises(TypeError, match=r"regularized_forward\(model, x, penalties\): expected model to be an "
                                        r"nn.Module, got function"):
        regularized_forward(lambda z: z, x, JacobianFrobenius())
    with pytest.raises(ValueError, match=r"expected the model output to have the batch \(2 rows\) as first dim, "
                                         r"got shape \(\)"):
        JacobianFrobenius()(nn.Sequential(nn.Flatten(0), nn.Linear(32, 1), nn.Flatten(0), _Sum()), x)

    class NoDirections(JVPPenalty):
        def penalty(self, jvp, context):
            return jvp.sum()

    with pytest.raises(ValueError, match=r"NoDirections: directions\(\) and param_directions\(\) both returned None"):
        NoDirections()(model, x)

    class BadShape(NoDirections):
        def directions(self, x, context):
            return torch.ones_like(x)

    with pytest.raises(ValueError, match=r"BadShape.directions\(x, context\) returned shape \(2, 1, 4, 4\), "
                                         r"expected \(k, 2, 1, 4, 4\)"):
        BadShape()(model, x)

    class BadValue(NoDirections):
        def directions(self, x, context):
            return torch.ones_like(x)[None]

        def penalty(self, jvp, context):
            return jvp

    with pytest.raises(TypeError, match=r"BadValue.penalty\(jvp, context\) must return a scalar tensor"):
        BadValue()(model, x)
    with pytest.raises(NotImplementedError, match=r"JVPPenalty must implement penalty\(jvp, context\)"):
        JVPPenalty().penalty(None, None)


class _Sum(nn.Module):
    def forward(self, h):
        return h.sum()


def test_penalty_protocol_errors():
    """Errors for custom penalties that break the directions/param_directions/penalty protocol."""
    from jvpreg.losses import prepare
    from jvpreg.losses.base import select_output

    model = mlp_tanh()
    x = torch.randn(2, 1, 4, 4)

    def custom(directions=None, param_directions=None):
        class Custom(JVPPenalty):
            def directions(self, x, context):
                return directions(x) if directions else None

            def param_directions(self, model, context):
                return param_directions(model) if param_directions else None

            def penalty(self, jvp, context):
                return jvp.pow(2).sum()

        return Custom()

    with pytest.raises(TypeError, match=r"Custom.directions\(x, context\) must return a tensor of shape "
                                        r"\(k, \*x.shape\) or None, got list"):
        custom(lambda x: [x])(model, x)
    with pytest.raises(TypeError, match=r"Custom.param_directions\(model, context\) must return a non-empty dict "
                                        r"name -> \(k, \*p.shape\) or None, got list"):
        custom(param_directions=lambda m: [1])(model, x)
    with pytest.raises(ValueError, match=r"Custom.param_directions: the model has no parameter 'nope'"):
        custom(param_directions=lambda m: {"nope": torch.ones(1, 3)})(model, x)
    with pytest.raises(ValueError, match=r"Custom.param_directions: direction for '1.bias' has shape \(1, 3\), "
                                         r"expected \(k, 12\)"):
        custom(param_directions=lambda m: {"1.bias": torch.ones(1, 3)})(model, x)
    with pytest.raises(ValueError, match=r"every parameter needs the same number k of directions, got \[1, 2\]"):
        custom(param_directions=lambda m: {"1.bias": torch.ones(1, 12), "3.bias": torch.ones(2, 3)})(model, x)
    with pytest.raises(ValueError, match=r"Custom: directions\(\) gave k=2 but param_directions\(\) gave k=1"):
        custom(lambda x: torch.ones(2, *x.shape), lambda m: {"1.bias": torch.ones(1, 12)})(model, x)
    with pytest.raises(ValueError, match=r"expected one target per term \(1\), got 2"):
        prepare(model, x, [(JacobianFrobenius(), 1.0, 1.0)], targets=[None, None])
    with pytest.raises(TypeError, match=r"where: output_key=0 selects a list, expected a tensor"):
        select_output(([1],), 0, "where")
    with pytest.raises(ValueError, match=r"JacobianSpectralNorm\(n_iter > 1\) needs context.forward"):
        JacobianSpectralNorm(n_iter=2).directions(x, PenaltyContext(x=x, model=model))
    from jvpreg.losses import image_gradients
    with pytest.raises(ValueError, match=r"image_gradients: expected method 'central' or 'sobel', got 'prewitt'"):
        image_gradients(torch.zeros(1, 1, 4, 4), "prewitt")


def test_prepare_walks_the_named_parameters_only_for_weight_directions(monkeypatch):
    """Input directions in a process without a process group need no name -> parameter table (building one costs
    0.3-0.7 ms a step on ResNet-50 / DenseNet-121); weight directions do."""
    from jvpreg.losses.base import prepare

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    walks = []
    real = nn.Module.named_parameters
    monkeypatch.setattr(nn.Module, "named_parameters", lambda self, *a, **k: walks.append(1) or real(self, *a, **k))
    plan = prepare(model, x, [(JacobianFrobenius(1), 1.0, 1.0)])
    assert not walks and tuple(plan.scales.shape) == (1,)
    prepare(model, x, [(ParameterSensitivity("0.weight"), 1.0, 1.0)])
    assert walks
