"""Attention: scaled dot-product attention linearised at the primal block; MultiheadAttention decomposed.

With ``S = q k^T * scale + mask``, ``P = softmax(S)``, ``O = P v`` (dropout mask M drawn once):

    dS = (dq k^T + q dk^T) * scale (+ d mask),   dP = P * (dS - sum(P * dS)),   dO = (dP * M) v + (P * M) dv

Fused kernels hide P, so the tangent is computed with explicit products (P is materialised once
for the primal block; :func:`jvpreg.clone.rules.kernels.linearised_attention`). Under autograd, where ``P`` is large
(:func:`jvpreg.clone.rules.kernels.attention_recomputed`), it runs as one operator that keeps only its inputs and
recomputes ``P``, ``dS`` and ``dP`` in the backward: no ``L x S`` tensor kept, as fused attention keeps none (and
the recomputed ones live for a chunk of the batch at a time:
:data:`jvpreg.clone.rules.kernels.ATTENTION_BACKWARD_CHUNK_NUMEL`).
Block j of the output is ``(P M) z_j + (dP_j M) v`` with ``z_j = v + dv_j`` the value's block: one product of
``P M`` with every value block at once, plus ``dP_j`` times the primal value.
``F.multi_head_attention_forward`` is run op by op on the clone batch (its projections, reshapes
and the attention above each go through their own rules); self-attention through the packed projection without
masks or weights (a ViT's or a TransformerEncoderLayer's call) takes its heads as views of one projection in the
input's batch-major layout, two copies fewer (:func:`_lean_self_attention`).
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from jvpreg.clone.core.tensor import is_clone, raw, storage_bytes, varies, wrap
from jvpreg.clone.eager.dispatch import without_torch_function_guard
from jvpreg.clone.rules import kernels
from jvpreg.clone.rules.blocks import count, primal, split, tangents
from jvpreg.clone.rules.kinds import composite, register_rule


def _repeat_kv(t, n_rep):
    return t if n_rep == 1 or t is None else t.repeat_interleave(n_rep, dim=-3)


def _owned(t):
    """``t``, or under autograd a copy of it when it is a view into a larger tensor (the value blocks of a packed
    q/k/v projection): what a product saves for backward then keeps only these blocks alive."""
    if torch.is_grad_enabled() and t.requires_grad and storage_bytes(t) > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _one_rank(*ts):
    """``ts`` with their logical shapes left-padded with 1s to one rank: SDPA broadcasts its batch dims (a 3-d query
    against 4-d keys), and a tangent's block dim must never meet a batch dim of another operand."""
    nd = max(t.dim() - is_clone(t) for t in ts if t is not None)
    out = []
    for t in ts:
        pad = 0 if t is None else nd - (t.dim() - is_clone(t))
        if pad and is_clone(t):  # (K, 1.., *logical)
            t = wrap(raw(t).reshape(t.shape[0], *([1] * pad), *t.shape[1:]), state=t._jvp_state)
        elif pad:
            t = t.reshape(*([1] * pad), *t.shape)
        out.append(t)
    return out


@register_rule(F.scaled_dot_product_attention)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """SDPA linearised at the primal block (formula in the module docstring)."""
    query, key, value, attn_mask = _one_rank(query, key, value, attn_mask)
    q, k = (primal(t, kept=True, memory_format=torch.contiguous_format) for t in (query, key))  # products' layout
    dq, dk, dm = tangents(query), tangents(key), tangents(attn_mask)
    kk = count(query, key, value, attn_mask)
    vary = varies(value)
    if vary:  # the product with every value block keeps them for backward: v is a view of them
        value = _owned(value)
        v, _ = split(value, differences=False)
    else:
        v = primal(value, kept=True)
    m = primal(attn_mask)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n_rep = q.shape[-3] // k.shape[-3] if enable_gqa and q.dim() >= 3 else 1
    k, v, dk = (_repeat_kv(t, n_rep) for t in (k, v, dk))
    blocks = _repeat_kv(value, n_rep) if vary else None
    if dropout_p == 0 and dm is None and kernels.attention_recomputed(query if is_clone(query) else value, q, k):
        args = [None if t is None else raw(t) for t in (q, k, v, blocks, dq, dk, m)]
        return kernels.attention_blocks(*args, sc, is_causal, kk)
    p = kernels.attention_probs(q, k, m, sc, is_causal, scale_scores=dk is not None and q.requires_grad)
    return kernels.linearised_attention(p, q, k, v, blocks, dq, dk, dm if m is None or m.dtype != torch.bool else None,
                                        dropout_p, sc, kk)


_MHA = without_torch_function_guard(F.multi_head_attention_forward)


_MHA_PARAMS = list(inspect.signature(F.multi_head_attention_forward).parameters)


def _lean_self_attention(a: dict):
    """Packed-projection self-attention without masks, extra keys or weights, in the batch-major layout of its
    input: ``F.multi_head_attention_forward`` reshapes the seq-major projection (a copy) and projects a transposed
    input (another); here the heads are views of one projection. ``None`` where the call is not that case."""
    q = a["query"]
    if (q.dim() != 3 or a["key"] is not q or a["value"] is not q or a["in_proj_weight"] is None
            or a.get("use_separate_proj_weight") or a.get("bias_k") is not None or a.get("bias_v") is not None
            or a.get("add_zero_attn") or a.get("need_weights", True) or a.get("attn_mask") is not None
            or a.get("key_padding_mask") is not None or a.get("static_k") is not None
            or a.get("static_v") is not None or a.get("is_causal")):
        return None
    heads = a["num_heads"]
    length, batch, dim = q.shape
    if dim != a["embed_dim_to_check"] or dim % heads:
        return None  # torch's path raises its own error
    p = a["dropout_p"] if a.get("training", True) else 0.0
    x = q.transpose(0, 1)                                                   # (N, L, E)
    qkv = F.linear(x, a["in_proj_weight"], a["in_proj_bias"]).unflatten(-1, (3, heads, dim // heads))
    qkv = qkv.permute(2, 0, 3, 1, 4)                                        # (3, N, h, L, e)
    qkv = qkv.contiguous()
    qh, kh, vh = qkv.unbind(0)
    out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=p)
    out = F.linear(out.transpose(1, 2).reshape(batch, length, dim), a["out_proj_weight"], a["out_proj_bias"])
    return out.transpose(0, 1), None


@composite(F.multi_head_attention_forward, own_primal=False)
def multi_head_attention_forward(*args, **kwargs):
    """``F.multi_head_attention_forward`` op by op (projections, reshapes, :func:`scaled_dot_product_attention`), or
    :func:`_lean_self_attention` where it applies."""
    lean = _lean_self_attention(dict(zip(_MHA_PARAMS, args), **kwargs))
    return _MHA(*args, **kwargs) if lean is None else lean
