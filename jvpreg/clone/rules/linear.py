"""Ops affine in their clone arguments: sums and differences, fills, linear layers, linear reductions, indexing
with fixed indices, Fourier transforms.

Such an op acts on every block as it does on the primal, so the difference form needs nothing but the right
placement of the block dim (logical dim ``d`` is physical dim ``d + 1``; a constant offset cancels in ``z_j - a``):
:func:`jvpreg.clone.rules.kinds.linear` registers them. ``F.linear`` runs once on the merged ``(K*B, ...)`` batch,
and a weight tangent takes the difference form ``linear(z_j, W_0, b_0) + linear(a, W_j - W_0, b_j - b_0)``.
Convolutions and the other batch ops: :mod:`jvpreg.clone.rules.convolution`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jvpreg.clone.core.registry import COMPLEX_EXACT, maybe, register_handler, register_op
from jvpreg.clone.core.tensor import is_clone, phys_dim, raw, wrap
from jvpreg.clone.eager.dispatch import fallback, state_eval
from jvpreg.clone.eager.writes import write_back
from jvpreg.clone.rules.blocks import assemble, count
from jvpreg.clone.rules.kinds import elementwise, elementwise_inplace, linear

T = torch.Tensor

_ADDITIVE = (torch.add, T.add, T.__add__, T.__radd__, torch.sub, T.sub, T.__sub__, T.__rsub__, torch.rsub,
             maybe(torch, "subtract"), maybe(T, "subtract"))
linear(*_ADDITIVE, torch.neg, T.neg, T.__neg__, maybe(torch, "negative"), maybe(T, "negative"),
       maybe(torch, "positive"), maybe(T, "positive"), maybe(T, "__pos__"), T.where, elementwise_op=True,
       inplace=(T.add_, T.__iadd__, T.sub_, T.__isub__, T.neg_, maybe(T, "subtract_")))
linear(torch.lerp, T.lerp, elementwise_op=True, fixed=("weight",))
linear(F.linear, maybe(torch._C._nn, "linear"), batch_dims=0, weighted=True)


@register_handler(torch.where)
def where(func, args, kwargs):
    """``where(c, x, y)``: affine in ``x`` and ``y`` (elementwise); ``where(c)``, the condition alone, is
    ``nonzero(c, as_tuple=True)``: indices, piecewise constant (evaluated on the primal block)."""
    if len(args) + len(kwargs) == 1:
        return state_eval(func, args, kwargs)
    return elementwise(func, args, kwargs)


COMPLEX_EXACT.update(f for f in (*_ADDITIVE, torch.where, T.where) if f is not None)  # linear in every argument


@register_op(torch.masked_fill, T.masked_fill)
def masked_fill(func, input, mask, value):
    """masked_fill(x, m, v) = where(m, v, x): affine in x and in a (0-dim) tensor value alike."""
    if is_clone(value):
        if not is_clone(input):
            input = wrap(assemble(input, k=count(value)), state=True)
        return elementwise(torch.where, (mask, value, input), {})
    return elementwise(func, (input, mask, value), {})


@register_op(T.masked_fill_)
def masked_fill_(func, input, mask, value):
    """``masked_fill`` in place; a batch value: out of place, written back."""
    if is_clone(value):
        return write_back(func, input, masked_fill(torch.masked_fill, input, mask, value))
    return elementwise_inplace(func, (input, mask, value), {})


# Affine in the batch tensor for fixed indices/masks (index tensors may be state clones): every block through the op
_PER_BLOCK = [
    "gather", "index_select", "take_along_dim", "scatter", "scatter_add", "index_add", "index_copy",
    "masked_scatter", "masked_select", "take", "roll", "flip", "fliplr", "flipud", "rot90",
    "tril", "triu", "diagonal", "diag", "diag_embed", "repeat", "repeat_interleave", "tile", "narrow_copy",
    "unfold", "trace", "diff", "index_put", "block_diag", "atleast_1d", "atleast_2d", "atleast_3d",
    "conj", "real", "imag", "view_as_real", "view_as_complex", "nan_to_num",
    "broadcast_tensors", "broadcast_to",
]
linear(*[maybe(torch, n) for n in _PER_BLOCK], *[maybe(T, n) for n in _PER_BLOCK])
linear(torch.index_fill, T.index_fill, fixed=("value",))
# The discrete Fourier transforms: linear (over the reals, for complex and real inputs alike)
_FFT = ["fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn",
        "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn", "fftshift", "ifftshift"]
linear(*[maybe(torch.fft, n) for n in _FFT])


# ---------------------------------------------------------------------------------------
# Reductions that are linear: sum, mean, cumsum, on the physical dims of the logical ones


def _dims_arg(args: tuple, kwargs: dict):
    dim = kwargs.get("dim", None)
    rest = list(args[1:])
    if dim is None and rest and isinstance(rest[0], (int, tuple, list)) and not isinstance(rest[0], bool):
        dim = rest.pop(0)
        if rest and isinstance(rest[0], bool):
            kwargs = {**kwargs, "keepdim": rest.pop(0)}
    elif dim is None and rest and isinstance(rest[0], torch.dtype):
        kwargs = {**kwargs, "dtype": rest.pop(0)}
    return dim, rest, {k: v for k, v in kwargs.items() if k != "dim"}


@register_handler(torch.sum, T.sum, torch.mean, T.mean, maybe(torch, "nansum"), maybe(T, "nansum"))
def linear_reduce(func, args, kwargs):
    """sum/mean/nansum over the physical dims of the logical ones."""
    x = args[0]
    dim, rest, kw = _dims_arg(args, kwargs)
    if rest or isinstance(dim, str):
        return fallback(func, args, kwargs)
    n = x.dim() - 1
    if n == 0:  # a logical scalar: any dim (0 or -1) leaves it as it is
        dims = ()
    elif dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        dims = tuple(range(1, n + 1))
    elif isinstance(dim, int):
        dims = (phys_dim(dim, n),)
    else:
        dims = tuple(phys_dim(d, n) for d in dim)
    p = raw(x)
    if not dims:  # reduction of a logical scalar
        out = p.clone() if kw.get("dtype") is None else p.to(kw["dtype"])
    else:
        out = getattr(torch, func.__name__)(p, dim=dims, **kw)
    return wrap(out, state=x._jvp_state)


@register_op(torch.cumsum, T.cumsum)
def cumsum(func, input, dim, *, dtype=None):
    """cumsum along the physical dim of the logical one."""
    n = input.dim() - 1
    if n == 0:
        phys_dim(dim, 0)  # validates dim
        return wrap(raw(input).to(dtype or input.dtype, copy=True), state=input._jvp_state)
    return wrap(torch.cumsum(raw(input), phys_dim(dim, n), dtype=dtype), state=input._jvp_state)
