"""Jacobian analysis from fast JVPs (paper §5): spectra, norm/trace estimators, per-region affine maps.

* :func:`top_singular_values` — top-k singular triplets of each per-sample Jacobian (block power
  iteration on ``JᵀJ`` with Rayleigh–Ritz: clone JVPs + batched VJPs);
* :func:`top_eigenvalues` — dominant eigenvalues of square Jacobians (autoencoders, UNets), JVPs only;
* :func:`frobenius_norm`, :func:`trace` — Hutchinson / Hutch++ estimates with standard errors;
* :func:`affine_map`, :func:`region_check` — exact ``(A_ω, b_ω)`` of piecewise-affine networks;
* :func:`as_linear_operator` — one sample's Jacobian as a scipy ``LinearOperator``.

Every routine works on a batch ``x`` of shape ``(B, *in_shape)`` and the per-sample Jacobians
``J_i = ∂f(x)[i] / ∂x[i]``; that is only meaningful when the model treats samples independently,
i.e. in eval mode (see :mod:`jvpreg.analysis._jacobian` for the layout and the engines).
Only torch is needed to import this package (scipy is imported by :func:`as_linear_operator`).
"""
from ._jacobian import ENGINES, ConvergenceWarning, PerSampleJacobian
from .affine import AffineMap, RegionCheck, affine_map, region_check
from .estimators import METHODS, Estimate, FrobeniusEstimate, frobenius_norm, trace
from .linop import as_linear_operator
from .spectral import EigenResult, SpectralResult, top_eigenvalues, top_singular_values

__all__ = [
    "ENGINES", "METHODS", "AffineMap", "ConvergenceWarning", "EigenResult", "Estimate", "FrobeniusEstimate",
    "PerSampleJacobian", "RegionCheck", "SpectralResult", "affine_map", "as_linear_operator", "frobenius_norm",
    "region_check", "top_eigenvalues", "top_singular_values", "trace",
]
