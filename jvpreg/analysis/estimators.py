"""Randomised estimators of ``‖J‖_F`` and ``tr J`` for per-sample Jacobians, from JVPs.

Hutchinson (Hutchinson 1989; Gudmundsson et al. 1995 for the Frobenius norm): for random ``u``
with ``E[u uᵀ] = I`` (Rademacher ``±1`` or standard Gaussian entries),

* ``E ‖J u‖² = ‖J‖_F²`` and ``E uᵀ J u = tr J``;

the estimate is the sample mean of ``n_samples`` draws and its standard error is the sample
standard deviation over ``sqrt(n_samples)``. Rademacher has the smaller variance
(``2(‖M‖_F² − Σ M_ii²)`` vs ``2‖M‖_F²`` for the symmetric ``M`` in the quadratic form).

Hutch++ (Meyer, Musco, Musco & Woodruff, SOSA 2021) spends the ``n_samples`` query vectors in
three parts: a sketch ``S`` of ``s = n_samples // 3`` vectors, ``Q = orth(A S)``, the exact trace
``tr(Qᵀ A Q)`` of the captured top subspace, and Hutchinson with ``g = n_samples − 2s`` vectors
``G`` on the deflated remainder: ``tr A ≈ tr(Qᵀ A Q) + mean_j (P g_j)ᵀ A (P g_j)``,
``P = I − Q Qᵀ``. Since ``tr(Qᵀ A Q) + tr(P A P) = tr A`` for *any* orthonormal ``Q``, the
estimator is unbiased for every sketch; the reported standard error is that of the deflated
Hutchinson part given ``Q`` (the first term has no variance given ``Q``). Cost per sample:

* Frobenius, ``A = JᵀJ``: ``A S`` needs ``s`` JVPs **and** ``s`` VJPs, ``‖J Q‖_F²`` ``s`` JVPs,
  the remainder ``‖J P g_j‖²`` ``g`` JVPs;
* trace, ``A = J`` (square, need not be symmetric): ``Q = orth(J S)``, ``s + s + g`` JVPs, no
  VJP. Meyer et al.'s variance bound is proved for PSD ``A``; for a general ``J`` Hutch++ is still
  unbiased but the reduction is only heuristic (large when ``J`` has a few dominant directions).

All estimates are per sample, shape ``(B,)``, with the per-sample caveat of
:mod:`jvpreg.analysis._jacobian` (eval mode).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from ._jacobian import (
    DISTRIBUTIONS,
    PerSampleJacobian,
    check_engine,
    check_generator,
    check_inputs,
    check_positive_int,
    random_directions,
)

__all__ = ["Estimate", "FrobeniusEstimate", "METHODS", "frobenius_norm", "trace"]

#: Names accepted by ``method=``.
METHODS: tuple[str, ...] = ("hutchinson", "hutch++")


@dataclass
class Estimate:
    """A per-sample estimate with its standard error; unpacks as ``value, stderr = est``.

    Attributes:
        value: ``(B,)`` the estimate.
        stderr: ``(B,)`` its standard error (Hutch++: conditional on the sketch, see module docstring).
        n_samples: query vectors used per sample.
        method: ``"hutchinson"`` or ``"hutch++"``.
    """

    value: torch.Tensor
    stderr: torch.Tensor
    n_samples: int
    method: str

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.value, self.stderr))


@dataclass
class FrobeniusEstimate(Estimate):
    """:class:`Estimate` of ``‖J‖_F`` plus the unbiased squared estimate it comes from.

    ``value = sqrt(squared)`` (slightly biased low, by Jensen) and ``stderr`` is the delta-method
    ``squared_stderr / (2 value)``. Average ``squared``, not ``value``, across estimates.

    Attributes:
        squared: ``(B,)`` unbiased estimate of ``‖J‖_F²``.
        squared_stderr: ``(B,)`` its standard error.
    """

    squared: torch.Tensor = None  # type: ignore[assignment]
    squared_stderr: torch.Tensor = None  # type: ignore[assignment]


def _validate(where, model, x, n_samples, method, distribution, generator, engine, chunk_size):
    check_inputs(where, model, x)
    check_positive_int(where, "n_samples", n_samples, minimum=2)
    if method not in METHODS:
        raise ValueError(f"{where}: method must be one of {METHODS}, got {method!r}.")
    if method == "hutch++" and n_samples < 4:
        raise ValueError(f"{where}: method='hutch++' needs n_samples >= 4 (a third sketches the top subspace, "
                         f"at least 2 estimate the rest), got {n_samples}.")
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"{where}: distribution must be one of {DISTRIBUTIONS}, got {distribution!r}.")
    check_generator(where, generator)
    check_engine(where, engine)
    if chunk_size is not None:
        check_positive_int(where, "chunk_size", chunk_size)


def _mean_stderr(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard error over the last dim of ``(B, n)`` draws."""
    return z.mean(dim=1), z.std(dim=1, unbiased=True) / math.sqrt(z.shape[1])


def _draw(op: PerSampleJacobian, n: int, distribution: str, generator) -> torch.Tensor:
    return random_directions((op.batch_size, n, op.d_in), distribution, dtype=op.dtype, device=op.device,
                             generator=generator)


def _split(n_samples: int) -> tuple[int, int]:
    s = n_samples // 3
    return s, n_samples - 2 * s


