"""Exact per-region affine maps ``f(z) = A_ω z + b_ω`` of piecewise-affine networks (paper §5).

A network made of affine ops and continuous piecewise-affine nonlinearities (ReLU, leaky ReLU,
max-pool, …) is affine on the region ``ω(x)`` of inputs that share ``x``'s nonlinearity states:
``A_ω = J_f(x) = [J e_1, …, J e_D]`` and ``b_ω = f(x) − A_ω x`` (the paper's ``f_x(0)``: the
network with frozen states evaluated at 0). :func:`affine_map` builds ``A_ω`` column by column
from JVPs along the canonical basis, ``chunk_size`` basis vectors per clone pass of
``(chunk_size + 1)·B`` rows, so it costs ``ceil(D_in / chunk_size)`` forwards.

For a smooth network the same call returns the first-order Taylor map at ``x`` (``A = J_f(x)``,
``b = f(x) − J x``) — exact only at ``x``. :func:`region_check` tells the two apart: it verifies
``f(x + δ) = f(x) + A δ`` for small random ``δ`` that stay in the region.

Per-sample maps assume samples are processed independently (eval mode).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._jacobian import (
    PerSampleJacobian,
    check_engine,
    check_generator,
    check_inputs,
    check_positive_int,
)

__all__ = ["AffineMap", "RegionCheck", "affine_map", "region_check"]


@dataclass
class AffineMap:
    """Per-sample affine maps ``z ↦ A z + b`` (flattened inputs/outputs).

    Attributes:
        A: ``(B, D_out, D_in)`` slope matrices ``A_ω = J_f(x_i)``.
        b: ``(B, D_out)`` offsets ``b_ω = f(x_i) − A_ω x_i``.
        output: ``(B, *out_shape)`` ``f(x)``.
        in_shape, out_shape: per-sample shapes, to reshape flattened vectors.
    """

    A: torch.Tensor
    b: torch.Tensor
    output: torch.Tensor
    in_shape: tuple
    out_shape: tuple

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """``A_i z_i + b_i`` for a batch ``z`` of shape ``(B, *in_shape)``; returns ``(B, *out_shape)``."""
        flat = z.reshape(z.shape[0], -1).to(self.A.dtype)
        return (torch.einsum("boi,bi->bo", self.A, flat) + self.b).reshape(z.shape[0], *self.out_shape)

    def reconstruction_error(self, x: torch.Tensor) -> torch.Tensor:
        """``max |A x + b − f(x)|`` per sample, ``(B,)`` (0 up to rounding by construction of ``b``)."""
        return (self(x) - self.output).reshape(x.shape[0], -1).abs().amax(dim=1)


@dataclass
class RegionCheck:
    """Outcome of :func:`region_check`.

    Attributes:
        error: ``(B,)`` ``max_δ ‖f(x+δ) − f(x) − A δ‖ / ‖A δ‖`` at the final radius.
        radius: ``(B,)`` the ``‖δ‖`` used (absolute), after any halvings.
        passed: ``(B,)`` bool, ``error <= rtol``.
    """

    error: torch.Tensor
    radius: torch.Tensor
    passed: torch.Tensor

    @property
    def all_passed(self) -> bool:
        return bool(self.passed.all())


def affine_map(model: Callable, x: torch.Tensor, *, chunk_size: int = 64, engine: str = "clone") -> AffineMap:
    """The exact ``(A_ω, b_ω)`` of a piecewise-affine network on the region of each sample.

    ``A_ω = [J e_1, …, J e_{D_in}]`` from JVPs along the canonical basis (``chunk_size`` basis
    vectors per pass) and ``b_ω = f(x) − A_ω x``, so ``f(z) = A_ω z + b_ω`` for every ``z`` in
    ``x``'s region (exact for CPA nets; for smooth nets this is the Taylor map at ``x``).

    Args:
        model: callable ``(B, *in_shape) -> (B, *out_shape)`` tensor, in eval mode.
        x: the batch ``(B, *in_shape)``; use float64 for exact-to-rounding maps.
        chunk_size: basis directions per JVP pass; memory holds ``(chunk_size + 1)·B`` rows.
        engine: ``"clone"`` or ``"torch.func"``.

    Returns:
        :class:`AffineMap` with ``A (B, D_out, D_in)``, ``b (B, D_out)`` and ``output = f(x)``.

    Example::

        >>> mlp = build_model("mlp", in_channels=1, num_classes=10, image_size=8).double().eval()
        >>> x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
        >>> amap = affine_map(mlp, x)
        >>> torch.allclose(amap(x), mlp(x))            # f(x) = A x + b
        True
    """
    where = "affine_map(model, x)"
    check_inputs(where, model, x)
    check_positive_int(where, "chunk_size", chunk_size)
    check_engine(where, engine)
    op = PerSampleJacobian(model, x, engine=engine, chunk_size=chunk_size, where=where)
    B, d_in, d_out = op.batch_size, op.d_in, op.d_out
    cols = []
    for start in range(0, d_in, chunk_size):
        stop = min(d_in, start + chunk_size)
        E = torch.zeros(B, stop - start, d_in, dtype=op.dtype, device=op.device)
        idx = torch.arange(start, stop, device=op.device)
        E[:, idx - start, idx] = 1
        cols.append(op.jvp(E))                                            # (B, c, D_out) = columns of A
    A = torch.cat(cols, dim=1).transpose(1, 2).contiguous()               # (B, D_out, D_in)
    out = op.output
    b = out.reshape(B, d_out) - torch.einsum("boi,bi->bo", A, op.x.reshape(B, d_in))
    return AffineMap(A=A, b=b, output=out, in_shape=op.in_shape, out_shape=op.out_shape)


def region_check(model: Callable, x: torch.Tensor, affine: Optional[AffineMap] = None, *, radius: float = 1e-4,
                 n_directions: int = 4, rtol: Optional[float] = None, max_halvings: int = 10,
                 generator: Optional[torch.Generator] = None, chunk_size: int = 64) -> RegionCheck:
    """Check ``f(x + δ) = f(x) + A_ω δ`` for small random ``δ`` (plain forwards of ``model``).

    For each sample, ``n_directions`` random ``δ`` of norm ``radius · ‖x_i‖`` are tried; the relative
    error ``‖f(x+δ) − f(x) − A δ‖ / ‖A δ‖`` must be ``<= rtol``. A sample that fails gets its radius
    halved (up to ``max_halvings`` times), since ``x`` may sit close to a region boundary: a CPA
    net passes once ``δ`` stays in the region, a smooth net's error only shrinks like ``O(‖δ‖)``
    (so it fails unless ``rtol`` is loose). In float32 the difference ``f(x+δ) − f(x)`` loses
    digits as ``δ`` shrinks, hence the dtype-dependent default ``rtol``.

    Args:
        model: the network (eval mode).
        x: the batch ``(B, *in_shape)``.
        affine: a precomputed :func:`affine_map` of ``model`` at ``x`` (computed if ``None``).
        radius: initial ``‖δ‖`` relative to ``‖x_i‖`` (absolute if ``x_i = 0``).
        n_directions: random directions per sample and radius.
        rtol: tolerance; default ``1e-7`` for float64, ``1e-2`` otherwise.
        max_halvings: how often a failing sample's radius may be halved.
        generator: ``torch.Generator`` for the directions.
        chunk_size: forwarded to :func:`affine_map` when ``affine`` is ``None``.

    Returns:
        :class:`RegionCheck` with per-sample ``error``, ``radius``, ``passed``.

    Example::

        >>> region_check(mlp, x, affine_map(mlp, x)).all_passed
        True
    """
    where = "region_check(model, x)"
    check_inputs(where, model, x)
    if not (isinstance(radius, (int, float)) and radius > 0):
        raise ValueError(f"{where}: radius must be a positive number, got {radius!r}.")
    check_positive_int(where, "n_directions", n_directions)
    check_positive_int(where, "max_halvings", max_halvings, minimum=0)
    check_generator(where, generator)
    if affine is None:
        affine = affine_map(model, x, chunk_size=chunk_size)
    elif not isinstance(affine, AffineMap) or affine.A.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: affine must be the AffineMap of model at this x (B={x.shape[0]}).")
    if rtol is None:
        rtol = 1e-7 if x.dtype == torch.float64 else 1e-2
    B = x.shape[0]
    x = x.detach()
    xf = x.reshape(B, -1)
    base = xf.norm(dim=1)
    r = torch.where(base > 0, base * radius, torch.full_like(base, radius))
    error = torch.full((B,), float("inf"), dtype=x.dtype, device=x.device)
    passed = torch.zeros(B, dtype=torch.bool, device=x.device)
    gen_device = generator.device if generator is not None else x.device
    with torch.no_grad():
        y0 = affine.output.reshape(B, -1)
        for attempt in range(max_halvings + 1):
            todo = (~passed).nonzero().squeeze(1)
            if todo.numel() == 0:
                break
            worst = torch.zeros(todo.numel(), dtype=x.dtype, device=x.device)
            for _ in range(n_directions):
                d = torch.randn((todo.numel(), xf.shape[1]), generator=generator, device=gen_device,
                                dtype=x.dtype).to(x.device)
                d = d / d.norm(dim=1, keepdim=True) * r[todo, None]
                y = model((xf[todo] + d).reshape(todo.numel(), *x.shape[1:])).reshape(todo.numel(), -1)
                Ad = torch.einsum("boi,bi->bo", affine.A[todo], d)
                err = (y - y0[todo] - Ad).norm(dim=1) / Ad.norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny)
                worst = torch.maximum(worst, err)
            error[todo] = worst
            ok = worst <= rtol
            passed[todo[ok]] = True
            if attempt < max_halvings:
                r[todo[~ok]] = r[todo[~ok]] / 2
    return RegionCheck(error=error, radius=r, passed=passed)
