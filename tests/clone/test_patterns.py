"""Patterns from real code that used to crash, refuse or be silently wrong (issue 11), against torch.func; and
user code op by op (keywords, masks, data-dependent shapes, values read in Python, losses) on both engines.

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
from op_sweep import mismatch

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


# ----------------------------------------------------------------------------- user code, op by op (both engines)

W6 = torch.randn(6, 6, dtype=D, generator=torch.Generator().manual_seed(5))
EMB = torch.randn(10, 6, dtype=D, generator=torch.Generator().manual_seed(6))

#: Keyword-heavy functional calls, masks and data-dependent shapes, values read in Python, losses, pooling and
#: attention variants, on a (4, 6) input: each the way user code writes it.
USER_CODE = {
    "softmax dtype": lambda x: F.softmax(x, dim=-1, dtype=torch.float64),
    "sum dtype kw": lambda x: x.sum(dim=1, keepdim=True, dtype=torch.float64),
    "to f32 back": lambda x: x.to(torch.float32).to(D) * 1.0,
    "einsum ellipsis": lambda x: torch.einsum("...i,ij->...j", x, W6).tanh(),
    "interp": lambda x: F.interpolate(x.view(1, 4, 6), scale_factor=2.0, mode="linear", align_corners=True),
    "pad reflect": lambda x: F.pad(x.view(1, 4, 6), (2, 2), mode="reflect"),
    "normalize": lambda x: F.normalize(x, dim=1, p=3.0),
    "layer_norm nw": lambda x: F.layer_norm(x, (6,)),
    "var corr0": lambda x: x.var(dim=1, correction=0),
    "std unbiased kw": lambda x: x.std(1, unbiased=False),
    "linalg norm ord": lambda x: torch.linalg.norm(x, ord=3, dim=1),
    "matrix norm nuc": lambda x: torch.linalg.matrix_norm(x, ord="nuc"),
    "masked_select": lambda x: x.masked_select(x > 0).exp(),
    "nonzero index": lambda x: x[torch.nonzero(x[:, 0] > 0).squeeze(1)] ** 2,
    "argmax gather": lambda x: x.gather(1, x.argmax(1, keepdim=True)),
    "repeat_interleave t": lambda x: x.repeat_interleave(torch.tensor([1, 2, 0, 3]), dim=0),
    "roll": lambda x: torch.roll(x, shifts=(1, -2), dims=(0, 1)) * x,
    "rot90": lambda x: torch.rot90(x.view(2, 2, 6), 1, (0, 1)),
    "embedding pad": lambda x: F.embedding(torch.tensor([1, 0, 3]), EMB * x[0, 0], padding_idx=0),
    "rfft abs": lambda x: torch.fft.rfft(x, dim=1).abs(),
    "view_as_complex": lambda x: torch.view_as_real(torch.view_as_complex(x.view(4, 3, 2)) ** 2),
    "detach": lambda x: x * x.detach(),
    "data": lambda x: x * x.data,
    "item scale": lambda x: x / x.abs().max().item(),
    "value branch": lambda x: x.sin() if x.sum() > 0 else x.cos(),
    "tolist": lambda x: x * sum(x[0].tolist()),
    "clamp tensor": lambda x: torch.clamp(x, min=torch.zeros(6, dtype=D), max=x[0]),
    "cummin": lambda x: torch.cummin(x, dim=1).values,
    "logcumsumexp": lambda x: torch.logcumsumexp(x, dim=1),
    "kthvalue": lambda x: torch.kthvalue(x, 2, dim=1).values,
    "median dim": lambda x: x.median(dim=1).values,
    "nanmean": lambda x: torch.where(x > 1, float("nan"), x).nanmean(1),
    "amax multi": lambda x: x.amax(dim=(0, 1)),
    "unique consec": lambda x: x * torch.unique(torch.tensor([1., 1., 2.], dtype=D)).sum(),
    "bmm baddbmm": lambda x: torch.baddbmm(x.view(2, 2, 6), x.view(2, 2, 6), W6.expand(2, 6, 6), beta=0.5, alpha=2.0),
    "lerp tensor w": lambda x: torch.lerp(x, x.exp(), x.sigmoid()),
    "polar": lambda x: torch.view_as_real(torch.polar(x.abs() + 1, x)),
    "cross": lambda x: torch.linalg.cross(x[:, :3], x[:, 3:]),
    "trace diag": lambda x: torch.trace(x[:, :4] @ x[:, :4].T) * torch.diag(x[:, :4]),
    "tril_ triu": lambda x: (x @ x.T).tril(-1) + (x @ x.T).triu(1).t(),
    "det inv": lambda x: torch.linalg.inv(x[:, :4] + 4 * torch.eye(4, dtype=D))
    * torch.det(x[:, :4] + 4 * torch.eye(4, dtype=D)),
    "solve": lambda x: torch.linalg.solve(x[:, :4] @ x[:, :4].T + torch.eye(4, dtype=D), x),
    "sigmoid_ view": lambda x: (lambda y: (y[:, ::2].sigmoid_(), y)[1])(x.clone()),
    "flatten unflatten": lambda x: x.flatten().unflatten(0, (2, 12)).softmax(-1),
    "index_add": lambda x: torch.zeros(2, 6, dtype=D).index_add(0, torch.tensor([0, 1, 0, 1]), x, alpha=2.0),
    "index_copy": lambda x: x.index_copy(0, torch.tensor([2, 0]), x[:2].exp()),
    "index_fill": lambda x: x.index_fill(1, torch.tensor([1, 3]), -1.0) * x,
    "take_along": lambda x: torch.take_along_dim(x, x.argsort(1), dim=1),
    "where scalar other": lambda x: torch.where(x > 0, 2.0, x ** 2),
    "F.gelu tanh": lambda x: F.gelu(x, approximate="tanh"),
    "F.elu alpha": lambda x: F.elu(x, alpha=0.3),
    "F.leaky slope kw": lambda x: F.leaky_relu(x, negative_slope=0.2),
    "F.softplus beta": lambda x: F.softplus(x, beta=2.0, threshold=1.0),
    "F.hardtanh kw": lambda x: F.hardtanh(x, min_val=-0.3, max_val=0.4),
    "F.threshold": lambda x: F.threshold(x, 0.1, -2.0),
    "F.rrelu eval": lambda x: F.rrelu(x, training=False),
    "F.glu": lambda x: F.glu(x, dim=1),
    "F.logsigmoid": lambda x: F.logsigmoid(x),
    "F.celu": lambda x: F.celu(x, alpha=0.5),
    "F.prelu": lambda x: F.prelu(x, torch.tensor([0.1], dtype=D)),
    "F.mish": lambda x: F.mish(x),
    "F.silu": lambda x: F.silu(x),
    "F.softmin": lambda x: F.softmin(x, dim=0),
    "F.cosine_sim": lambda x: F.cosine_similarity(x, x.flip(0), dim=1),
    "F.pairwise": lambda x: F.pairwise_distance(x, x.flip(0), p=1.5),
    "F.mse none": lambda x: F.mse_loss(x, x.flip(0) ** 2, reduction="none"),
    "F.huber": lambda x: F.huber_loss(x, torch.zeros_like(x), delta=0.5),
    "F.kl": lambda x: F.kl_div(F.log_softmax(x, 1), F.softmax(x.flip(0), 1), reduction="batchmean"),
    "F.ce label smooth": lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2, 3]), label_smoothing=0.1),
    "F.ce probs": lambda x: F.cross_entropy(x, F.softmax(x.flip(0), 1)),
    "F.nll ignore": lambda x: F.nll_loss(F.log_softmax(x, 1), torch.tensor([0, -100, 2, 3])),
    "F.bce": lambda x: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(x.flip(0))),
    "F.unfold": lambda x: F.unfold(x.view(1, 1, 4, 6), kernel_size=2, stride=1),
    "F.fold": lambda x: F.fold(x.view(1, 4, 6), output_size=(3, 4), kernel_size=2),
    "F.pixel_shuffle": lambda x: F.pixel_shuffle(x.view(1, 4, 2, 3), 2),
    "F.avgpool ceil": lambda x: F.avg_pool1d(x.view(1, 4, 6), 4, stride=3, ceil_mode=True, count_include_pad=False),
    "F.maxpool idx": lambda x: F.max_pool1d(x.view(1, 4, 6), 2, return_indices=True)[0],
    "F.lppool": lambda x: F.lp_pool1d(x.view(1, 4, 6).abs() + 0.1, 2.0, 2),
    "F.adaptive max": lambda x: F.adaptive_max_pool1d(x.view(1, 4, 6), 4),
    "F.local_response": lambda x: F.local_response_norm(x.view(1, 4, 6), 3),
    "F.group_norm": lambda x: F.group_norm(x.view(2, 4, 3), 2),
    "F.instance_norm": lambda x: F.instance_norm(x.view(2, 2, 6)),
    "F.rms_norm": lambda x: F.rms_norm(x, (6,)),
    "F.sdpa causal": lambda x: F.scaled_dot_product_attention(*[x.view(1, 4, 6)] * 3, is_causal=True),
    "F.sdpa mask": lambda x: F.scaled_dot_product_attention(
        *[x.view(1, 4, 6)] * 3, attn_mask=torch.tensor([[True, False, True, True]] * 4)),
    "F.sdpa scale": lambda x: F.scaled_dot_product_attention(*[x.view(1, 4, 6)] * 3, scale=0.3),
    "F.sdpa all-masked row": lambda x: F.scaled_dot_product_attention(
        *[x.view(1, 4, 6)] * 3, attn_mask=torch.tensor([[False] * 4] + [[True] * 4] * 3)),
    "F.one_hot mul": lambda x: x * F.one_hot(torch.tensor([0, 5, 2, 1]), 6).to(D),
    "addmm-beta-alpha": lambda x: torch.addmm(x[:4, :4], x[:4], W6[:, :4], beta=0.3, alpha=1.7),
    "where condition only": lambda x: x[torch.where(x[:, 0] > 0)[0]] ** 2,
    "where condition 2-d": lambda x: (lambda rows, cols: x[rows, cols].exp())(*torch.where(x > 0)),
    "mixture of experts": lambda x: _mixture_of_experts(x),
}


def _mixture_of_experts(x: torch.Tensor) -> torch.Tensor:
    """Top-2 routing over 3 experts as Hugging Face's Mixtral writes it: ``one_hot`` of the chosen experts,
    ``torch.where(mask)`` for each expert's tokens, the renormalised router weights, ``index_add_``."""
    probs = F.softmax(x @ W6[:, :3], dim=-1)
    top, chosen = torch.topk(probs, 2, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    mask = F.one_hot(chosen, num_classes=3).permute(2, 1, 0)
    for e in range(3):
        slot, tokens = torch.where(mask[e])
        h = torch.tanh(x[tokens] @ W6[e:e + 3].T @ W6[:3])
        out.index_add_(0, tokens, h * top[tokens, slot, None])
    return out


#: User code that reaches an op with no clone rule: its exact per-op fallback (torch.func.jvp) runs eagerly only, so
#: the captured engine refuses the capture and says so (a JVPCaptureWarning); every other case runs a program.
FALLBACK_ONLY = {"linalg norm ord", "matrix norm nuc", "view_as_complex", "cummin", "logcumsumexp", "kthvalue",
                 "median dim", "nanmean", "lerp tensor w", "polar", "cross", "det inv", "solve", "F.rrelu eval",
                 "F.cosine_sim", "F.pairwise", "F.kl", "F.ce label smooth", "F.ce probs", "F.bce"}


@pytest.mark.parametrize("engine", ["eager", pytest.param("captured", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(USER_CODE))
def test_user_code_matches_the_reference(name, engine):
    from conftest import reference_jvp, runs_engine
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = USER_CODE[name]
    x = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(0))
    u = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(1))
    refused = "has no clone rule and its exact per-op fallback" if engine != "eager" and name in FALLBACK_ONLY else ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with runs_engine(engine, calls=2, refused=refused):
            for _ in range(2):  # captured: the capture, then the replay
                y, t = jvpreg.jvp(f, (x.clone(),), (u,), engine=engine)
        with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention has no forward AD
            ry, rt = reference_jvp(f, x.clone(), u)
    assert not (bad := mismatch(y, ry, ry, "primal") or mismatch(t, rt, ry, "tangent")), bad
