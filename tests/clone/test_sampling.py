"""grid_sample / affine_grid: linear in the input for a fixed grid, exact fallback for a batch grid."""
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


@pytest.mark.parametrize("func", [
    pytest.param(lambda z: F.grid_sample(z, GRID, align_corners=False), id="constant-grid"),
    pytest.param(lambda z: F.grid_sample(z, GRID, mode="nearest", align_corners=True), id="constant-grid-nearest"),
    pytest.param(lambda z: F.grid_sample(z, torch.tanh(z[:, :2, :4, :4].permute(0, 2, 3, 1)), align_corners=False),
                 id="grid-from-the-batch"),
])
def test_grid_sample_matches_torch_func(func):
    y_ref, t_ref = reference_jvp(func, X, U)
    try:
        y, t = jvpreg.jvp(func, (X,), (U,))
    except jvpreg.UnsupportedOpError:  # a batch grid on torch 2.11: neither forward AD nor a double backward
        with pytest.raises(NotImplementedError, match="forward AD"):
            torch.func.jvp(func, (X,), (U,))
        return
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t, t_ref, rtol=1e-10, atol=1e-12)


def test_affine_grid_matches_torch_func():
    theta, u = torch.randn(2, 2, 3, dtype=D), torch.randn(2, 2, 3, dtype=D)
    f = lambda t: F.affine_grid(t, (2, 3, 4, 4), align_corners=False)
    torch.testing.assert_close(jvpreg.jvp(f, (theta,), (u,))[1], torch.func.jvp(f, (theta,), (u,))[1])
