"""Max-type selections: argmax indices come from the primal block, every block is gathered there.

``maxpool(z)[i] = z[argmax_a(i)]`` — a fixed selection, hence linear in ``z``. Ties follow the
kernel's own index choice (the same index its backward and torch.func use). Full and
``amax``/``amin`` reductions split ties evenly (torch's forward-mode convention).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jvpreg.clone.core.registry import maybe
from jvpreg.clone.core.tensor import is_clone, neg_dim
from jvpreg.clone.eager.dispatch import fallback
from jvpreg.clone.rules.blocks import assemble, primal, split
from jvpreg.clone.rules.cpa import extremum
from jvpreg.clone.rules.kinds import register_rule

T = torch.Tensor


def gather_blocks(x: torch.Tensor, out_a: torch.Tensor, idx: torch.Tensor, nsp: int) -> torch.Tensor:
    """Stack ``out_a`` with every tangent block gathered at the primal's flat spatial indices."""
    _, b = split(x, differences=False)
    k1 = b.shape[0]
    src = b.flatten(-nsp) if nsp > 1 else b
    ind = idx.flatten(-nsp) if nsp > 1 else idx
    ind = ind.unsqueeze(0).expand(k1, *ind.shape)
    got = src.gather(-1, ind).reshape(k1, *out_a.shape)
    return assemble(out_a, blocks=got)


def _max_pool_rule(nsp: int):
    with_idx = getattr(F, f"max_pool{nsp}d_with_indices")

    def rule(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        out_a, idx = with_idx(primal(input), kernel_size, stride, padding, dilation, ceil_mode, return_indices=True)
        out = gather_blocks(input, out_a, idx, nsp)
        return (out, assemble(idx, k=out.shape[0])) if return_indices else out

    rule.__name__ = rule.__qualname__ = f"max_pool{nsp}d"
    rule.__doc__ = f"max_pool{nsp}d(z) = z gathered at argmax(a) (indices from the primal block)."
    return rule


def _adaptive_max_rule(nsp: int):
    with_idx = getattr(F, f"adaptive_max_pool{nsp}d_with_indices")

    def rule(input, output_size, return_indices=False):
        out_a, idx = with_idx(primal(input), output_size, return_indices=True)
        out = gather_blocks(input, out_a, idx, nsp)
        return (out, assemble(idx, k=out.shape[0])) if return_indices else out

    rule.__name__ = rule.__qualname__ = f"adaptive_max_pool{nsp}d"
    rule.__doc__ = f"adaptive_max_pool{nsp}d(z) = z gathered at argmax(a)."
    return rule


for _n in (1, 2, 3):
    register_rule(
        getattr(F, f"max_pool{_n}d"), getattr(F, f"max_pool{_n}d_with_indices"), maybe(F, f"_max_pool{_n}d"),
        maybe(torch, f"max_pool{_n}d"),
    )(_max_pool_rule(_n))
    register_rule(
        getattr(F, f"adaptive_max_pool{_n}d"), getattr(F, f"adaptive_max_pool{_n}d_with_indices"),
        maybe(F, f"_adaptive_max_pool{_n}d"),
    )(_adaptive_max_rule(_n))


def _max_min(input, dim=None, keepdim=False, *, op):
    """torch.max/min: over a dim -> (values gathered at the primal argmax, indices);
    full reduction -> mean of the tied entries; with a tensor second argument -> maximum/minimum."""
    if torch.is_tensor(dim):  # binary form max(x, y)
        return extremum(input, dim, torch.maximum if op is torch.max else torch.minimum)
    if not is_clone(input):
        return fallback(op, (input,) + (() if dim is None else (dim, keepdim)), {})
    a = primal(input)
    ret = torch.return_types.max if op is torch.max else torch.return_types.min
    if dim is None:
        return _even_ties(input, op(a), dims=None, keepdim=False)
    if a.dim() == 0:  # over the only "dim" of a scalar: the value itself, index 0
        values, indices = op(a, dim, keepdim)
        return ret((assemble(every_block=input.clone()), assemble(indices, k=input.shape[0])))
    values, indices = op(a, dim, keepdim)
    nd = neg_dim(dim, a.dim())
    ind = indices if keepdim else indices.unsqueeze(nd)
    _, blocks = split(input, differences=False)
    got = blocks.gather(nd, ind.unsqueeze(0).expand(blocks.shape[0], *ind.shape))
    if not keepdim:
        got = got.squeeze(nd)
    vals = assemble(values, blocks=got)
    return ret((vals, assemble(indices, k=vals.shape[0])))


def _even_ties(x, out_a, dims, keepdim):
    """Tangent of amax/amin: mean of the tangent over the entries tied with the extremum."""
    a, d = split(x)
    if dims is None:
        mask = (a == out_a).to(a.dtype)
        return assemble(out_a, (d * mask).reshape(d.shape[0], -1).sum(1) / mask.sum())
    nds = tuple(neg_dim(nd, a.dim()) for nd in dims)
    ref = out_a if keepdim else _unsqueeze_all(out_a, nds, a.dim())
    mask = (a == ref).to(a.dtype)
    return assemble(out_a, (d * mask).sum(nds, keepdim=keepdim) / mask.sum(nds, keepdim=keepdim))


def _unsqueeze_all(t, nds, ndim):
    for d in sorted(nd + ndim for nd in nds):
        t = t.unsqueeze(d)
    return t


@register_rule(torch.max, T.max, inplace_kwarg=None)
def max(input, dim=None, keepdim=False):
    return _max_min(input, dim, keepdim, op=torch.max)


@register_rule(torch.min, T.min, inplace_kwarg=None)
def min(input, dim=None, keepdim=False):
    return _max_min(input, dim, keepdim, op=torch.min)


def _amax_amin(op):
    def rule(input, dim=(), keepdim=False):
        a = primal(input)
        out_a = op(a, dim, keepdim)
        if a.dim() == 0:  # a scalar is its own extremum
            return assemble(every_block=input.clone())
        dims = None if dim in ((), [], None) else ((dim,) if isinstance(dim, int) else tuple(dim))
        if dims is None:
            return _even_ties(input, out_a, None, False) if not keepdim else _keep_full(input, out_a)
        return _even_ties(input, out_a, dims, keepdim)

    rule.__name__ = rule.__qualname__ = op.__name__
    rule.__doc__ = f"{op.__name__}(z): the mean of the tangent over the entries tied with the primal's extremum."
    return rule


def _keep_full(x, out_a):
    flat = _even_ties(x, out_a.reshape(()), None, False)
    return flat.reshape(flat.shape[0], *out_a.shape)


register_rule(torch.amax, T.amax, inplace_kwarg=None)(_amax_amin(torch.amax))
register_rule(torch.amin, T.amin, inplace_kwarg=None)(_amax_amin(torch.amin))
