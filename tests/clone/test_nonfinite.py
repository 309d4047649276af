"""Non-finite primal values in the difference form: -inf masks as transformers write them.

Convention (``jvpreg.clone.tensor.block_delta``): an infinity shared by every block is a constant with
zero tangent, never ``inf - inf = NaN``; tangents at finite outputs are exact, at non-finite outputs 0
or NaN. Each pattern is compared with ``torch.func.jvp`` in float64.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import jvpreg
from jvpreg.clone.sweep import mismatch

D = torch.float64
INF = float("inf")


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def causal_attention(x):
    """Hand-written causal self-attention (the pattern that gave 64 of 80 NaN tangents)."""
    q, k, v = x * 1.5, x.flip(-1), x.tanh()
    s = (q @ k.transpose(-2, -1)) / 2.0
    s = s.masked_fill(causal(x.shape[-2]), -INF)
    return s.softmax(-1) @ v


def additive_mask(x):
    m = torch.zeros(x.shape[-2], x.shape[-2], dtype=D).masked_fill(causal(x.shape[-2]), -INF)
    return torch.softmax(x @ x.transpose(-2, -1) + m, dim=-1)


def where_mask(x):
    return torch.where(causal(x.shape[-1]), torch.tensor(-INF, dtype=D), x).log_softmax(-1)


PATTERNS = {
    "causal-attention": causal_attention,
    "additive-mask-softmax": additive_mask,
    "where-mask-log_softmax": where_mask,
    "masked-softmin": lambda x: F.softmin(x.masked_fill(causal(x.shape[-1]), INF), -1),
    "masked-logsumexp": lambda x: x.masked_fill(causal(x.shape[-1]), -INF).logsumexp(-1),
    "masked-amax": lambda x: x.masked_fill(causal(x.shape[-1]), -INF).amax(-1),
    "masked-amin": lambda x: x.masked_fill(causal(x.shape[-1]), INF).amin(-1),
    "masked-max-dim": lambda x: x.masked_fill(causal(x.shape[-1]), -INF).max(-1).values,
    "safe_softmax": lambda x: torch.ops.aten._safe_softmax(x.masked_fill(causal(x.shape[-1]), -INF), -1),
    "fully-masked-row-safe_softmax": lambda x: torch.ops.aten._safe_softmax(x.masked_fill(x.new_ones(
        x.shape[-1], x.shape[-1], dtype=torch.bool).tril(-3).logical_not(), -INF), -1),
    "sdpa-float-mask": lambda x: F.scaled_dot_product_attention(
        x, x, x, attn_mask=torch.zeros(5, 5, dtype=D).masked_fill(causal(5), -INF)),
    "masked-output": lambda x: x.sin().masked_fill(causal(x.shape[-1]), -INF),
    # normalisations take plain block differences: an infinite entry makes its whole row NaN, as in torch.func
    "layer_norm-inf-entry": lambda x: F.layer_norm(x.masked_fill(causal(x.shape[-1]) & (x > 0.5), INF), (5,)),
    "batch_norm-inf-entry": lambda x: F.batch_norm(x.masked_fill(causal(x.shape[-1]) & (x > 0.5), -INF), None, None,
                                                   training=True),
    "group_norm-inf-entry": lambda x: F.group_norm(x.masked_fill(causal(x.shape[-1]) & (x > 0.5), INF), 1),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_inf_masks_give_exact_tangents(name):
    f = PATTERNS[name]
    torch.manual_seed(0)
    x, u = torch.randn(2, 5, 5, dtype=D), torch.randn(2, 5, 5, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y, t = jvpreg.jvp(f, (x,), (u,))
    with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no forward AD
        ry, rt = torch.func.jvp(f, (x,), (u,))
    assert not (bad := mismatch(y, ry, ry, "primal") or mismatch(t, rt, ry, "tangent")), bad
    fin = torch.isfinite(ry)
    assert torch.isfinite(t[fin]).all(), "NaN/inf tangent where the output is finite"


def test_inf_mask_output_has_zero_tangent_and_batched_tangents():
    """A -inf constant in the output: tangent 0 there (not NaN), for every tangent of a batch."""
    x, U = torch.randn(4, 4, dtype=D), torch.randn(3, 4, 4, dtype=D)
    y, T = jvpreg.jvp(lambda z: z.masked_fill(causal(4), -INF), (x,), (U,), batched_tangents=True)
    assert torch.equal(T[:, causal(4)], torch.zeros_like(T[:, causal(4)]))
    assert torch.equal(T[:, ~causal(4)], U[:, ~causal(4)])
