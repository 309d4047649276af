"""Dropout, every variant: one random mask, drawn once, applied to every block.

Given its mask the op is affine: ``out_j = m * z_j + c`` (``c = 0`` except alpha dropout),
so the tangent is ``m * u`` and the primal block is a plain dropout of the primal.
Feature variants (dropout1d/2d/3d, feature_alpha_dropout) draw one value per
(sample, channel); which dim is the channel follows torch's rank conventions (dropout1d: batched iff 3-D,
dropout3d: batched iff 5-D, dropout2d and feature_dropout: (N, C, ...) from 3-D up). Outside training the
ops are the identity; with p = 1 every variant outputs zeros (``x * 0``), as torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jvpreg.clone.core.registry import maybe
from jvpreg.clone.rules.blocks import assemble, primal
from jvpreg.clone.rules.kinds import register_rule

_SELU_ALPHA = 1.7580993408473766  # -lambda * alpha of SELU, as in ATen's alpha dropout


def _mask_shape(a: torch.Tensor, feature: bool, batched_ndim: int | None = None) -> tuple:
    if not feature:
        return tuple(a.shape)
    if a.dim() < 2:
        raise ValueError(f"feature dropout needs an input with a channel dim, got shape {tuple(a.shape)}")
    # batched (N, C, *S) or unbatched (C, *S): one draw per channel (per sample)
    if batched_ndim is None:
        lead = 2 if a.dim() >= 3 else 1
    else:
        lead = 2 if a.dim() == batched_ndim else 1
    return tuple(a.shape[:lead]) + (1,) * (a.dim() - lead)


def _apply(x: torch.Tensor, p: float, training: bool, feature: bool, alpha: bool,
           batched_ndim: int | None = None) -> torch.Tensor:
    """The affine map of one draw applied to every block at once."""
    if not training or p == 0:  # torch returns its input itself
        return x
    if p == 1:  # torch: input * 0 for every variant
        return assemble(every_block=x * 0)
    a = primal(x)
    keep = torch.empty(_mask_shape(a, feature, batched_ndim), dtype=a.dtype, device=a.device).bernoulli_(1 - p)
    if not alpha:
        return assemble(every_block=x * (keep / (1 - p)))
    coef = 1.0 / ((_SELU_ALPHA ** 2 * p + 1) * (1 - p)) ** 0.5
    shift = (keep - 1) * _SELU_ALPHA * coef + _SELU_ALPHA * coef * p
    return assemble(every_block=x * (keep * coef) + shift)


@register_rule(F.dropout, torch.dropout, inplace=(maybe(torch, "dropout_"),), inplace_safe=True)
def dropout(input, p=0.5, training=True, inplace=False):
    """dropout(z) = m * z / (1 - p) with one Bernoulli mask m for every block."""
    return _apply(input, p, training, feature=False, alpha=False)


@register_rule(F.dropout2d, torch.feature_dropout, inplace=(maybe(torch, "feature_dropout_"),), inplace_safe=True)
def feature_dropout(input, p=0.5, training=True, inplace=False):
    """dropout2d(z) = m[n, c] * z / (1 - p), one mask value per (sample, channel)."""
    return _apply(input, p, training, feature=True, alpha=False)


@register_rule(F.dropout1d, inplace_safe=True)
def dropout1d(input, p=0.5, training=True, inplace=False):
    """dropout1d: feature dropout of (N, C, L) or unbatched (C, L) inputs."""
    return _apply(input, p, training, feature=True, alpha=False, batched_ndim=3)


@register_rule(F.dropout3d, inplace_safe=True)
def dropout3d(input, p=0.5, training=True, inplace=False):
    """dropout3d: feature dropout of (N, C, D, H, W) or unbatched (C, D, H, W) inputs."""
    return _apply(input, p, training, feature=True, alpha=False, batched_ndim=5)


@register_rule(F.alpha_dropout, torch.alpha_dropout, inplace=(maybe(torch, "alpha_dropout_"),), inplace_safe=True)
def alpha_dropout(input, p=0.5, training=False, inplace=False):
    """alpha_dropout(z) = m c z + (m - 1) alpha c + alpha c p (SELU-preserving affine dropout)."""
    return _apply(input, p, training, feature=False, alpha=True)


@register_rule(F.feature_alpha_dropout, torch.feature_alpha_dropout,
               inplace=(maybe(torch, "feature_alpha_dropout_"),), inplace_safe=True)
def feature_alpha_dropout(input, p=0.5, training=False, inplace=False):
    """feature_alpha_dropout: alpha dropout with one mask value per (sample, channel)."""
    return _apply(input, p, training, feature=True, alpha=True)
