"""Tests for jvpreg.analysis: every quantity against explicit float64 Jacobians (torch.func.jacrev)."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from jvpreg.analysis import (
    AffineMap,
    ConvergenceWarning,
    affine_map,
    as_linear_operator,
    frobenius_norm,
    region_check,
    top_eigenvalues,
    top_singular_values,
    trace,
)
from jvpreg.models import build_model

# --------------------------------------------------------------------------- settings
# Plain dicts: registry name, builder kwargs, per-sample input shape. All float64, eval mode.
SETTINGS = [
    dict(id="mlp", name="mlp", kwargs=dict(in_channels=1, num_classes=5, image_size=4, hidden=(16, 16)),
         shape=(1, 4, 4)),
    dict(id="cnn_maxpool", name="small_cnn", kwargs=dict(in_channels=1, num_classes=5, image_size=8, width=4),
         shape=(1, 8, 8)),
    dict(id="unet", name="unet", kwargs=dict(in_channels=1, num_classes=None, image_size=8, depth=2, base_width=4),
         shape=(1, 8, 8)),
]
CPA = [s for s in SETTINGS if s["id"] in ("mlp", "cnn_maxpool")]
SQUARE = [s for s in SETTINGS if s["id"] == "unet"]
B = 3


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models: one intra-op thread is as fast and far more robust on a shared, oversubscribed CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _ids(settings):
    return [s["id"] for s in settings]


def _build(setting, seed=0):
    torch.manual_seed(seed)
    model = build_model(setting["name"], **setting["kwargs"]).double().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    # non-trivial eval-mode BatchNorm statistics
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(B, *setting["shape"], dtype=torch.float64)
    return model, x


def _jacobian(model, x):
    """Explicit per-sample Jacobians ``(B, D_out, D_in)``."""
    J = torch.func.vmap(torch.func.jacrev(lambda xi: model(xi.unsqueeze(0))[0]))(x)
    return J.reshape(x.shape[0], -1, x[0].numel())


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- singular values
@pytest.mark.parametrize("setting", SETTINGS, ids=_ids(SETTINGS))
@pytest.mark.parametrize("engine", ["clone", "torch.func"])
def test_top_singular_values_match_svd(setting, engine):
    model, x = _build(setting)
    J = _jacobian(model, x)
    U, S, Vh = torch.linalg.svd(J)
    k = 3
    # a generous block (m = min(23, D_out)) converges in a few iterations even for the flat UNet spectrum
    res = top_singular_values(model, x, k, tol=1e-10, max_iter=200, oversample=20, generator=_gen(), engine=engine)
    assert res.converged and res.sample_converged.all()
    assert res.values.shape == (B, k) and res.left.shape == (B, k, J.shape[1]) and res.right.shape == (B, k, J.shape[2])
    torch.testing.assert_close(res.values, S[:, :k], rtol=1e-6, atol=0)
    # singular vectors up to sign (the test Jacobians have well separated top values)
    assert torch.all((S[:, : k - 1] - S[:, 1:k]) / S[:, :1] > 1e-3)
    cos_r = torch.einsum("bkd,bkd->bk", res.right, Vh[:, :k])
    cos_l = torch.einsum("bkd,bdk->bk", res.left, U[:, :, :k])
    torch.testing.assert_close(cos_r.abs(), torch.ones_like(cos_r), rtol=0, atol=1e-6)
    torch.testing.assert_close(cos_l.abs(), torch.ones_like(cos_l), rtol=0, atol=1e-6)
    # consistent signs: J v = σ u, Jᵀ u = σ v
    torch.testing.assert_close(torch.einsum("bod,bkd->bko", J, res.right), res.values[..., None] * res.left,
                               rtol=0, atol=1e-10)
    assert float(res.residual.max()) < 1e-5 and float(res.rel_change.max()) <= 1e-10
    m = min(k + 20, J.shape[1])
    assert res.stats["n_jvp"] == res.stats["n_vjp"] and m <= res.stats["n_jvp"] <= m * res.n_iter


def test_top_singular_values_full_rank_block_and_chunks():
    model, x = _build(SETTINGS[0])                      # D_out = 5: k = 5 takes the whole spectrum
    S = torch.linalg.svdvals(_jacobian(model, x))
    res = top_singular_values(model, x, 5, tol=1e-12, generator=_gen(), chunk_size=2)
    torch.testing.assert_close(res.values, S, rtol=1e-10, atol=1e-14)
    assert res.n_iter <= 3                              # the block spans the row space after one step


def test_top_singular_values_warm_start_and_return_vectors_false():
    model, x = _build(SETTINGS[1])
    first = top_singular_values(model, x, 2, tol=1e-12, generator=_gen())
    again = top_singular_values(model, x, 2, tol=1e-12, generator=_gen(1), init=first.right, return_vectors=False)
    assert again.left is None and again.right is None
    assert again.n_iter <= first.n_iter
    torch.testing.assert_close(again.values, first.values, rtol=1e-9, atol=0)


@pytest.mark.slow
def test_convergence_reporting():
    model, x = _build(SETTINGS[2])
    with pytest.warns(ConvergenceWarning, match=r"3 of 3 samples did not converge to tol=1e-06 in max_iter=1"):
        res = top_singular_values(model, x, 2, max_iter=1, generator=_gen())
    assert res.converged is False and res.n_iter == 1 and not res.sample_converged.any()
    assert torch.isfinite(res.values).all() and torch.isfinite(res.residual).all()
    with pytest.warns(ConvergenceWarning, match="did not converge"):
        res = top_singular_values(model, x, 2, tol=0.0, max_iter=4, generator=_gen())
    assert res.n_iter == 4
    with pytest.warns(ConvergenceWarning, match="top_eigenvalues"):
        assert top_eigenvalues(model, x, 2, max_iter=1, generator=_gen()).converged is False


def test_same_start_vectors_give_same_iterations_across_engines():
    model, x = _build(SETTINGS[1])
    a = top_singular_values(model, x, 2, tol=1e-8, generator=_gen(3), engine="clone")
    b = top_singular_values(model, x, 2, tol=1e-8, generator=_gen(3), engine="torch.func")
    assert a.n_iter == b.n_iter
    torch.testing.assert_close(a.values, b.values, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- eigenvalues
@pytest.mark.parametrize("setting", SQUARE, ids=_ids(SQUARE))
@pytest.mark.slow
def test_top_eigenvalues_match_eig(setting):
    model, x = _build(setting)
    J = _jacobian(model, x)
    k = 2
    res = top_eigenvalues(model, x, k, tol=1e-10, max_iter=300, oversample=30, generator=_gen())
    assert res.converged and res.values.dtype == torch.complex128 and res.vectors.shape == (B, k, J.shape[1])
    ref = torch.linalg.eigvals(J)
    for i in range(B):
        order = torch.argsort(ref[i].abs(), descending=True)
        mod = ref[i][order].abs()
        torch.testing.assert_close(res.values[i].abs(), mod[:k], rtol=1e-6, atol=0)
        for lam in res.values[i]:                       # each Ritz value is an eigenvalue of J
            assert float((ref[i] - lam).abs().min() / mod[0]) < 1e-6
    Jx = torch.einsum("bod,bkd->bko", J.to(torch.complex128), res.vectors)
    torch.testing.assert_close(Jx, res.values[..., None] * res.vectors, rtol=0, atol=1e-6 * float(res.values.abs().max()))


def test_top_eigenvalues_of_a_symmetric_linear_map_are_real():
    torch.manual_seed(0)
    M = torch.randn(6, 6, dtype=torch.float64)
    M = M + M.T
    model = lambda z: z @ M                              # noqa: E731  (per-sample J = Mᵀ = M)
    x = torch.randn(2, 6, dtype=torch.float64)
    res = top_eigenvalues(model, x, 3, tol=1e-12, oversample=3, generator=_gen())
    ref = torch.linalg.eigvalsh(M)
    ref = ref[ref.abs().argsort(descending=True)][:3]
    torch.testing.assert_close(res.values.real, ref.expand(2, 3), rtol=1e-10, atol=0)
    assert float(res.values.imag.abs().max()) < 1e-12


# --------------------------------------------------------------------------- estimators
def _mean_and_se(estimates, value="squared", stderr="squared_stderr"):
    vals = torch.stack([getattr(e, value) for e in estimates])
    ses = torch.stack([getattr(e, stderr) for e in estimates])
    return vals.mean(0), ses.pow(2).mean(0).sqrt() / math.sqrt(len(estimates))


ESTIMATOR_SETTINGS = [
    dict(id=f"{s['id']}-{m}-{d}", setting=s, method=m, distribution=d)
    for s, m, d in [(SETTINGS[2], "hutchinson", "rademacher"), (SETTINGS[2], "hutchinson", "gaussian"),
                    (SETTINGS[2], "hutch++", "rademacher"), (SETTINGS[2], "hutch++", "gaussian"),
                    (SETTINGS[1], "hutchinson", "rademacher"), (SETTINGS[1], "hutch++", "gaussian")]
]


@pytest.mark.parametrize("case", [c if c["id"] == "cnn_maxpool-hutchinson-rademacher" else
                                  pytest.param(c, marks=pytest.mark.slow) for c in ESTIMATOR_SETTINGS],
                         ids=[c["id"] for c in ESTIMATOR_SETTINGS])
def test_frobenius_estimator_is_unbiased(case):
    setting, method, distribution = case["setting"], case["method"], case["distribution"]
    model, x = _build(setting)
    exact = _jacobian(model, x).pow(2).sum((1, 2))
    ests = [frobenius_norm(model, x, n_samples=12, method=method, distribution=distribution, generator=_gen(s))
            for s in range(20)]
    mean, se = _mean_and_se(ests)
    assert torch.all((mean - exact).abs() <= 3 * se), ((mean - exact) / se)
    assert torch.all(se < exact)                         # a meaningful (not huge) standard error
    e = ests[0]
    torch.testing.assert_close(e.value, e.squared.sqrt())
    torch.testing.assert_close(e.stderr, e.squared_stderr / (2 * e.value))
    value, stderr = e                                   # unpacks as (value, stderr)
    assert value is e.value and stderr is e.stderr and e.n_samples == 12 and e.method == method


@pytest.mark.parametrize("method, distribution", [("hutchinson", "rademacher"), ("hutch++", "gaussian")])
@pytest.mark.slow
def test_trace_estimator_is_unbiased(method, distribution):
    model, x = _build(SETTINGS[2])
    exact = _jacobian(model, x).diagonal(dim1=1, dim2=2).sum(1)
    ests = [trace(model, x, n_samples=24, method=method, distribution=distribution, generator=_gen(s))
            for s in range(20)]
    mean, se = _mean_and_se(ests, "value", "stderr")
    assert torch.all((mean - exact).abs() <= 3 * se), ((mean - exact) / se)


def test_hutchpp_is_exact_when_the_sketch_spans_the_jacobian():
    model, x = _build(SETTINGS[0])                      # rank J <= D_out = 5 <= n_samples // 3
    exact = _jacobian(model, x).pow(2).sum((1, 2))
    est = frobenius_norm(model, x, n_samples=15, method="hutch++", generator=_gen())
    torch.testing.assert_close(est.squared, exact, rtol=1e-10, atol=0)
    assert float(est.squared_stderr.max()) < 1e-10 * float(exact.max())


# --------------------------------------------------------------------------- affine maps
@pytest.mark.parametrize("setting", CPA, ids=_ids(CPA))
@pytest.mark.parametrize("chunk_size", [7, 64])
def test_affine_map_is_exact_for_cpa_nets(setting, chunk_size):
    model, x = _build(setting)
    J = _jacobian(model, x)
    amap = affine_map(model, x, chunk_size=chunk_size)
    assert isinstance(amap, AffineMap) and amap.A.shape == J.shape
    torch.testing.assert_close(amap.A, J, rtol=0, atol=1e-14)
    b_ref = model(x).reshape(B, -1) - torch.einsum("boi,bi->bo", J, x.reshape(B, -1))
    torch.testing.assert_close(amap.b, b_ref, rtol=0, atol=1e-14)
    assert float(amap.reconstruction_error(x).max()) < 1e-14      # f(x) = A x + b
    check = region_check(model, x, amap, generator=_gen())
    assert check.all_passed, check
    assert float(check.error.max()) < 1e-7


def test_affine_map_bias_is_the_frozen_network_at_zero():
    """b_ω = f_x(0): the clone forward of block x + 1·(−x) = 0 with x's nonlinearity states."""
    import jvpreg

    model, x = _build(SETTINGS[1])
    amap = affine_map(model, x)
    y, minus_Ax = jvpreg.jvp(model, (x,), (-x,), scale=1.0)
    torch.testing.assert_close(amap.b, (y + minus_Ax).reshape(B, -1), rtol=0, atol=1e-14)


