"""Fast paths for ops that need no rule: queries, affine, shape and state ops.

An affine op (linear, convolution, pooling by averaging, sums, reshapes, concatenation...)
acts on every block as it does on the primal, so the difference form needs nothing but
the right placement of the block dim: logical dim ``d`` is physical dim ``d + 1``, and
ops that treat dim 0 as a batch (convolutions, pooling) run once on the merged
``(K*B, ...)`` batch — the paper's single concatenated forward.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_unflatten

from .dispatch import _flat_clones, per_block, state_eval, fallback
from .registry import maybe, register_handler, register_state
from . import tensor as tensor_module
from .tensor import CloneTensor, any_clone, is_clone, phys_dim, tile, wrap, wrap_tree

T = torch.Tensor


def _lnd(x: torch.Tensor) -> int:
    """Logical ndim of a clone (physical ndim - 1)."""
    return x.dim() - 1


def _k(x: torch.Tensor) -> int:
    return x.shape[0]


def _state_of(*xs: Any) -> bool:
    return all(x._jvp_state for x in xs if is_clone(x))


# ---------------------------------------------------------------------------------------
# Queries answered on the primal block (shape, dtype, item, ...)


def _query(func, args, kwargs):
    x = args[0] if args else None
    if type(x) is CloneTensor and not any_clone(args[1:], kwargs):
        return func(x[0], *args[1:], **kwargs)
    flat, spec, idx = _flat_clones(args, kwargs)
    for i in idx:
        flat[i] = flat[i][0]
    a, k = tree_unflatten(flat, spec)
    return func(*a, **k)


_QUERY_ATTRS = [
    "size", "dim", "ndimension", "numel", "nelement", "__len__", "item", "tolist", "__bool__",
    "__float__", "__int__", "__index__", "__format__", "numpy", "stride", "is_contiguous",
    "element_size", "get_device", "is_floating_point", "is_complex", "storage_offset", "data_ptr",
    "dim_order", "is_nonzero", "__array__",
]
_QUERY_GETTERS = ["shape", "ndim", "dtype", "device", "is_cuda", "layout", "is_sparse", "is_quantized",
                  "is_meta", "requires_grad", "is_leaf", "names", "itemsize", "nbytes", "is_mps", "is_cpu"]
register_handler(*[maybe(T, n) for n in _QUERY_ATTRS], torch.numel, maybe(torch, "is_floating_point"),
                 maybe(torch, "is_complex"), maybe(torch, "is_nonzero"))(_query)
register_handler(*[getattr(T, n).__get__ for n in _QUERY_GETTERS if hasattr(T, n)])(_query)


@register_handler(T.__hash__)
def _hash(func, args, kwargs):
    return id(args[0])


# ---------------------------------------------------------------------------------------
# Whole-tensor ops: dtype/device moves, copies, autograd bookkeeping


def _on_phys(func, args, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
    x = args[0]
    out = func(x.as_subclass(torch.Tensor), *args[1:], **kwargs)
    if out is None:
        return None
    return wrap_tree(out, lambda t: wrap(t, state=x._jvp_state))


register_handler(
    T.to, T.float, T.double, T.half, T.bfloat16, T.cpu, maybe(T, "cuda"), T.type, T.contiguous,
    T.clone, torch.clone, T.requires_grad_, maybe(T, "pin_memory"),
)(_on_phys)


@register_handler(T.register_hook, T.retain_grad)
def _on_self(func, args, kwargs):
    """Gradient hooks go on the clone itself, the tensor later ops consume: on an alias of it (what
    ``_on_phys`` builds) they never fire (FSDP2 unshards a layer's parameters for backward from such
    a hook). The hook receives the gradient of the physical ``(K, *L)`` batch."""
    if tensor_module._CAPTURING[0] is not None:
        from .capture import CaptureError

        raise CaptureError("the forward registers a gradient hook (it would not be replayed)")
    return func(*args, **kwargs)


@register_handler(T.detach, torch.detach, T.data.__get__)
def _detach(func, args, kwargs):
    """``detach()`` makes a constant: the primal value in every block (zero tangent), as in torch.func."""
    x = args[0]
    return wrap(tile(x[0].detach(), x.shape[0]), state=True)


@register_handler(T.type_as)
def _type_as(func, args, kwargs):
    x, other = args[0], args[1]
    return wrap(x.as_subclass(torch.Tensor).to(other.dtype), state=x._jvp_state)


@register_handler(T.detach_)
def _detach_(func, args, kwargs):
    x = args[0]
    x.detach_()
    with torch.no_grad():
        x[1:] = x[0]
    x._jvp_state = True
    return x


# ---------------------------------------------------------------------------------------
# Elementwise ops that are affine in their clone arguments


def align(flat: list, idx: list) -> list:
    """Insert singleton dims after the block dim so clones broadcast by their logical shape."""
    nd = 0
    for v in flat:
        if isinstance(v, torch.Tensor):
            nd = max(nd, v.dim() - 1 if type(v) is CloneTensor else v.dim())
    out = list(flat)
    for i in idx:
        p = flat[i]
        ln = p.dim() - 1
        if ln < nd:
            out[i] = p.reshape(p.shape[0], *([1] * (nd - ln)), *p.shape[1:])
    return out


def elementwise(func, args, kwargs):
    if not kwargs and len(args) == 2:  # fast path: binary op
        x, y = args
        cx, cy = type(x) is CloneTensor, type(y) is CloneTensor
        if cx and cy:
            nd = max(x.dim(), y.dim())
            xx = x if x.dim() == nd else x.reshape(x.shape[0], *([1] * (nd - x.dim())), *x.shape[1:])
            yy = y if y.dim() == nd else y.reshape(y.shape[0], *([1] * (nd - y.dim())), *y.shape[1:])
            return wrap(func(xx, yy), state=x._jvp_state and y._jvp_state)
        c = x if cx else y
        other = y if cx else x
        if not isinstance(other, torch.Tensor) or other.dim() <= c.dim() - 1:
            return wrap(func(x, y), state=c._jvp_state)
    flat, spec, idx = _flat_clones(args, kwargs)
    state = all(flat[i]._jvp_state for i in idx)
    a, k = tree_unflatten(align(flat, idx), spec)
    return wrap(func(*a, **k), state=state)


def elementwise_inplace(func, args, kwargs):
    target = args[0]
    if not is_clone(target):
        raise RuntimeError(
            f"jvpreg clone mode: in-place {getattr(func, '__name__', func)} would write batch data into a "
            "tensor created outside the batch. Create it from the batch (torch.zeros_like(h), h.new_zeros(...)) "
            "or use the out-of-place op."
        )
    flat, spec, idx = _flat_clones(args, kwargs)
    state = all(flat[i]._jvp_state for i in idx)
    a, k = tree_unflatten(align(flat, idx), spec)
    func(*a, **k)
    target._jvp_state = state
    return target


register_handler(
    torch.add, T.add, T.__add__, T.__radd__, torch.sub, T.sub, T.__sub__, T.__rsub__, torch.rsub,
    maybe(torch, "subtract"), maybe(T, "subtract"), torch.neg, T.neg, T.__neg__, maybe(torch, "negative"),
    maybe(T, "negative"), maybe(torch, "positive"), maybe(T, "positive"), maybe(T, "__pos__"),
    torch.where, T.where, torch.masked_fill, T.masked_fill,
)(elementwise)
register_handler(T.add_, T.__iadd__, T.sub_, T.__isub__, T.neg_, T.masked_fill_, maybe(T, "subtract_"))(
    elementwise_inplace
)


@register_handler(torch.lerp, T.lerp)
def _lerp(func, args, kwargs):
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    if is_clone(weight) and not weight._jvp_state:
        return fallback(func, args, kwargs)
    return elementwise(func, args, kwargs)


# ---------------------------------------------------------------------------------------
# Reductions that are linear: sum, mean, cumsum


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
def _linear_reduce(func, args, kwargs):
    x = args[0]
    dim, rest, kw = _dims_arg(args, kwargs)
    if rest or isinstance(dim, str):
        return fallback(func, args, kwargs)
    n = _lnd(x)
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        dims = tuple(range(1, n + 1))
    elif isinstance(dim, int):
        dims = (phys_dim(dim, n),)
    else:
        dims = tuple(phys_dim(d, n) for d in dim)
    p = x.as_subclass(torch.Tensor)
    if not dims:  # reduction of a logical scalar
        out = p.clone() if kw.get("dtype") is None else p.to(kw["dtype"])
    else:
        out = getattr(torch, func.__name__)(p, dim=dims, **kw)
    return wrap(out, state=x._jvp_state)


@register_handler(torch.cumsum, T.cumsum)
def _cumsum(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    kw = {k: v for k, v in kwargs.items() if k != "dim"}
    return wrap(torch.cumsum(x.as_subclass(torch.Tensor), phys_dim(dim, _lnd(x)), **kw), state=x._jvp_state)


# ---------------------------------------------------------------------------------------
# Shape ops: logical dim d is physical dim d + 1


def _shape_args(args: Sequence[Any]) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


@register_handler(T.view, T.reshape, torch.reshape)
def _reshape(func, args, kwargs):
    x = args[0]
    if len(args) == 2 and isinstance(args[1], torch.dtype) or "dtype" in kwargs:
        return wrap(x.as_subclass(torch.Tensor).view(args[1] if len(args) == 2 else kwargs["dtype"]), x._jvp_state)
    shape = _shape_args(args[1:]) if len(args) > 1 else tuple(kwargs.get("shape", kwargs.get("size")))
    p = x.as_subclass(torch.Tensor)
    method = p.view if func is T.view else p.reshape
    return wrap(method(_k(x), *shape), state=x._jvp_state)


@register_handler(T.view_as, T.reshape_as)
def _reshape_as(func, args, kwargs):
    x, other = args[0], args[1] if len(args) > 1 else kwargs["other"]
    shape = other.shape[1:] if is_clone(other) else other.shape
    p = x.as_subclass(torch.Tensor)
    method = p.view if func is T.view_as else p.reshape
    return wrap(method(_k(x), *shape), state=x._jvp_state)


@register_handler(torch.flatten, T.flatten)
def _flatten(func, args, kwargs):
    x = args[0]
    start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if n == 0:
        return wrap(p.reshape(_k(x), 1), state=x._jvp_state)
    return wrap(p.flatten(phys_dim(start, n), phys_dim(end, n)), state=x._jvp_state)


@register_handler(torch.unflatten, T.unflatten)
def _unflatten(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    sizes = args[2] if len(args) > 2 else kwargs["sizes"]
    return wrap(x.as_subclass(torch.Tensor).unflatten(phys_dim(dim, _lnd(x)), sizes), state=x._jvp_state)


@register_handler(torch.permute, T.permute)
def _permute(func, args, kwargs):
    x = args[0]
    dims = _shape_args(args[1:]) if len(args) > 1 else tuple(kwargs["dims"])
    n = _lnd(x)
    return wrap(x.as_subclass(torch.Tensor).permute(0, *[phys_dim(d, n) for d in dims]), state=x._jvp_state)


@register_handler(torch.transpose, T.transpose, maybe(torch, "swapaxes"), maybe(T, "swapaxes"),
                  maybe(torch, "swapdims"), maybe(T, "swapdims"))
def _transpose(func, args, kwargs):
    x = args[0]
    d0 = args[1] if len(args) > 1 else kwargs.get("dim0", kwargs.get("axis0"))
    d1 = args[2] if len(args) > 2 else kwargs.get("dim1", kwargs.get("axis1"))
    n = _lnd(x)
    return wrap(x.as_subclass(torch.Tensor).transpose(phys_dim(d0, n), phys_dim(d1, n)), state=x._jvp_state)


@register_handler(torch.t, T.t, T.T.__get__, T.mT.__get__, maybe(T, "mH").__get__ if hasattr(T, "mH") else None)
def _t(func, args, kwargs):
    x = args[0]
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if func == T.mT.__get__ or (hasattr(T, "mH") and func == T.mH.__get__):
        out = p.transpose(-1, -2)
    elif n < 2:
        out = p
    else:
        out = p.permute(0, *range(n, 0, -1))
    return wrap(out, state=x._jvp_state)


@register_handler(torch.movedim, T.movedim, maybe(torch, "moveaxis"), maybe(T, "moveaxis"))
def _movedim(func, args, kwargs):
    x = args[0]
    src = args[1] if len(args) > 1 else kwargs["source"]
    dst = args[2] if len(args) > 2 else kwargs["destination"]
    n = _lnd(x)
    src = phys_dim(src, n) if isinstance(src, int) else [phys_dim(d, n) for d in src]
    dst = phys_dim(dst, n) if isinstance(dst, int) else [phys_dim(d, n) for d in dst]
    return wrap(x.as_subclass(torch.Tensor).movedim(src, dst), state=x._jvp_state)


@register_handler(torch.unsqueeze, T.unsqueeze)
def _unsqueeze(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    n = _lnd(x) + 1
    return wrap(x.as_subclass(torch.Tensor).unsqueeze(phys_dim(dim, n)), state=x._jvp_state)


@register_handler(torch.squeeze, T.squeeze)
def _squeeze(func, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if n == 0:
        return wrap(p, state=x._jvp_state)
    if dim is None:
        dims = tuple(i for i in range(1, n + 1) if p.shape[i] == 1)
    elif isinstance(dim, int):
        dims = (phys_dim(dim, n),)
    else:
        dims = tuple(phys_dim(d, n) for d in dim)
    for d in sorted(dims, reverse=True):
        if p.shape[d] == 1:
            p = p.squeeze(d)
    return wrap(p, state=x._jvp_state)


@register_handler(T.expand)
def _expand(func, args, kwargs):
    x = args[0]
    sizes = _shape_args(args[1:]) if len(args) > 1 else tuple(kwargs["size"])
    p = x.as_subclass(torch.Tensor)
    n = _lnd(x)
    if len(sizes) > n:  # new leading dims go after the block dim
        p = p.reshape(_k(x), *([1] * (len(sizes) - n)), *p.shape[1:])
    return wrap(p.expand(_k(x), *sizes), state=x._jvp_state)


@register_handler(T.expand_as)
def _expand_as(func, args, kwargs):
    x, other = args[0], args[1]
    shape = other.shape[1:] if is_clone(other) else other.shape
    return _expand(T.expand, (x, tuple(shape)), {})


@register_handler(torch.narrow, T.narrow)
def _narrow(func, args, kwargs):
    x, dim, start, length = args[0], args[1], args[2], args[3]
    return wrap(x.as_subclass(torch.Tensor).narrow(phys_dim(dim, _lnd(x)), start, length), state=x._jvp_state)


@register_handler(torch.select, T.select)
def _select(func, args, kwargs):
    x, dim, index = args[0], args[1], args[2]
    return wrap(x.as_subclass(torch.Tensor).select(phys_dim(dim, _lnd(x)), index), state=x._jvp_state)


@register_handler(torch.split, T.split, torch.chunk, T.chunk, torch.unbind, T.unbind, maybe(torch, "tensor_split"),
                  maybe(T, "tensor_split"), maybe(T, "split_with_sizes"), maybe(torch, "split_with_sizes"))
def _split(func, args, kwargs):
    x = args[0]
    name = func.__name__
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if name == "unbind":
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        outs = p.unbind(phys_dim(dim, n))
    else:
        what = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections", kwargs.get("split_size",
                   kwargs.get("chunks", kwargs.get("sections", kwargs.get("indices", kwargs.get("split_sizes"))))))
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if torch.is_tensor(what):
            return fallback(func, args, kwargs)
        outs = getattr(p, name)(what, phys_dim(dim, n))
    return tuple(wrap(o, state=x._jvp_state) for o in outs)


def _as_block_tensor(t: Any, k: int) -> torch.Tensor:
    if is_clone(t):
        return t.as_subclass(torch.Tensor)
    return t.unsqueeze(0).expand(k, *t.shape)


@register_handler(torch.cat, maybe(torch, "concat"), maybe(torch, "concatenate"))
def _cat(func, args, kwargs):
    tensors = list(args[0]) if args else list(kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    clones = [t for t in tensors if is_clone(t)]
    k = _k(clones[0])
    n = _lnd(clones[0])
    parts = [_as_block_tensor(t, k) for t in tensors if not (not is_clone(t) and t.dim() == 1 and t.numel() == 0)]
    return wrap(torch.cat(parts, phys_dim(dim, n)), state=_state_of(*clones))


@register_handler(torch.stack, maybe(torch, "hstack"), maybe(torch, "vstack"), maybe(torch, "dstack"))
def _stack(func, args, kwargs):
    tensors = list(args[0]) if args else list(kwargs["tensors"])
    clones = [t for t in tensors if is_clone(t)]
    k = _k(clones[0])
    if func is not torch.stack:
        return per_block(func, args, kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    n = _lnd(clones[0]) + 1
    parts = [_as_block_tensor(t, k) for t in tensors]
    return wrap(torch.stack(parts, phys_dim(dim, n)), state=_state_of(*clones))


def _basic_index(idx: Any) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) and not isinstance(i, bool) for i in items)


def _block_index(idx: Any, j: int) -> Any:
    if is_clone(idx):
        return idx.as_subclass(torch.Tensor)[j]
    if isinstance(idx, tuple):
        return tuple(_block_index(i, j) for i in idx)
    if isinstance(idx, list):
        return [_block_index(i, j) for i in idx]
    return idx


@register_handler(T.__iter__)
def _iter(func, args, kwargs):
    x = args[0]
    if _lnd(x) == 0:
        raise TypeError("iteration over a 0-d tensor")
    return iter(tuple(wrap(t, state=x._jvp_state) for t in x.as_subclass(torch.Tensor).unbind(1)))


# Affine in the batch tensor for fixed indices/masks (index tensors may be state clones): per block.
_PER_BLOCK = [
    "gather", "index_select", "take_along_dim", "scatter", "scatter_add", "index_add", "index_copy",
    "index_fill", "masked_scatter", "masked_select", "take", "roll", "flip", "fliplr", "flipud", "rot90",
    "tril", "triu", "diagonal", "diag", "diag_embed", "repeat", "repeat_interleave", "tile", "narrow_copy",
    "unfold", "trace", "diff", "index_put", "block_diag", "atleast_1d", "atleast_2d", "atleast_3d",
    "conj", "real", "imag", "view_as_real", "view_as_complex", "nan_to_num", "column_stack", "row_stack",
    "broadcast_tensors", "broadcast_to",
]
register_handler(*[maybe(torch, n) for n in _PER_BLOCK], *[maybe(T, n) for n in _PER_BLOCK])(
    lambda func, args, kwargs: per_block(func, args, kwargs))


@register_handler(T.__getitem__)
def _getitem(func, args, kwargs):
    x, idx = args[0], args[1]
    if not is_clone(x):  # a plain tensor indexed by a clone (state) index
        return state_eval(func, args, kwargs)
    p = x.as_subclass(torch.Tensor)
    if _basic_index(idx):
        full = (slice(None),) + (idx if isinstance(idx, tuple) else (idx,))
        return wrap(p[full], state=x._jvp_state)
    out = torch.stack([p[j][_block_index(idx, j)] for j in range(_k(x))])
    return wrap(out, state=x._jvp_state)


@register_handler(T.__setitem__)
def _setitem(func, args, kwargs):
    x, idx, value = args[0], args[1], args[2]
    if not is_clone(x):
        raise RuntimeError(
            "jvpreg clone mode: `t[...] = h` writes batch data into a tensor created outside the batch. "
            "Create `t` from the batch (e.g. torch.zeros_like(h), h.new_zeros(...)) or collect the pieces "
            "with torch.stack/torch.cat."
        )
    p = x.as_subclass(torch.Tensor)
    state = x._jvp_state and (not is_clone(value) or value._jvp_state)
    if _basic_index(idx):
        full = (slice(None),) + (idx if isinstance(idx, tuple) else (idx,))
        target = p[full]
        if is_clone(value):
            v = value.as_subclass(torch.Tensor)
            v = v.reshape(v.shape[0], *([1] * (target.dim() - v.dim())), *v.shape[1:])
        else:
            v = value
        p[full] = v
    else:
        for j in range(_k(x)):
            vj = value.as_subclass(torch.Tensor)[j] if is_clone(value) else value
            p[j][_block_index(idx, j)] = vj
    x._jvp_state = state
    return None


@register_handler(T.copy_)
def _copy_(func, args, kwargs):
    x, src = args[0], args[1]
    if not is_clone(x):
        raise RuntimeError(
            "jvpreg clone mode: `t.copy_(h)` writes batch data into a tensor created outside the batch; "
            "create `t` from the batch instead (torch.zeros_like(h))."
        )
    p = x.as_subclass(torch.Tensor)
    if is_clone(src):
        s = src.as_subclass(torch.Tensor)
        s = s.reshape(s.shape[0], *([1] * (p.dim() - s.dim())), *s.shape[1:])
        p.copy_(s, **kwargs)
        x._jvp_state = src._jvp_state
    else:
        p.copy_(src, **kwargs)
        x._jvp_state = True
    return x


def _fill_like(func, args, kwargs):
    x = args[0]
    p = x.as_subclass(torch.Tensor)
    value = args[1] if len(args) > 1 else kwargs.get("value")
    if is_clone(value):
        return fallback(func, args, kwargs)
    getattr(p, func.__name__)(*args[1:], **kwargs)
    x._jvp_state = True
    return x


register_handler(T.fill_, T.zero_)(_fill_like)


def _random_inplace(func, args, kwargs):
    """In-place random draws: one draw (on the primal block) shared by every block."""
    x = args[0]
    p = x.as_subclass(torch.Tensor)
    rest = [a.as_subclass(torch.Tensor)[0] if is_clone(a) else a for a in args[1:]]
    getattr(p[0], func.__name__)(*rest, **kwargs)
    p[1:].copy_(p[0])
    x._jvp_state = True
    return x


register_handler(*[maybe(T, n) for n in ("bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                                        "geometric_", "cauchy_", "log_normal_")])(_random_inplace)


# ---------------------------------------------------------------------------------------
# State ops: piecewise-constant outputs (comparisons, indices, signs) and random draws

_STATE = [
    "eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "argmax", "argmin", "argsort", "sign",
    "signbit", "floor", "ceil", "round", "trunc", "fix", "isnan", "isinf", "isfinite", "isposinf",
    "isneginf", "isreal", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "__and__", "__or__", "__xor__", "__invert__", "nonzero",
    "argwhere", "bernoulli", "multinomial", "bucketize", "searchsorted", "heaviside", "floor_divide",
    "__floordiv__", "__rfloordiv__", "isclose", "count_nonzero", "unique", "unique_consecutive",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "equal", "allclose",
    "any", "all", "histc", "bincount",
]
register_state(*[maybe(torch, n) for n in _STATE], *[maybe(T, n) for n in _STATE], maybe(F, "one_hot"))


# ---------------------------------------------------------------------------------------
# Batch ops that are affine in their (clone) input: one call on the merged K*B batch


def _rowwise_call(func, x, rest: tuple, kwargs: dict, batched_ndim: int):
    """Run ``func(x, *rest)`` on every block at once; the physical output is ``(K, *out)``."""
    p = x.as_subclass(torch.Tensor)
    n = _lnd(x)
    if batched_ndim == 0:  # acts on trailing dims only (linear): every leading dim is a batch
        return func(p, *rest, **kwargs)
    if n == batched_ndim:
        k, b = p.shape[0], p.shape[1]
        out = func(p.reshape(k * b, *p.shape[2:]), *rest, **kwargs)
        return wrap_tree(out, lambda t: t.reshape(k, b, *t.shape[1:]))
    if n == batched_ndim - 1:  # unbatched input: the block dim is the batch
        return func(p, *rest, **kwargs)
    return None


def rowwise(batched_ndim: int) -> Callable:
    """Handler for an op whose first argument is a batch of ``batched_ndim`` dims and that is affine in it."""

    def handler(func, args, kwargs):
        x = args[0]
        others = any_clone(args[1:], kwargs)
        if func in _MULTILINEAR and (others or not is_clone(x)):
            return multilinear(func, args, kwargs, batched_ndim)
        if not is_clone(x) or others:
            return fallback(func, args, kwargs)
        nd = _lnd(x) if batched_ndim < 0 else batched_ndim
        out = _rowwise_call(func, x, args[1:], kwargs, nd)
        if out is None:
            return per_block(func, args, kwargs)
        return wrap_tree(out, lambda t: wrap(t, state=x._jvp_state))

    return handler


def _varying(t: Any) -> bool:
    return is_clone(t) and not t._jvp_state


def multilinear(func, args, kwargs, batched_ndim: int):
    """``op(x, W, b, ...)`` linear in x and in W, affine in b (convolutions, linear).

    Block j of the output is ``op(x_j, W_0, b_0) + op(x_0, W_j - W_0, b_j - b_0)``: the input
    tangent rides in the merged batch, the weight tangent ("swapped layer weight",
    DESIGN.md §1) is applied to the primal input only.
    """
    x = args[0]
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    rest = args[3:]
    kw = {key: v for key, v in kwargs.items() if key not in ("weight", "bias")}
    w0 = w[0] if is_clone(w) else w
    b0 = b[0] if is_clone(b) else b
    clones = [t for t in (x, w, b) if is_clone(t)]
    k = _k(clones[0])
    if is_clone(x):
        nd = _lnd(x) if batched_ndim < 0 else batched_ndim
        base = _rowwise_call(func, x, (w0, b0) + rest, kw, nd)
        if base is None:
            return fallback(func, args, kwargs)
        x0 = x[0]
    else:
        base = tile(func(x, w0, b0, *rest, **kw), k)
        x0 = x
    dw, db = _varying(w), _varying(b)
    if not (dw or db):
        return wrap(base, state=_state_of(*clones))
    outs = [base[0]]
    for j in range(1, k):
        wj = w[j] - w0 if dw else torch.zeros_like(w0)
        bj = b[j] - b0 if db else None
        outs.append(base[j] + func(x0, wj, bj, *rest, **kw))
    return wrap(torch.stack(outs))


_BATCHED_NDIM = {
    F.conv1d: 3, F.conv2d: 4, F.conv3d: 5, torch.conv1d: 3, torch.conv2d: 4, torch.conv3d: 5,
    F.conv_transpose1d: 3, F.conv_transpose2d: 4, F.conv_transpose3d: 5,
    F.avg_pool1d: 3, F.avg_pool2d: 4, F.avg_pool3d: 5, torch.avg_pool1d: 3,
    F.adaptive_avg_pool1d: 3, F.adaptive_avg_pool2d: 4, F.adaptive_avg_pool3d: 5, torch.adaptive_avg_pool1d: 3,
    F.pixel_shuffle: 4, F.pixel_unshuffle: 4, F.unfold: 4, F.fold: 3, F.channel_shuffle: 4,
    F.interpolate: -1, F.upsample: -1, F.upsample_nearest: -1, F.upsample_bilinear: -1,
    F.linear: 0,
}
if hasattr(torch._C._nn, "linear"):
    _BATCHED_NDIM[torch._C._nn.linear] = 0
_MULTILINEAR = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d, F.conv_transpose1d,
                F.conv_transpose2d, F.conv_transpose3d, F.linear, getattr(torch._C._nn, "linear", F.linear)}
for _fn, _nd in _BATCHED_NDIM.items():
    register_handler(_fn)(rowwise(_nd))


@register_handler(F.grid_sample, F.affine_grid)
def _per_sample_pair(func, args, kwargs):
    """grid_sample(input, grid) is linear in input for a fixed grid (and affine_grid linear in theta),
    but the grid carries its own batch dim: run per block, or exactly through the fallback when the
    grid itself comes from the batch."""
    grid = args[1] if len(args) > 1 else kwargs.get("grid", kwargs.get("size"))
    if func is F.grid_sample and is_clone(grid) and not grid._jvp_state:
        return fallback(func, args, kwargs)
    return per_block(func, args, kwargs)


@register_handler(F.pad, torch._C._nn.pad if hasattr(torch._C._nn, "pad") else None)
def _pad(func, args, kwargs):
    x = args[0]
    pad = args[1] if len(args) > 1 else kwargs["pad"]
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    value = args[3] if len(args) > 3 else kwargs.get("value", None)
    if not is_clone(x) or is_clone(value):
        return fallback(func, args, kwargs)
    p = x.as_subclass(torch.Tensor)
    if mode == "constant":
        return wrap(F.pad(p, pad, mode, value), state=x._jvp_state)
    nsp = len(pad) // 2
    lead, sp = p.shape[:-nsp], p.shape[-nsp:]
    out = F.pad(p.reshape(-1, 1, *sp), pad, mode)
    return wrap(out.reshape(*lead, *out.shape[-nsp:]), state=x._jvp_state)