def _orth_rows(V: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(V.transpose(1, 2))[0].transpose(1, 2)


def frobenius_norm(model: Callable, x: torch.Tensor, *, n_samples: int = 32, method: str = "hutchinson",
                   distribution: str = "rademacher", generator: Optional[torch.Generator] = None,
                   engine: str = "clone", chunk_size: Optional[int] = None) -> FrobeniusEstimate:
    """Estimate ``‖J_f(x_i)‖_F`` for every sample, with a standard error.

    ``hutchinson``: ``‖J‖_F² ≈ mean_j ‖J u_j‖²`` from ``n_samples`` JVPs (one clone pass of
    ``(n_samples+1)·B`` rows unless ``chunk_size`` splits it). ``hutch++``: Meyer et al. 2021 on
    ``A = JᵀJ`` (adds ``n_samples // 3`` VJPs); much smaller error when a few singular values
    dominate. See the module docstring for the formulas.

    Args:
        model: callable ``(B, *in_shape) -> (B, *out_shape)`` tensor, in eval mode.
        x: the batch ``(B, *in_shape)``.
        n_samples: query vectors per sample (``>= 2``; ``>= 4`` for Hutch++).
        method: ``"hutchinson"`` or ``"hutch++"``.
        distribution: ``"rademacher"`` or ``"gaussian"`` entries of the query vectors.
        generator: ``torch.Generator`` for the query vectors (reproducible estimates).
        engine: ``"clone"`` or ``"torch.func"``.
        chunk_size: at most this many directions per pass.

    Returns:
        :class:`FrobeniusEstimate`: ``value``/``stderr`` for ``‖J‖_F`` and ``squared``/``squared_stderr``
        for ``‖J‖_F²`` (unbiased), each ``(B,)``. ``value, stderr = frobenius_norm(...)`` works.

    Example::

        >>> est = frobenius_norm(model.eval(), x, n_samples=64, generator=torch.Generator().manual_seed(0))
        >>> est.value, est.stderr
    """
    where = "frobenius_norm(model, x)"
    _validate(where, model, x, n_samples, method, distribution, generator, engine, chunk_size)
    op = PerSampleJacobian(model, x, engine=engine, chunk_size=chunk_size, where=where)
    if method == "hutchinson":
        U = _draw(op, n_samples, distribution, generator)
        z = op.jvp(U).pow(2).sum(dim=-1)                                     # (B, n)
        sq, sq_se = _mean_stderr(z)
    else:
        s, g = _split(n_samples)
        S = _draw(op, s, distribution, generator)
        Q = _orth_rows(op.vjp(op.jvp(S)))                                    # orth(JᵀJ S)
        G = _draw(op, g, distribution, generator)
        PG = G - (G @ Q.transpose(1, 2)) @ Q                                 # (I − QQᵀ) g_j
        JQ_JPG = op.jvp(torch.cat([Q, PG], dim=1)).pow(2).sum(dim=-1)        # one pass for both
        head = JQ_JPG[:, :s].sum(dim=1)
        tail, sq_se = _mean_stderr(JQ_JPG[:, s:])
        sq = head + tail
    value = sq.clamp_min(0).sqrt()
    stderr = sq_se / (2 * value.clamp_min(torch.finfo(value.dtype).tiny))
    return FrobeniusEstimate(value=value, stderr=stderr, n_samples=n_samples, method=method, squared=sq,
                             squared_stderr=sq_se)


def trace(model: Callable, x: torch.Tensor, *, n_samples: int = 32, method: str = "hutchinson",
          distribution: str = "rademacher", generator: Optional[torch.Generator] = None, engine: str = "clone",
          chunk_size: Optional[int] = None) -> Estimate:
    """Estimate ``tr J_f(x_i)`` of every square per-sample Jacobian (``D_out == D_in``), JVPs only.

    ``hutchinson``: ``tr J ≈ mean_j u_jᵀ J u_j``; ``hutch++``: Meyer et al. 2021 with
    ``Q = orth(J S)`` (unbiased for any ``J``; the variance bound holds for PSD ``J``). Useful for
    the divergence of autoencoders/UNets (``tr J = ∇·f``).

    Args:
        model, x, n_samples, method, distribution, generator, engine, chunk_size: as in
            :func:`frobenius_norm`.

    Returns:
        :class:`Estimate` with ``value (B,)`` and ``stderr (B,)``; unpacks as ``value, stderr``.

    Raises:
        ValueError: the Jacobian is not square, or bad arguments.

    Example::

        >>> div, se = trace(unet.eval(), x, n_samples=64, method="hutch++")
    """
    where = "trace(model, x)"
    _validate(where, model, x, n_samples, method, distribution, generator, engine, chunk_size)
    op = PerSampleJacobian(model, x, engine=engine, chunk_size=chunk_size, where=where)
    if op.d_out != op.d_in:
        raise ValueError(f"{where}: the trace needs a square Jacobian, but D_out={op.d_out} (output "
                         f"{op.out_shape}) != D_in={op.d_in} (input {op.in_shape}).")
    if method == "hutchinson":
        U = _draw(op, n_samples, distribution, generator)
        z = (op.jvp(U) * U).sum(dim=-1)
        value, stderr = _mean_stderr(z)
    else:
        s, g = _split(n_samples)
        S = _draw(op, s, distribution, generator)
        Q = _orth_rows(op.jvp(S))
        G = _draw(op, g, distribution, generator)
        PG = G - (G @ Q.transpose(1, 2)) @ Q
        W = torch.cat([Q, PG], dim=1)
        z = (op.jvp(W) * W).sum(dim=-1)
        tail, stderr = _mean_stderr(z[:, s:])
        value = z[:, :s].sum(dim=1) + tail
    return Estimate(value=value, stderr=stderr, n_samples=n_samples, method=method)