def test_region_check_flags_smooth_networks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x = torch.randn(2, 6, dtype=torch.float64)
    check = region_check(model, x, radius=1e-2, max_halvings=0, generator=_gen())
    assert not check.passed.any()                       # curvature: not one affine region


def test_affine_map_torch_func_engine_agrees():
    model, x = _build(SETTINGS[1])
    a = affine_map(model, x, chunk_size=32)
    b = affine_map(model, x, chunk_size=32, engine="torch.func")
    torch.testing.assert_close(a.A, b.A, rtol=0, atol=1e-14)


# --------------------------------------------------------------------------- LinearOperator
@pytest.mark.slow
def test_linear_operator_products_and_svds():
    from scipy.sparse.linalg import svds

    model, x = _build(SETTINGS[1])
    J = _jacobian(model, x[:1])[0].numpy()
    op = as_linear_operator(model, x[:1])
    assert op.shape == J.shape and op.dtype == np.float64
    rng = np.random.default_rng(0)
    v, w, V = rng.standard_normal(J.shape[1]), rng.standard_normal(J.shape[0]), rng.standard_normal((J.shape[1], 4))
    np.testing.assert_allclose(op.matvec(v), J @ v, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(op.rmatvec(w), J.T @ w, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(op.matmat(V), J @ V, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(op.H @ w, J.T @ w, rtol=1e-10, atol=1e-14)
    s = np.sort(svds(op, k=3, return_singular_vectors=False, rng=np.random.default_rng(0)))[::-1]
    np.testing.assert_allclose(s, np.linalg.svd(J, compute_uv=False)[:3], rtol=1e-8)
    ours = top_singular_values(model, x[:1], 3, tol=1e-12, generator=_gen()).values[0].numpy()
    np.testing.assert_allclose(ours, s, rtol=1e-8)


# --------------------------------------------------------------------------- argument errors
def _tiny():
    return _build(SETTINGS[0])


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, x: top_singular_values(m, x, 0), ValueError, r"top_singular_values\(model, x, k\): k must be an int >= 1, got 0"),
    (lambda m, x: top_singular_values(m, x, 6), ValueError, r"k=6 exceeds min\(D_in, D_out\) = min\(16, 5\)"),
    (lambda m, x: top_singular_values(m, x, 2, tol=-1.0), ValueError, r"tol must be a finite number >= 0, got -1.0"),
    (lambda m, x: top_singular_values(m, x, 2, max_iter=0), ValueError, r"max_iter must be an int >= 1"),
    (lambda m, x: top_singular_values(m, x, 2, engine="jax"), ValueError, r"engine must be one of \('clone', 'torch.func'\), got 'jax'"),
    (lambda m, x: top_singular_values(m, x, 2, generator=0), TypeError, r"generator must be a torch.Generator"),
    (lambda m, x: top_singular_values(m, x, 2, init=torch.zeros(3, 2, 7)), ValueError, r"init must have shape \(B=3, j<=5, D=16\)"),
    (lambda m, x: top_singular_values(m, x.numpy(), 2), TypeError, r"expected x to be a tensor"),
    (lambda m, x: top_singular_values("mlp", x, 2), TypeError, r"expected model to be callable"),
    (lambda m, x: top_singular_values(m, x.long(), 2), TypeError, r"x must be floating point"),
    (lambda m, x: top_singular_values(lambda z: (m(z), z), x, 2), TypeError, r"model\(x\) must return one tensor"),
    (lambda m, x: top_singular_values(lambda z: m(z).sum(0), x, 2), ValueError, r"must keep the batch dim"),
    (lambda m, x: top_eigenvalues(m, x, 2), ValueError, r"top_eigenvalues\(model, x, k\): eigenvalues need a square Jacobian, but D_out=5"),
    (lambda m, x: trace(m, x), ValueError, r"trace\(model, x\): the trace needs a square Jacobian"),
    (lambda m, x: frobenius_norm(m, x, n_samples=1), ValueError, r"n_samples must be an int >= 2, got 1"),
    (lambda m, x: frobenius_norm(m, x, method="hutch+"), ValueError, r"method must be one of \('hutchinson', 'hutch\+\+'\), got 'hutch\+'"),
    (lambda m, x: frobenius_norm(m, x, n_samples=3, method="hutch++"), ValueError, r"method='hutch\+\+' needs n_samples >= 4"),
    (lambda m, x: frobenius_norm(m, x, distribution="uniform"), ValueError, r"distribution must be one of \('rademacher', 'gaussian'\)"),
    (lambda m, x: affine_map(m, x, chunk_size=0), ValueError, r"affine_map\(model, x\): chunk_size must be an int >= 1"),
    (lambda m, x: region_check(m, x, radius=0.0), ValueError, r"radius must be a positive number"),
    (lambda m, x: as_linear_operator(m, x), ValueError, r"expected one sample with its batch dim, shape \(1, \*in_shape\), got shape \(3, 1, 4, 4\); pass x\[i:i\+1\]"),
])
def test_argument_errors(call, exc, match):
    model, x = _tiny()
    with pytest.raises(exc, match=match):
        call(model, x)


