"""Convolutions and the other batch ops affine in their input: pooling by averaging, resampling, pixel shuffles,
folds, sampling grids.

An op that treats dim 0 as a batch runs once on the merged ``(K*B, ...)`` batch, the paper's single concatenated
forward; a convolution's weight tangent takes the difference form ``conv(z_j, W_0, b_0) + conv(a, W_j - W_0,
b_j - b_0)`` (:func:`jvpreg.clone.rules.kinds.linear`, ``weighted``). ``grid_sample`` is linear in its input for a
fixed grid, which carries its own batch dim: every block through the op, or the exact fallback where the grid
comes from the batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jvpreg.clone.rules.kinds import linear

for _n in (1, 2, 3):
    linear(getattr(F, f"conv{_n}d"), getattr(torch, f"conv{_n}d"), getattr(F, f"conv_transpose{_n}d"),
           batch_dims=_n + 2, weighted=True)
    linear(getattr(F, f"avg_pool{_n}d"), getattr(F, f"adaptive_avg_pool{_n}d"), batch_dims=_n + 2)
linear(torch.avg_pool1d, torch.adaptive_avg_pool1d, batch_dims=3)
linear(F.pixel_shuffle, F.pixel_unshuffle, F.unfold, F.channel_shuffle, batch_dims=4)
linear(F.fold, batch_dims=3)
linear(F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear, batch_dims=-1)  # the input's own rank
linear(F.grid_sample, fixed=("grid",))
linear(F.affine_grid)
