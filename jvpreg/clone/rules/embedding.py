"""Embedding with ``max_norm``: the in-place row renormalisation of the weight.

``F.embedding(..., max_norm=m)`` first calls ``torch.embedding_renorm_(weight, idx, m, p)`` under
``no_grad``: the looked-up rows of the weight are rescaled to norm <= m as a side effect that
autograd does not see. PyTorch's derivatives (backward and ``torch.func.jvp``) treat it as a change of
value, not of tangent, so the rule does the same: ``block_j := renorm(a) + (block_j - a)``, the
primal block renormalised exactly as a plain call would, tangents unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jvpreg.clone.core.registry import register_handler, register_op
from jvpreg.clone.core.tensor import is_clone, raw
from jvpreg.clone.eager.dispatch import decomposition, fallback, per_block
from jvpreg.clone.rules.blocks import primal, split
from jvpreg.clone.rules.kinds import composite


@register_handler(torch.embedding_renorm_)
def embedding_renorm_(func, args, kwargs):
    """embedding_renorm_(w, idx, max_norm, norm_type): renormalise the primal rows; tangents unchanged. Written in
    place, block by block (the op's own contract)."""
    weight, rest = args[0], args[1:]
    if not is_clone(weight):  # only the indices come from the batch: they are state, use the primal's
        return func(weight, *[primal(a) for a in rest], **kwargs)
    w = raw(weight)
    with torch.no_grad():
        a, d = split(w)
        _, blocks = split(w, differences=False)
        func(a, primal(rest[0]), *rest[1:], **kwargs)
        blocks.copy_(a + d)
    return weight


@composite(F.embedding, own_primal=False)
def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """F.embedding: a lookup (linear in the weight). With ``max_norm`` and a batch weight the renorm is
    applied to the clone itself (torch renormalises ``weight.detach()``, an alias that a clone's detach,
    a copy, is not)."""
    if max_norm is not None and is_clone(weight):
        with torch.no_grad():
            torch.embedding_renorm_(weight, input.contiguous(), max_norm, norm_type)
        max_norm = None
    return decomposition(F.embedding)(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)


@register_op(torch.embedding)
def embedding_lookup(func, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """torch.embedding(weight, idx) = weight[idx]: linear in the weight, every block looked up alike (a weight
    direction, :func:`jvpreg.jvp_params`); ``padding_idx`` and ``scale_grad_by_freq`` shape the backward of each
    block as of a plain call. Clone indices (state, from the batch) with a plain weight: the exact fallback."""
    args = (weight, indices, padding_idx, scale_grad_by_freq, sparse)
    if not is_clone(weight) or weight._jvp_state or sparse:
        return fallback(func, args, {})
    return per_block(func, args, {})
