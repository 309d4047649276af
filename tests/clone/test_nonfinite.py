"""Non-finite primal values in the difference form: -inf masks as transformers write them.

Convention (``jvpreg.clone.core.tensor.block_delta``): an infinity shared by every block is a constant with
zero tangent, never ``inf - inf = NaN``; tangents at finite outputs are exact, at non-finite outputs 0
or NaN. Each pattern is compared with ``torch.func.jvp`` in float64.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from conftest import count_captures, runs_engine
from jvpreg.clone.program import capture
from op_sweep import mismatch

D = torch.float64
INF = float("inf")


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def inputs():
    """A point ``x`` and a direction ``u`` of the patterns' shape (drawn from the current seed)."""
    return torch.randn(2, 5, 5, dtype=D), torch.randn(2, 5, 5, dtype=D)


@contextlib.contextmanager
def quiet():
    """Warnings off: the patterns' fallbacks and captures warn by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def causal_attention(x):
    """Hand-written causal self-attention (the pattern that gave 64 of 80 NaN tangents)."""
    q, k, v = x * 1.5, x.flip(-1), x.tanh()
    s = (q @ k.transpose(-2, -1)) / 2.0
    s = s.masked_fill(causal(x.shape[-2]), -INF)
    return s.softmax(-1) @ v


def additive_mask(x):
    m = torch.zeros(x.shape[-2], x.shape[-2], dtype=D).masked_fill(causal(x.shape[-2]), -INF)
    return torch.softmax(x @ x.transpose(-2, -1) + m, dim=-1)


def where_mask(x):
    return torch.where(causal(x.shape[-1]), torch.tensor(-INF, dtype=D), x).log_softmax(-1)


PATTERNS = {
    "causal-attention": causal_attention,
    "additive-mask-softmax": additive_mask,
    "where-mask-log_softmax": where_mask,
    "masked-softmin": lambda x: F.softmin(x.masked_fill(causal(x.shape[-1]), INF), -1),
    "masked-logsumexp": lambda x: x.masked_fill(causal(x.shape[-1]), -INF).logsumexp(-1),
    "masked-amax": lambda x: x.masked_fill(causal(x.shape[-1]), -INF).amax(-1),
    "masked-amin": lambda x: x.masked_fill(causal(x.shape[-1]), INF).amin(-1),
    "masked-max-dim": lambda x: x.masked_fill(causal(x.shape[-1]), -INF).max(-1).values,
    "safe_softmax": lambda x: torch.ops.aten._safe_softmax(x.masked_fill(causal(x.shape[-1]), -INF), -1),
    "fully-masked-row-safe_softmax": lambda x: torch.ops.aten._safe_softmax(x.masked_fill(x.new_ones(
        x.shape[-1], x.shape[-1], dtype=torch.bool).tril(-3).logical_not(), -INF), -1),
    "sdpa-float-mask": lambda x: F.scaled_dot_product_attention(
        x, x, x, attn_mask=torch.zeros(5, 5, dtype=D).masked_fill(causal(5), -INF)),
    # a query whose keys are all masked: torch's SDPA gives 0 there (its _safe_softmax), so must the rule
    "sdpa-bool-mask-fully-masked-row": lambda x: F.scaled_dot_product_attention(
        x, x.flip(-1), x.tanh(), attn_mask=~causal(5) & (torch.arange(5) > 0)[:, None]),
    "sdpa-float-mask-fully-masked-row": lambda x: F.scaled_dot_product_attention(
        x, x, x, attn_mask=torch.zeros(5, 5, dtype=D).masked_fill(causal(5) | (torch.arange(5) == 2)[:, None], -INF)),
    "masked-output": lambda x: x.sin().masked_fill(causal(x.shape[-1]), -INF),
    # normalisations take plain block differences: an infinite entry makes its whole row NaN, as in torch.func
    "layer_norm-inf-entry": lambda x: F.layer_norm(x.masked_fill(causal(x.shape[-1]) & (x > 0.5), INF), (5,)),
    "batch_norm-inf-entry": lambda x: F.batch_norm(x.masked_fill(causal(x.shape[-1]) & (x > 0.5), -INF), None, None,
                                                   training=True),
    "group_norm-inf-entry": lambda x: F.group_norm(x.masked_fill(causal(x.shape[-1]) & (x > 0.5), INF), 1),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_inf_masks_give_exact_tangents(name):
    f = PATTERNS[name]
    torch.manual_seed(0)
    x, u = inputs()
    with quiet():
        y, t = jvpreg.jvp(f, (x,), (u,))
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no forward AD
        ry, rt = torch.func.jvp(f, (x,), (u,))
    assert not (bad := mismatch(y, ry, ry, "primal") or mismatch(t, rt, ry, "tangent")), bad
    fin = torch.isfinite(ry)
    assert torch.isfinite(t[fin]).all(), "NaN/inf tangent where the output is finite"


def test_inf_mask_output_has_zero_tangent_and_batched_tangents():
    """A -inf constant in the output: tangent 0 there (not NaN), for every tangent of a batch."""
    x, U = torch.randn(4, 4, dtype=D), torch.randn(3, 4, 4, dtype=D)
    y, T = jvpreg.jvp(lambda z: z.masked_fill(causal(4), -INF), (x,), (U,), batched_tangents=True)
    assert torch.equal(T[:, causal(4)], torch.zeros_like(T[:, causal(4)]))
    assert torch.equal(T[:, ~causal(4)], U[:, ~causal(4)])


# ------------------------------------------------------------------ captured programs: the fix only where needed


class AsModule(nn.Module):
    def __init__(self, f, mask=None):
        super().__init__()
        self.f = f
        if mask is not None:
            self.register_buffer("mask", mask)

    def forward(self, x):
        return self.f(self, x)


def _is_fix(node) -> bool:
    """A kept non-finite fix: ``masked_fill(d, m, 0)`` with ``m = isnan(d) & (z == a)`` or, where no gradient flows,
    ``m = (z == a)`` (the passes may have moved an ``unsqueeze`` between ``d`` and the fill)."""
    if node.target is not torch.ops.aten.masked_fill.Scalar or node.args[2] != 0:
        return False
    mask = node.args[1]
    return mask.target is torch.ops.aten.eq.Tensor or (mask.target in (torch.ops.aten.bitwise_and.Tensor,
                                                                       torch.ops.aten.__and__.Tensor)
                                                        and torch.ops.aten.isnan.default in
                                                        {a.target for a in mask.args})


def fixes(module):
    """Number of kept non-finite fixes in each captured program of ``module``."""
    return [sum(n.op == "call_function" and _is_fix(n) for n in p.gm.graph.nodes)
            for p in capture.programs(module).values() if p.gm is not None]


def jvps(module, x, u):
    with quiet():
        eager = jvpreg.jvp(module, (x,), (u,), engine="eager")
        captured = [jvpreg.jvp(module, (x,), (u,), engine="captured") for _ in range(2)]
    for got in captured:
        for c, e in zip(got, eager):
            torch.testing.assert_close(c, e, rtol=0, atol=0, equal_nan=True)
    return eager


@pytest.mark.parametrize("name", list(PATTERNS))
def test_captured_inf_masks_equal_eager(name):
    """Captured programs drop the fix only where the primal provably holds no infinity: NaN for NaN."""
    torch.manual_seed(0)
    module = AsModule(lambda self, x: PATTERNS[name](x))
    jvps(module, *inputs())


def mlp(self, x):
    return F.linear(torch.sigmoid(torch.tanh(x * 2.0)), torch.ones(3, 5, dtype=x.dtype))


@pytest.mark.slow
def test_finite_program_has_no_fix_and_an_infinite_input_recaptures_with_it():
    torch.manual_seed(0)
    module = AsModule(mlp)
    x, u = torch.randn(4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    jvps(module, x, u)
    assert fixes(module) == [0]
    x[0, 0], u[0, 0] = -INF, 0.0  # tanh(-inf): an infinity shared by every block, zero tangent
    x[1, 1], u[1, 1] = INF, 0.0
    y, t = jvps(module, x, u)
    assert fixes(module)[1] > 0, "a non-finite input must recapture with the fix"
    ry, rt = torch.func.jvp(lambda z: mlp(None, z), (x,), (u,))
    torch.testing.assert_close(t, rt)  # finite: without the fix, tanh's tangent there is NaN


def test_inf_buffer_and_inf_making_ops_keep_the_fix():
    torch.manual_seed(0)
    mask = torch.zeros(5, dtype=D).masked_fill(torch.arange(5) > 2, -INF)
    x, u = torch.randn(4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    buffer = AsModule(lambda self, x: torch.tanh(x + self.mask), mask)
    y, t = jvps(buffer, x, u)
    assert fixes(buffer) == [1]
    rt = torch.func.jvp(lambda z: torch.tanh(z + mask), (x,), (u,))[1]
    torch.testing.assert_close(t, rt)  # 0 under the mask, not NaN
    made = AsModule(lambda self, x: torch.tanh(torch.log(x.abs() * (torch.arange(5) < 3).to(x.dtype))))
    jvps(made, x, u)  # log(0) = -inf in every block: tanh's fix stays (log's own input is finite)
    assert fixes(made) == [1]


def float32_softmax_of_a_float64_mask(self, x):
    """Hugging Face's eager attention in a float64 model (OPT, Phi, GPT-NeoX): a ``finfo(float64).min`` mask built in
    the forward, the scores cast to float32 for the softmax, where the mask overflows to ``-inf``."""
    mask = torch.zeros(5, 5, dtype=x.dtype).masked_fill(causal(5), torch.finfo(x.dtype).min)
    scores = x @ x.transpose(-2, -1) + mask
    return torch.softmax(scores, -1, dtype=torch.float32).to(x.dtype) @ x.tanh()


@pytest.mark.parametrize("cast", ["dtype-argument", "to"])
def test_a_narrowing_cast_keeps_the_fix(cast):
    torch.manual_seed(0)
    if cast == "to":
        module = AsModule(lambda self, x: torch.softmax(
            (x @ x.transpose(-2, -1)).masked_fill(causal(5), torch.finfo(D).min).to(torch.float32), -1).to(D))
    else:
        module = AsModule(float32_softmax_of_a_float64_mask)
    x, u = inputs()
    y, t = jvps(module, x, u)  # captured == eager, NaN for NaN
    assert fixes(module)[0] >= 1  # the softmax's: its float32 primal holds -inf
    assert torch.isfinite(t).all()
    rt = torch.func.jvp(lambda z: module(z), (x,), (u,))[1]
    torch.testing.assert_close(t, rt, rtol=1e-6, atol=1e-6)  # the softmax runs in float32


def test_a_float64_mask_buffer_cast_to_float32_keeps_the_fix():
    """The ``finfo(float64).min`` mask held in a buffer (its size read at capture), not made in the forward."""
    torch.manual_seed(0)
    mask = torch.zeros(5, 5, dtype=D).masked_fill(causal(5), torch.finfo(D).min)
    module = AsModule(lambda self, x: torch.softmax((x @ x.transpose(-2, -1) + self.mask).float(), -1).to(D), mask)
    x, u = inputs()
    y, t = jvps(module, x, u)
    assert torch.isfinite(t).all() and fixes(module)[0] >= 1


@pytest.mark.parametrize("autocast", [False, True])
def test_float32_program_keeps_no_fix(autocast):
    """The float64 scale cast to float32 in every float32 program, and bfloat16 autocast's casts, narrow finite data,
    not a constant too large for the narrower dtype: no fix stays (it costs 4 kernels per smooth op)."""
    torch.manual_seed(0)
    module = AsModule(lambda self, x: torch.softmax(torch.tanh(x) @ x.transpose(-2, -1), -1) @ F.gelu(x))
    x, u = torch.randn(2, 5, 5), torch.randn(2, 5, 5)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        jvpreg.jvp(module, (x,), (u,), engine="captured")
    assert fixes(module) == [0]


@pytest.mark.parametrize("recompute", [False, True])
def test_sdpa_fully_masked_row_penalty_gradient_is_finite_and_exact(monkeypatch, recompute):
    """Under autograd (a penalty's backward), both attention paths (P kept, or recomputed in the backward) give 0 on
    a query whose keys are all masked, and the gradient of ||J u||^2 equals torch's double-backward reference."""
    from jvpreg.clone.rules import kernels

    monkeypatch.setattr(kernels, "ATTENTION_RECOMPUTE_NUMEL", 1 if recompute else 1 << 60)
    mask = ~causal(5) & (torch.arange(5) > 0)[:, None]
    torch.manual_seed(0)
    w = torch.randn(5, 5, dtype=D, requires_grad=True)

    def f(x):
        return F.scaled_dot_product_attention(x @ w, x, x.tanh(), attn_mask=mask)

    x, u = inputs()
    y, t = jvpreg.jvp(f, (x,), (u,), engine="eager")
    (g,) = torch.autograd.grad(t.pow(2).sum(), w)
    with sdpa_kernel(SDPBackend.MATH):
        ry, rt = torch.autograd.functional.jvp(f, x, u, create_graph=True)
        (rg,) = torch.autograd.grad(rt.pow(2).sum(), w)
    assert torch.equal(y[:, 0], torch.zeros_like(y[:, 0])) and torch.isfinite(t).all()
    torch.testing.assert_close(t, rt.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-12)


def test_the_fix_without_gradients_gives_the_values_of_the_fix_with_them():
    """``block_delta``'s two forms (``isnan(d) & (z == a)`` where a gradient flows, ``z == a`` alone where none does,
    two kernels fewer) on every kind of entry: equal and different finite ones, signed zeros, shared and opposite
    infinities, NaNs in either block."""
    from jvpreg.clone.core.tensor import block_delta

    inf, nan = INF, float("nan")
    a = torch.tensor([1.0, 1.0, 0.0, -0.0, inf, -inf, inf, nan, 2.0, nan, 3.0], dtype=D)
    z = torch.tensor([[1.0, 2.5, -0.0, 0.0, inf, -inf, -inf, 1.0, nan, nan, inf]], dtype=D)
    with torch.no_grad():
        cheap = block_delta(z, a)
    graded = block_delta(z.clone().requires_grad_(), a)
    assert graded.requires_grad
    torch.testing.assert_close(cheap, graded.detach(), rtol=0, atol=0, equal_nan=True)  # -0.0 == 0.0: equal values
    assert cheap[0, :6].eq(torch.tensor([0.0, 1.5, 0.0, 0.0, 0.0, 0.0], dtype=D)).all()  # inf - inf -> 0


@pytest.mark.parametrize("name", list(PATTERNS))
def test_jvps_without_gradients_equal_those_with_them(name):
    """The same masks through whole JVPs: under ``torch.no_grad`` (the cheaper fix) as with a graph."""
    f = PATTERNS[name]
    torch.manual_seed(0)
    x, u = inputs()
    with quiet():
        y, t = jvpreg.jvp(f, (x.clone().requires_grad_(),), (u,))
        with torch.no_grad():
            y_ng, t_ng = jvpreg.jvp(f, (x,), (u,))
    torch.testing.assert_close(t_ng, t.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(y_ng, y.detach(), rtol=0, atol=0, equal_nan=True)


class _CancellingRow(nn.Module):
    """A weight row orthogonal to the tangent (difference exactly 0 there, its gradient w.r.t. the row not 0), then a
    ``-inf`` mask, so the softmax rule keeps the non-finite fix on a difference with equal finite entries."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[1.0, -1.0], [0.5, 2.0], [3.0, 1.0]]))

    def forward(self, x):
        return torch.softmax(self.lin(x).masked_fill(torch.tensor([False, False, True]), -INF), -1)


def test_a_program_captured_with_frozen_parameters_gives_exact_gradients_once_they_are_trained():
    """The fix's form follows grad mode (guarded), not ``requires_grad``: a program recorded while the parameters did not
    require grad is replayed once they do (no recapture), and a gradient-free fill would zero the gradient at the
    equal entry (row 0: 0.18 where torch.func gives 0.83)."""
    model = _CancellingRow().to(D)
    x, u = torch.tensor([[0.3, -0.2]], dtype=D), torch.tensor([[1.0, 1.0]], dtype=D)
    c = torch.tensor([[1.0, -2.0, 0.5]], dtype=D)
    model.requires_grad_(False)
    for _ in range(2):
        jvpreg.jvp(model, (x,), (u,), engine="captured")
    model.requires_grad_(True)
    _, t = jvpreg.jvp(model, (x,), (u,), engine="captured")
    (t * c).sum().backward()
    w = model.lin.weight.detach().clone().requires_grad_()
    mask = torch.tensor([False, False, True])
    rt = torch.func.jvp(lambda z: torch.softmax((z @ w.T).masked_fill(mask, -INF), -1), (x,), (u,))[1]
    (rt * c).sum().backward()
    torch.testing.assert_close(model.lin.weight.grad, w.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("engine", ["eager", "captured"])
def test_entries_at_the_end_of_the_range_give_a_clear_error_not_an_infinite_tangent(dtype, engine):
    """``x + s u`` overflows where ``x`` holds entries near the dtype's largest value: the difference form has no
    resolution there (before: an infinite tangent where the JVP is finite). The same entries with a direction that
    points inward fit, and give the exact JVP; so do large entries short of the range's end."""
    big = torch.finfo(dtype).max
    model = nn.Sequential(nn.Identity())
    f = lambda x: x * 0.5  # noqa: E731
    x = torch.tensor([1.0, -2.0, big], dtype=dtype)
    u = torch.tensor([0.5, 1.0, 2.0], dtype=dtype)
    with count_captures() as n:
        with pytest.raises(jvpreg.clone.UnsupportedOpError, match=r"x \+ s\*u overflows .* rescale the input"):
            jvpreg.jvp(f, (x,), (u,), engine=engine)
        with pytest.raises(jvpreg.clone.UnsupportedOpError, match="overflows"):
            jvpreg.jvp(model, (x,), (u,), engine=engine)
    # raised by the choice of the scale, before any capture: no program recorded, no eager run
    assert (n.recorded, n.refused, n.raised, n.replays, n.eager) == (0, 0, 0, 0, 0), n
    inward = -u
    with runs_engine(engine, calls=2):  # captured: the capture, then a replay of the same signature
        _, t = jvpreg.jvp(f, (x,), (inward,), engine=engine)
        torch.testing.assert_close(t, inward * 0.5)
        large = torch.tensor([1.0, -2.0, big / 2 ** 50 if dtype != torch.float16 else 1e3], dtype=dtype)
        _, t = jvpreg.jvp(f, (large,), (u,), engine=engine)
    torch.testing.assert_close(t, u * 0.5)
