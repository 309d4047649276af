"""grid_sample / affine_grid: linear in the input for a fixed grid, exact fallback for a batch grid."""
import re

import pytest
import torch
import torch.nn.functional as F

import jvpreg
from conftest import reference_jvp

D = torch.float64
torch.manual_seed(0)
X = torch.randn(2, 3, 5, 5, dtype=D)
U = torch.randn_like(X)
GRID = torch.rand(2, 4, 4, 2, dtype=D) * 2 - 1


def _grid_sample_backward_is_differentiable() -> bool:
    """Whether this torch differentiates grid_sample's backward with respect to the grid (torch 2.11: no), which
    the reverse-mode fallback needs for a grid that comes from the batch."""
    x, grid = X.clone().requires_grad_(), torch.tanh(X[:, :2, :4, :4].permute(0, 2, 3, 1)).requires_grad_()
    out = F.grid_sample(x, grid, align_corners=False)
    (g,) = torch.autograd.grad(out, grid, torch.randn_like(out), create_graph=True)
    return g.requires_grad


@pytest.mark.parametrize("func, may_refuse", [
    pytest.param(lambda z: F.grid_sample(z, GRID, align_corners=False), False, id="constant-grid"),
    pytest.param(lambda z: F.grid_sample(z, GRID, mode="nearest", align_corners=True), False,
                 id="constant-grid-nearest"),
    pytest.param(lambda z: F.grid_sample(z, torch.tanh(z[:, :2, :4, :4].permute(0, 2, 3, 1)), align_corners=False),
                 True, id="grid-from-the-batch"),
])
def test_grid_sample_matches_torch_func(func, may_refuse):
    """A constant grid always has a JVP (grid_sample is linear in the input); a grid from the batch goes through
    the reverse-mode fallback, which may refuse only where this torch has neither forward AD for grid_sample nor a
    differentiable backward (torch 2.11), with the fallback's own message."""
    y_ref, t_ref = reference_jvp(func, X, U)
    try:
        y, t = jvpreg.jvp(func, (X,), (U,))
    except jvpreg.UnsupportedOpError as err:
        if not may_refuse or _grid_sample_backward_is_differentiable():
            raise
        assert re.search("grid_sample.* has no forward-mode derivative, and its backward is not differentiable", str(err))
        with pytest.raises(NotImplementedError, match="forward AD"):
            torch.func.jvp(func, (X,), (U,))
        return
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_affine_grid_matches_torch_func():
    theta, u = torch.randn(2, 2, 3, dtype=D), torch.randn(2, 2, 3, dtype=D)
    f = lambda t: F.affine_grid(t, (2, 3, 4, 4), align_corners=False)
    torch.testing.assert_close(jvpreg.jvp(f, (theta,), (u,))[1], torch.func.jvp(f, (theta,), (u,))[1])
