"""``torch._grouped_mm`` (Mixture-of-Experts layers, Hugging Face's default experts kernel): the bilinear rule against
the same products written group by group in float64.

torch's CPU kernel takes float32 (not float64) with rows of 16-byte multiples and has no forward AD, so the
reference is the group-by-group form differentiated by ``torch.func.jvp`` in float64, and the rule is held to float32
rounding of it; the exact fallback is not involved (a warning would say so).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import jvpreg
from conftest import runs_engine

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")

OFFS = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # four groups of rows, one of them empty
ROWS, K, N, G = 10, 8, 4, 4  # rows past the last offset are left unwritten by torch's kernel: none here


def _looped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_grouped_mm(a, b, offs=OFFS)`` written group by group."""
    bounds = [0] + OFFS.tolist()
    return torch.cat([a[start:end] @ b[g] for g, (start, end) in enumerate(zip(bounds, bounds[1:]))])


def _grouped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=OFFS)


def _data(seed: int):
    """``(x, b, u, db)``: rows, expert matrices and a direction for each, float64."""
    g = torch.Generator().manual_seed(seed)
    rows = lambda: torch.randn(ROWS, K, generator=g, dtype=torch.float64)  # noqa: E731
    mats = lambda: torch.randn(G, K, N, generator=g, dtype=torch.float64)  # noqa: E731
    return rows(), mats(), rows(), mats()


CASES = {
    # name: (f on float32 through _grouped_mm, the same f written group by group), both functions of x alone
    "input": lambda mm, b: (lambda x: torch.tanh(mm(x, b))),
    "weight": lambda mm, b: (lambda x: mm(torch.ones(ROWS, K, dtype=x.dtype), b * x.sum())),
    "both": lambda mm, b: (lambda x: mm(x.sin(), b * x.mean()) * x[:, :N]),
}


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_jvp_matches_the_group_by_group_form(case, engine):
    x, b, u, _ = _data(0)
    f32 = CASES[case](_grouped, b.float())
    f64 = CASES[case](_looped, b)
    with warnings.catch_warnings(), runs_engine(engine, calls=2):
        warnings.simplefilter("error")  # no fallback: the rule runs
        for _ in range(2):  # captured: the capture, then the replay
            y, t = jvpreg.jvp(f32, (x.float(),), (u.float(),), engine=engine)
    ry, rt = torch.func.jvp(f64, (x,), (u,))
    assert (y.double() - ry).norm() <= 1e-6 * ry.norm()
    assert (t.double() - rt).norm() <= 1e-6 * rt.norm()
    assert rt.norm() > 0


def test_grouped_mm_weight_tangent_by_jvp_params():
    """The JVP with respect to the expert weights (a swapped weight: ``gmm(a_0, db)``), and the input's beside it."""
    x, b, u, db = _data(1)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(b.float())

        def forward(self, x):
            return torch.relu(_grouped(x, self.w))

    m = Experts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, t = jvpreg.jvp_params(m, (x.float(),), {"w": db.float()}, (u.float(),))
    ry, rt = torch.func.jvp(lambda x, w: torch.relu(_looped(x, w)), (x, b), (u, db))
    assert (t.double() - rt).norm() <= 1e-6 * rt.norm() and rt.norm() > 0


def test_grouped_mm_penalty_gradient():
    """Gradients of ``||J u||^2`` w.r.t. the expert weights through the rule, against the group-by-group form's."""
    x, b, u, _ = _data(2)
    w32 = b.float().requires_grad_()
    _, t = jvpreg.jvp(lambda x: torch.tanh(_grouped(x, w32)), (x.float(),), (u.float(),))
    (g,) = torch.autograd.grad(t.pow(2).sum(), w32)
    w64 = b.clone().requires_grad_()
    _, rt = torch.func.jvp(lambda x: torch.tanh(_looped(x, w64)), (x,), (u,))
    (rg,) = torch.autograd.grad(rt.pow(2).sum(), w64)
    assert (g.double() - rg).norm() <= 1e-5 * rg.norm() and rg.norm() > 0
