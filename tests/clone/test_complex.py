"""Complex intermediates inside a real function (an FFT, ``view_as_complex``): exact, or the exact fallback.

Clone rules linearise real functions (tanh through its backward kernel, which conjugates complex slopes; products
whose "floating" operands exclude complex ones), so on a complex clone with tangents only ops linear in every
argument, affine in their single varying argument, or written for complex run their handler; every other op takes
the exact per-op fallback (``torch.func.jvp``, holomorphic where the op is). Reference: ``torch.func.jvp``, float64.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import jvpreg

D = torch.float64


W = torch.randn(3, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(3))


def c(x):
    return torch.view_as_complex(x.view(4, 3, 2))


CASES = {
    "mul z z": lambda x: torch.view_as_real(c(x) * c(x)),
    "z conj(z)": lambda x: torch.view_as_real(c(x) * c(x).conj()),
    "abs^2": lambda x: c(x).abs() ** 2,
    "angle": lambda x: c(x).angle(),
    "exp": lambda x: torch.view_as_real(c(x).exp()),
    "tanh": lambda x: torch.view_as_real(c(x).tanh()),
    "sigmoid": lambda x: torch.view_as_real(torch.sigmoid(c(x))),
    "sin cos": lambda x: torch.view_as_real(c(x).sin() * c(x).cos()),
    "div": lambda x: torch.view_as_real(c(x) / (c(x).flip(0) + 3)),
    "sqrt log": lambda x: torch.view_as_real((c(x) + 3).sqrt() + (c(x) + 3).log()),
    "pow": lambda x: torch.view_as_real(c(x) ** 2 + (c(x) + 3) ** c(x)),
    "matmul einsum": lambda x: torch.view_as_real(c(x) @ c(x).T + torch.einsum("ij,kj->ik", c(x), c(x))),
    "products with a complex weight": lambda x: torch.view_as_real(
        c(x) @ W + torch.einsum("bi,io->bo", c(x), W) + torch.mm(c(x), W) + torch.bmm(c(x)[None], W[None])[0]
        + torch.tensordot(c(x), W, dims=1) + torch.mv(W.T, c(x)[0])[None] + (W.T @ c(x).T).T),
    "addcmul": lambda x: torch.view_as_real(torch.addcmul(c(x), c(x), c(x).flip(0), value=2)),
    "prod cumprod": lambda x: torch.view_as_real(c(x).prod(1)[:, None] + c(x).cumprod(1)),
    "cat where": lambda x: torch.view_as_real(torch.cat([torch.where(x[:, ::2] > 0, c(x), 2 * c(x)), c(x) ** 2], 1)),
    "vector_norm vecdot": lambda x: torch.linalg.vector_norm(c(x), dim=1) + torch.linalg.vecdot(c(x), c(x)).real,
    "rfft irfft": lambda x: torch.fft.irfft(torch.fft.rfft(x.tanh(), dim=1) * torch.fft.rfft(x, dim=1), dim=1),
    "fft2 abs": lambda x: torch.fft.fft2(x).abs(),
    "complex polar": lambda x: torch.view_as_real(torch.complex(x[:, :3], x[:, 3:]) ** 2
                                                  + torch.polar(x[:, :3].exp(), x[:, 3:])),
    "real imag": lambda x: c(x).real * c(x).imag + c(x).sgn().real,
}
#: the cases whose complex ops all run their handlers (no per-op fallback): the captured engine records them
CAPTURED = {"abs^2", "products with a complex weight", "fft2 abs"}


@pytest.mark.parametrize("engine", ["eager", "captured"])
@pytest.mark.parametrize("name", list(CASES))
def test_complex_intermediate_is_exact(name: str, engine: str) -> None:
    from conftest import runs_engine

    f = CASES[name]
    torch.manual_seed(0)
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)
    want = torch.func.jvp(f, (x,), (u,))
    # the per-op fallback runs eagerly only: a case that reaches it is refused by the captured engine, which says so
    refused = "has no clone rule and its exact per-op fallback" if engine != "eager" and name not in CAPTURED else ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's and the captured engine's notices
        with runs_engine(engine, calls=2, refused=refused):
            for _ in range(2):  # captured: the capture, then the replay
                got = jvpreg.jvp(f, (x,), (u,), engine=engine)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_linear_ops_on_complex_clones_keep_their_handlers(recwarn) -> None:
    """Shape ops, sums, FFTs, add, cat, products with a constant: no fallback (and no fallback warning) on a complex
    intermediate."""
    from jvpreg.clone.eager import dispatch

    dispatch.WARNED_FALLBACKS.clear()
    torch.manual_seed(0)
    x, u = torch.randn(4, 6, dtype=D), torch.randn(4, 6, dtype=D)

    def f(x):
        z = torch.fft.rfft(x, dim=1)
        z = torch.cat([z, z.flip(0)], 1) + 2 * z.repeat(1, 2) - z.conj().repeat(1, 2)
        z = z[:, :3] @ W + torch.einsum("bi,io->bo", z[:, 3:6], W)  # affine in the one varying operand
        return torch.view_as_real(z.sum(0)).reshape(-1)

    torch.testing.assert_close(jvpreg.jvp(f, (x,), (u,)), torch.func.jvp(f, (x,), (u,)), rtol=1e-12, atol=1e-12)
    assert not [w for w in recwarn if issubclass(w.category, dispatch.JVPFallbackWarning)]
