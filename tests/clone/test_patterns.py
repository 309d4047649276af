"""Patterns from real code that used to crash, refuse or be silently wrong (issue 11), against torch.func.

Keyword calls (handlers bind by signature), in-place view ops, clones used only for their shape or dtype,
empty tensors, p = 1 dropout, rounding division, tensor attributes with tangents, 0-dim primals and the
false refusals (``_batch_norm_with_update``, ``zero_``, ``embedding(max_norm=...)``).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import jvpreg
from jvpreg.clone.sweep import mismatch

D = torch.float64
C = torch.randn(6, 1, dtype=D, generator=torch.Generator().manual_seed(3))
R = torch.randn(48, dtype=D, generator=torch.Generator().manual_seed(4))

PATTERNS = {
    "narrow-keywords": lambda z: z.narrow(dim=1, start=1, length=3),
    "select-keywords": lambda z: z.select(dim=1, index=2),
    "torch.narrow-keywords": lambda z: torch.narrow(z, dim=1, start=1, length=3),
    "transpose-keywords": lambda z: torch.transpose(z, dim0=0, dim1=2),
    "split-keywords": lambda z: torch.split(z, split_size_or_sections=2, dim=1),
    "cat-keywords": lambda z: torch.cat(tensors=[z, z.sin()], dim=-1),
    "squeeze_": lambda z: z.unsqueeze(0).clone().squeeze_(0),
    "unsqueeze_": lambda z: z.clone().unsqueeze_(1).sin(),
    "transpose_": lambda z: z.clone().transpose_(0, 2).cumsum(0),
    "t_": lambda z: z[0].clone().t_().cumsum(0),
    "as_strided_": lambda z: z.clone().as_strided_((2, 3), (1, 2)),
    "expand_as-shape-only": lambda z: C.expand_as(z[0]) * z[0],
    "view_as-shape-only": lambda z: R.view_as(z) + z,
    "reshape_as-shape-only": lambda z: R.reshape_as(z) * z,
    "to-dtype-template": lambda z: torch.ones(3, dtype=torch.float32).to(z).sum() + z,
    "type_as-template": lambda z: torch.ones(3, dtype=torch.float32).type_as(z).sum() * z,
    "clamp-tensor-bounds-plain-input": lambda z: torch.clamp(torch.zeros(2, 6, 4, dtype=D), min=z),
    "column_stack": lambda z: torch.column_stack([z[0], z[1, :, 0]]),
    "hstack-vstack-dstack": lambda z: (torch.hstack([z[0], z[1]]), torch.vstack([z[0, 0], z[1, 0]]),
                                       torch.dstack([z[0], z[1]])),
    "alpha_dropout-p1": lambda z: F.alpha_dropout(z, 1.0, True),
    "feature_alpha_dropout-p1": lambda z: F.feature_alpha_dropout(z, 1.0, True),
    "group_norm-empty": lambda z: F.group_norm(z[:0], 2),
    "batch_norm-empty": lambda z: F.batch_norm(z[:0], None, None, training=True),
    "cat-empty": lambda z: torch.cat([z.flatten()[:0], z.flatten()[:0]]),
    "zero_": lambda z: z.clone().zero_() + z,
    "torch.zero_": lambda z: torch.zero_(z.clone()) + z,
    "embedding-max_norm-weight": lambda z: F.embedding(torch.tensor([0, 1, 1]), z[0].clone() * 3, max_norm=1.0),
    "div-floor": lambda z: torch.div(z, 0.7, rounding_mode="floor"),
    "div-trunc-tensor": lambda z: z.div(torch.full((4,), 0.3, dtype=D), rounding_mode="trunc"),
    "div_-floor-inplace": lambda z: z.clone().div_(z.detach() + 3, rounding_mode="floor"),
    "H": lambda z: z[0].H,
    "real": lambda z: z.real * 2,
    "batch_norm_with_update": lambda z: torch.ops.aten._batch_norm_with_update(
        z, None, None, torch.zeros(6, dtype=D), torch.ones(6, dtype=D), 0.1, 1e-5)[0],
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_matches_torch_func(name):
    f = PATTERNS[name]
    x = torch.randn(2, 6, 4, dtype=D, generator=torch.Generator().manual_seed(0))
    u = torch.randn(2, 6, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, t = jvpreg.jvp(f, (x.clone(),), (u,))
        ry, rt = torch.func.jvp(f, (x.clone(),), (u,))
    assert not (bad := mismatch(y, ry, ry, "primal") or mismatch(t, rt, ry, "tangent")), bad


@pytest.mark.parametrize("name,f", [("sin", torch.sin), ("sum-exp", lambda z: z.sum() * z.exp()),
                                    ("max", lambda z: torch.max(z, 0).values), ("amax", lambda z: z.amax(0))])
def test_0_dim_primal(name, f):
    x, u = torch.tensor(0.4, dtype=D), torch.tensor(1.7, dtype=D)
    y, t = jvpreg.jvp(f, (x,), (u,))
    ry, rt = torch.func.jvp(f, (x,), (u,))
    assert not (bad := mismatch(y, ry, ry, "primal") or mismatch(t, rt, ry, "tangent")), bad


def test_dropout3d_unbatched_draws_one_value_per_channel():
    """(C, D, H, W) is unbatched for dropout3d: the mask is constant over (D, H, W) of each channel."""
    x = torch.randn(8, 3, 4, 5, dtype=D)
    y, t = jvpreg.jvp(lambda z: F.dropout3d(z, 0.5, True), (x,), (torch.ones_like(x),))
    keep = t.reshape(8, -1)
    torch.testing.assert_close(keep.amax(1), keep.amin(1), msg="mask varies inside a channel")
    assert set(keep.amax(1).round().tolist()) <= {0.0, 2.0}
    torch.testing.assert_close(y, x * t)


def test_inplace_resize_is_a_clear_error():
    with pytest.raises(jvpreg.clone.UnsupportedOpError, match=r"addbmm_ would resize its target from \(1,\)"):
        jvpreg.jvp(lambda z: z.clone().addbmm_(torch.ones(2, 3, 4, dtype=D), torch.ones(2, 4, 5, dtype=D)),
                   (torch.ones(1, dtype=D),), (torch.ones(1, dtype=D),))