def test_training_mode_batchnorm_warns_and_model_is_untouched():
    model, x = _build(SETTINGS[1])
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"training mode and contains \['BatchNorm2d'\].*model.eval\(\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            top_singular_values(model, x, 1, max_iter=1, generator=_gen())
    assert model.training
    for k, v in model.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            assert torch.equal(v, state[k]) or "running" in k  # only BN running stats may move (train mode)


@pytest.mark.slow
def test_inputs_are_not_modified_and_no_param_grads():
    model, x = _build(SETTINGS[2])
    for p in model.parameters():
        p.requires_grad_(True)
    x0 = x.clone()
    with pytest.warns(ConvergenceWarning):
        top_singular_values(model, x, 2, max_iter=2, generator=_gen())
    frobenius_norm(model, x, n_samples=4, method="hutch++", generator=_gen())
    assert torch.equal(x, x0)
    assert all(p.grad is None for p in model.parameters())


def test_vjp_falls_back_when_the_backward_cannot_be_vmapped():
    """An old-style autograd.Function has no functorch support: VJPs fall back to plain autograd."""
    from jvpreg.analysis import PerSampleJacobian

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            return z * z

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return 2 * z * g

    torch.manual_seed(0)
    W = torch.randn(5, 4, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    op = PerSampleJacobian(lambda z: Square.apply(z) @ W.T, x)
    C = torch.randn(2, 3, 5, dtype=torch.float64)
    got = op.vjp(C)
    assert op.vjp_method != "torch.func.vjp"
    torch.testing.assert_close(got, torch.einsum("bko,oi->bki", C, W) * 2 * x[:, None], rtol=0, atol=1e-14)
