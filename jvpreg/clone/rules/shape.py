"""Fast paths for ops that need no rule: queries, whole-tensor ops, shape ops, indexing and writes, state ops.

A query (``x.shape``, ``x.dtype``, ``x.item()``) is answered on the primal block, so user code sees the logical
tensor. A shape op (reshapes, permutes, concatenation, indexing, padding) moves entries the same way in every block,
so the difference form needs nothing but the right placement of the block dim: logical dim ``d`` is physical dim
``d + 1``. A write (``t[i] = h``, ``copy_``) lands block by block. A state op (comparisons, argmax, random draws) has
piecewise-constant outputs: evaluated on the primal block and repeated. Affine ops: :mod:`jvpreg.clone.rules.linear`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_unflatten

from jvpreg.clone.core.errors import CaptureError, UnsupportedOpError
from jvpreg.clone.core.registry import COMPLEX_EXACT, HANDLERS, maybe, op_name, register_handler, register_op
from jvpreg.clone.core.tensor import (METADATA, CloneTensor, any_clone, capturing, is_clone, phys_dim, storage_bytes,
    wrap, wrap_tree)
from jvpreg.clone.eager.dispatch import NOT_STATE, fallback, flat_clones, state_eval, state_write
from jvpreg.clone.eager.made_tensors import blocks_of, fill_or_refuse
from jvpreg.clone.rules.blocks import as_batch, assemble, count, primal, split
from jvpreg.clone.rules.kinds import register_state

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
        return func(primal(x), *args[1:], **kwargs)
    flat, spec, idx = flat_clones(args, kwargs)
    for i in idx:
        flat[i] = primal(flat[i])
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
METADATA.update(getattr(T, n).__get__ for n in _QUERY_GETTERS if hasattr(T, n))


@register_handler(T._base.__get__)
def _base(func, args, kwargs):
    """``._base``: ``None`` for a clone that stands for an op's own result (:func:`~jvpreg.clone.core.tensor.claim`),
    else the base of its storage: the clone is a view, as the plain op's result is (FSDP2 asks before hooking a
    module's output). The base is returned to be tested, not computed with."""
    x = args[0]
    return None if x._jvp_owns else func(x)


@register_handler(T._is_view)
def _is_view(func, args, kwargs):
    """``._is_view()``: whether :func:`_base` reports a base."""
    return not args[0]._jvp_owns and args[0]._base is not None


@register_handler(T.__hash__)
def _hash(func, args, kwargs):
    return id(args[0])


# ---------------------------------------------------------------------------------------
# Whole-tensor ops: dtype/device moves, copies, autograd bookkeeping


def _on_phys(func, args, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
    x = args[0]
    if not is_clone(x) or any_clone(args[1:], kwargs):  # a clone as a dtype/device template (t.to(h))
        return _as_template(func, args, kwargs)
    phys = x.as_subclass(torch.Tensor)
    out = func(phys, *args[1:], **kwargs)
    if out is None:
        return None
    if out is phys:  # nothing to do (``x.contiguous()``, ``x.to(x.dtype)``): the op returns ``x`` itself, as in torch
        return x
    if not x._jvp_state and type(out) is torch.Tensor and out.dtype == torch.float16 != phys.dtype:
        _check_fits_float16(phys, out)
    return wrap_tree(out, lambda t: wrap(t, state=x._jvp_state))


def _check_fits_float16(phys: torch.Tensor, out: torch.Tensor) -> None:
    """A cast of tangent blocks to float16 must not overflow: the blocks ``x + s u`` carry the scale chosen for the
    input's dtype (``s ~ 2^40 rms(x) / rms(u)``), far past float16's 65504, unless the forward began in float16."""
    if bool((torch.isinf(out[1:]) & torch.isfinite(phys[1:])).any()):
        raise UnsupportedOpError(
            f"jvpreg clone mode: a cast of the clone batch from {phys.dtype} to float16 inside the forward overflows "
            "its tangent blocks (x + s u, with the scale s chosen for the input's dtype). Give jvpreg float16 "
            "inputs, or run the call under float16 autocast, so that it chooses a scale for float16.")


register_handler(
    T.to, T.float, T.double, T.half, T.bfloat16, T.cpu, maybe(T, "cuda"), T.type, T.contiguous,
    T.clone, torch.clone, maybe(T, "pin_memory"),
)(_on_phys)


@register_handler(T.register_hook, T.retain_grad)
def _on_self(func, args, kwargs):
    """Gradient hooks go where the clone's gradient arrives, never on a new alias of it (what ``_on_phys``
    builds), which no gradient reaches (FSDP2 unshards a layer's parameters for backward from such a hook).

    A clone that stands for an op's own result (:func:`~jvpreg.clone.core.tensor.claim`) is hooked on the base of its
    storage: its gradient is the clone's, and an in-place update of the clone (``h += x``) keeps the hook, as it
    does on the plain result of a plain op; on the clone, an autograd alias, the update would regenerate its
    ``grad_fn`` and drop the hook. A clone that is a view is hooked itself, as torch hooks a view. The hook receives
    the gradient of the physical ``(K, *L)`` batch. ``retain_grad`` stays on the clone, whose ``.grad`` the caller
    reads."""
    if capturing():
        raise CaptureError("the forward registers a gradient hook (it would not be replayed)")
    x = args[0]
    if func is not T.register_hook or not x._jvp_owns or x._base is None:
        return func(*args, **kwargs)
    base, hook = x._base, (args[1] if len(args) > 1 else kwargs["hook"])
    if base.shape == x.shape:
        return func(base, hook)
    shape, base_shape = x.shape, base.shape  # the rule computed the batch in another shape

    def reshaped(grad: torch.Tensor) -> Any:
        new = hook(grad.reshape(shape))
        return None if new is None else new.reshape(base_shape)

    return func(base, reshaped)


@register_handler(T.requires_grad_)
def _requires_grad_(func, args, kwargs):
    """``x.requires_grad_()`` sets the flag on the clone itself and returns it, as torch does (on an alias of it,
    the flag would not reach ``x``)."""
    func(*args, **kwargs)
    return args[0]


@register_handler(T.real.__get__, T.imag.__get__)
def _real_imag(func, args, kwargs):
    """``.real`` / ``.imag`` act on every block alike (linear over the reals)."""
    x = args[0]
    return wrap(func(x.as_subclass(torch.Tensor)), state=x._jvp_state)


@register_handler(T.detach, torch.detach, T.data.__get__)
def _detach(func, args, kwargs):
    """``detach()`` makes a constant: the primal value in every block (zero tangent), as in torch.func."""
    x = args[0]
    return wrap(assemble(primal(x).detach(), k=count(x)), state=True)


def _as_template(func, args, kwargs):
    """``t.to(h)``, ``t.type_as(h)``: a clone argument other than the input only lends its dtype and device
    (its primal block stands in for it); the input keeps its blocks, or stays plain."""
    x = args[0]
    rest = tuple(primal(a) for a in args[1:])
    kw = {k: primal(v) for k, v in kwargs.items()}
    if not is_clone(x):
        return func(x, *rest, **kw)
    phys = x.as_subclass(torch.Tensor)
    out = func(phys, *rest, **kw)
    if not x._jvp_state and out.dtype == torch.float16 != phys.dtype:
        _check_fits_float16(phys, out)
    return wrap(out, state=x._jvp_state)


@register_handler(T.type_as)
def _type_as(func, args, kwargs):
    return _as_template(func, args, kwargs)


@register_handler(T.detach_)
def _detach_(func, args, kwargs):
    x = args[0]
    x.detach_()
    with torch.no_grad():
        a, rest = split(x, differences=False)
        rest.copy_(a)
    x._jvp_state = True
    return x


# ---------------------------------------------------------------------------------------
# Shape ops: logical dim d is physical dim d + 1


def _shape_args(args: Sequence[Any]) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


@register_op(T.view, T.reshape, torch.reshape, aliases={"size": "shape", "dtype": "shape"})
def _reshape(func, input, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        return wrap(input.as_subclass(torch.Tensor).view(shape[0]), input._jvp_state)
    p = input.as_subclass(torch.Tensor)
    method = p.view if func is T.view else p.reshape
    return wrap(method(_k(input), *_shape_args(shape)), state=input._jvp_state)


def _logical_shape(t: torch.Tensor) -> tuple:
    """The shape user code sees (a clone used only for its shape reports its logical shape)."""
    return tuple(t.shape[1:]) if is_clone(t) else tuple(t.shape)


@register_op(T.view_as, T.reshape_as, T.expand_as)
def _reshape_as(func, input, other):
    """view_as/reshape_as/expand_as: ``other`` may be a clone used for its (logical) shape only."""
    shape = _logical_shape(other)
    if not is_clone(input):  # only the shape comes from the batch: a plain result
        return getattr(input, func.__name__[:-3])(shape)
    if func is T.expand_as:
        return _expand(T.expand, input, shape)
    p = input.as_subclass(torch.Tensor)
    method = p.view if func is T.view_as else p.reshape
    return wrap(method(_k(input), *shape), state=input._jvp_state)


@register_op(torch.flatten, T.flatten)
def _flatten(func, input, start_dim=0, end_dim=-1):
    x, start, end = input, start_dim, end_dim
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if n == 0:
        return wrap(p.reshape(_k(x), 1), state=x._jvp_state)
    return wrap(p.flatten(phys_dim(start, n), phys_dim(end, n)), state=x._jvp_state)


@register_op(torch.unflatten, T.unflatten)
def _unflatten(func, input, dim, sizes):
    x = input
    return wrap(x.as_subclass(torch.Tensor).unflatten(phys_dim(dim, _lnd(x)), sizes), state=x._jvp_state)


@register_op(torch.permute, T.permute)
def _permute(func, input, *dims):
    x, dims = input, _shape_args(dims)
    n = _lnd(x)
    return wrap(x.as_subclass(torch.Tensor).permute(0, *[phys_dim(d, n) for d in dims]), state=x._jvp_state)


@register_op(torch.transpose, T.transpose, maybe(torch, "swapaxes"), maybe(T, "swapaxes"),
             maybe(torch, "swapdims"), maybe(T, "swapdims"), aliases={"axis0": "dim0", "axis1": "dim1"})
def _transpose(func, input, dim0, dim1):
    x, d0, d1 = input, dim0, dim1
    n = _lnd(x)
    if n == 0:  # a 0-d tensor: torch checks the dims (0 or -1) and returns it unchanged
        phys_dim(d0, 1), phys_dim(d1, 1)
        p = x.as_subclass(torch.Tensor)
        return wrap(p.view(p.shape), state=x._jvp_state)  # a view, as torch's
    return wrap(x.as_subclass(torch.Tensor).transpose(phys_dim(d0, n), phys_dim(d1, n)), state=x._jvp_state)


@register_handler(torch.t, T.t, T.T.__get__, T.mT.__get__, T.mH.__get__, T.H.__get__)
def _t(func, args, kwargs):
    """t / .T / .mT (transposes) and .mH / .H (their conjugates)."""
    x = args[0]
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if func == T.mH.__get__ or func == T.H.__get__:
        p = p.conj()
    if func == T.mT.__get__ or func == T.mH.__get__:
        out = p.transpose(-1, -2)
    elif n < 2:
        out = p
    else:
        out = p.permute(0, *range(n, 0, -1))
    return wrap(out, state=x._jvp_state)


@register_op(torch.movedim, T.movedim, maybe(torch, "moveaxis"), maybe(T, "moveaxis"))
def _movedim(func, input, source, destination):
    x, src, dst = input, source, destination
    n = _lnd(x)
    src = phys_dim(src, n) if isinstance(src, int) else [phys_dim(d, n) for d in src]
    dst = phys_dim(dst, n) if isinstance(dst, int) else [phys_dim(d, n) for d in dst]
    return wrap(x.as_subclass(torch.Tensor).movedim(src, dst), state=x._jvp_state)


@register_op(torch.unsqueeze, T.unsqueeze)
def _unsqueeze(func, input, dim):
    x = input
    n = _lnd(x) + 1
    return wrap(x.as_subclass(torch.Tensor).unsqueeze(phys_dim(dim, n)), state=x._jvp_state)


@register_op(torch.squeeze, T.squeeze)
def _squeeze(func, input, dim=None):
    x = input
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


@register_op(T.expand)
def _expand(func, input, *size, implicit=False):
    x, sizes = input, _shape_args(size)
    p = x.as_subclass(torch.Tensor)
    n = _lnd(x)
    if len(sizes) > n:  # new leading dims go after the block dim
        p = p.reshape(_k(x), *([1] * (len(sizes) - n)), *p.shape[1:])
    return wrap(p.expand(_k(x), *sizes), state=x._jvp_state)


@register_op(torch.narrow, T.narrow)
def _narrow(func, input, dim, start, length):
    x = input
    return wrap(x.as_subclass(torch.Tensor).narrow(phys_dim(dim, _lnd(x)), start, length), state=x._jvp_state)


@register_op(torch.select, T.select)
def _select(func, input, dim, index):
    x = input
    return wrap(x.as_subclass(torch.Tensor).select(phys_dim(dim, _lnd(x)), index), state=x._jvp_state)


@register_op(torch.split, T.split, torch.chunk, T.chunk, torch.unbind, T.unbind, maybe(torch, "tensor_split"),
             maybe(T, "tensor_split"), maybe(T, "split_with_sizes"), maybe(torch, "split_with_sizes"),
             aliases={k: "what" for k in ("split_size_or_sections", "split_size", "chunks", "sections", "indices",
                                          "tensor_indices_or_sections", "split_sizes", "indices_or_sections")})
def _split(func, input, what=None, dim=0):
    x = input
    name = func.__name__
    n = _lnd(x)
    p = x.as_subclass(torch.Tensor)
    if name == "unbind":  # unbind(input, dim=0)
        outs = p.unbind(phys_dim(what if what is not None else dim, n))
    else:
        if is_clone(what):
            return fallback(func, (input, what, dim), {})
        outs = getattr(p, name)(what, phys_dim(dim, n))
    return tuple(wrap(o, state=x._jvp_state) for o in outs)


@register_op(torch.as_strided, T.as_strided)
def _as_strided(func, input, size, stride, storage_offset=None):
    """as_strided on the primal's storage layout, repeated at every block's slab (block stride).

    Exact only when block j's data sits ``j * stride(0)`` after block 0's and the requested window stays
    inside block 0's slab; otherwise the exact fallback.
    """
    p = input.as_subclass(torch.Tensor)
    bs = p.stride(0)
    off = p.storage_offset() if storage_offset is None else storage_offset
    lo = off + sum(min(0, (n - 1) * st) for n, st in zip(size, stride))
    hi = off + sum(max(0, (n - 1) * st) for n, st in zip(size, stride))
    slab = p.storage_offset() - p.storage_offset() % bs if bs > 0 else 0
    if bs <= 0 or lo < slab or hi >= slab + bs or any(n == 0 for n in size):
        return fallback(func, (input, size, stride, storage_offset), {})
    return wrap(p.as_strided((_k(input), *size), (bs, *stride), off), state=input._jvp_state)


def _extent(size, stride, offset: int) -> int:
    """Elements of storage a strided window reaches: its last element's offset + 1 (0 for an empty one)."""
    if any(n == 0 for n in size):
        return 0
    return offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1


def _scatter_into_copy(t: torch.Tensor, like: torch.Tensor, src: torch.Tensor, size, stride, storage_offset):
    """``torch.as_strided_scatter`` of ``t`` laid out as ``like``: ``t``'s values in a fresh storage of ``like``'s
    size, strides and storage offset (torch's clone_preserve_strides; contiguous where ``like`` overlaps itself), and
    ``src`` copied into ``as_strided(size, stride, storage_offset)`` of it. Written as copies, which autograd
    differentiates exactly: torch's own input gradient of the op (torch 2.15) is the window, not its complement."""
    if any(st == 0 and n > 1 for st, n in zip(like.stride(), like.shape)):
        out = t.new_zeros(like.shape)
    else:
        n = storage_bytes(like) // like.element_size()
        if n == 0:  # under a torch.func transform its wrapper has no storage to read: what both windows span
            n = max(_extent(like.shape, like.stride(), like.storage_offset()),
                    _extent(size, stride, like.storage_offset() if storage_offset is None else storage_offset))
        storage = t.new_zeros(n)
        out = storage.as_strided(like.shape, like.stride(), like.storage_offset())
    out.copy_(t)
    out.as_strided(size, stride, storage_offset).copy_(src)
    return out


@register_op(torch.as_strided_scatter, T.as_strided_scatter)
def _as_strided_scatter(func, input, src, size, stride, storage_offset=None):
    """as_strided_scatter is linear in ``(input, src)``: block by block (:func:`_scatter_into_copy`), each block laid
    out as the primal block, so the window is where the op puts it in the primal."""
    clones = [t for t in (input, src) if is_clone(t)]

    def block(t, j):
        return t.as_subclass(torch.Tensor)[j] if is_clone(t) else t

    like = block(input, 0)
    outs = [_scatter_into_copy(block(input, j), like, block(src, j), size, stride, storage_offset)
            for j in range(_k(clones[0]))]
    return wrap(torch.stack(outs), state=all(t._jvp_state for t in clones))


_INPLACE_VIEWS = {T.squeeze_: T.squeeze, T.unsqueeze_: T.unsqueeze, T.transpose_: T.transpose, T.t_: T.t,
                  maybe(T, "swapaxes_"): maybe(T, "swapaxes"), maybe(T, "swapdims_"): maybe(T, "swapdims"),
                  T.as_strided_: T.as_strided}


@register_handler(*_INPLACE_VIEWS)
def _inplace_view(func, args, kwargs):
    """In-place view ops (squeeze_, t_, as_strided_...) change the geometry, not the values: the clone
    takes the geometry of the out-of-place view (a view of its own storage), or its values if the
    out-of-place op had to copy."""

    x = args[0]
    oop = _INPLACE_VIEWS[func]
    v = HANDLERS[oop](oop, args, kwargs).as_subclass(torch.Tensor)
    if _same_storage(v, x):
        torch.Tensor.as_strided_(x, v.size(), v.stride(), v.storage_offset())
    else:  # pragma: no cover - a copying fallback: take its storage
        with torch.no_grad():
            x.set_(v.detach())
    return x


def _same_storage(v: torch.Tensor, x: torch.Tensor) -> bool:
    """``v`` (a view op's result) shares ``x``'s storage; under a ``torch.func`` transform, whose wrappers have no
    storage to read, a result that is a view does."""
    try:
        return v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return v._is_view()


@register_op(torch.cat, maybe(torch, "concat"), maybe(torch, "concatenate"), aliases={"axis": "dim"})
def _cat(func, tensors, dim=0):
    """cat on the logical dim; operands of logical shape ``(0,)`` are skipped, as torch skips them (legacy)."""
    tensors = list(tensors)
    k = next(_k(t) for t in tensors if is_clone(t))

    def shape(t):
        return tuple(t.shape[1:]) if is_clone(t) else tuple(t.shape)

    kept = [t for t in tensors if shape(t) != (0,)] or tensors[:1]
    parts = [t.as_subclass(torch.Tensor) if is_clone(t) else as_batch(t, k) for t in kept]
    out = torch.cat(parts, phys_dim(dim, len(shape(kept[0]))))
    return wrap(out, state=_state_of(*[t for t in kept if is_clone(t)]))


COMPLEX_EXACT.update(f for f in (torch.cat, maybe(torch, "concat"), maybe(torch, "concatenate"), torch.stack,
                                 T.__setitem__, T.copy_)
                     if f is not None)  # linear in every argument (the writes: in the target and the value jointly)


@register_op(torch.stack, maybe(torch, "hstack"), maybe(torch, "vstack"), maybe(torch, "dstack"),
             maybe(torch, "column_stack"), maybe(torch, "row_stack"))
def _stack(func, tensors, dim=0):
    """stack on the logical dim; hstack/vstack/dstack/column_stack/row_stack as their definitions
    (atleast_nd, then cat), which run through the clone handlers."""
    tensors = list(tensors)
    if func is not torch.stack:
        return _STACK_DEFS[func.__name__](tensors)
    clones = [t for t in tensors if is_clone(t)]
    k = _k(clones[0])
    n = _lnd(clones[0]) + 1
    parts = [t.as_subclass(torch.Tensor) if is_clone(t) else as_batch(t, k) for t in tensors]
    return wrap(torch.stack(parts, phys_dim(dim, n)), state=_state_of(*clones))


def _atleast(t: Any, n: int) -> Any:
    """``torch.atleast_{n}d`` on the logical shape of a clone (plain tensors as torch does)."""
    if not is_clone(t):
        return getattr(torch, f"atleast_{n}d")(t)
    ln, p = _lnd(t), t.as_subclass(torch.Tensor)
    if ln >= n:
        return t
    lead = p.shape[1:]
    shape = {0: (1,) * n, 1: ((1,) + tuple(lead) + (1,) * (n - 2))[:n] if n > 1 else tuple(lead),
             2: tuple(lead) + (1,)}[ln]
    return wrap(p.reshape(_k(t), *shape), state=t._jvp_state)


def _hstack(ts):
    ts = [_atleast(t, 1) for t in ts]
    dim = 0 if all((_lnd(t) if is_clone(t) else t.dim()) == 1 for t in ts) else 1
    return _cat(torch.cat, ts, dim)


def _column_stack(ts):
    cols = []
    for t in ts:
        nd = _lnd(t) if is_clone(t) else t.dim()
        if nd <= 1:
            n = (t.shape[1] if nd == 1 else 1) if is_clone(t) else t.numel()
            t = wrap(t.as_subclass(torch.Tensor).reshape(_k(t), n, 1), state=t._jvp_state) if is_clone(t) \
                else t.reshape(n, 1)
        cols.append(t)
    return _cat(torch.cat, cols, 1)


_STACK_DEFS = {
    "hstack": _hstack,
    "vstack": lambda ts: _cat(torch.cat, [_atleast(t, 2) for t in ts], 0),
    "row_stack": lambda ts: _cat(torch.cat, [_atleast(t, 2) for t in ts], 0),
    "dstack": lambda ts: _cat(torch.cat, [_atleast(t, 3) for t in ts], 2),
    "column_stack": _column_stack,
}


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
        if state_write(func, args, kwargs) is not NOT_STATE:
            return None
        fill_or_refuse(x, blocks_of(idx, value),
                       "jvpreg clone mode: `t[...] = h` writes batch data into a tensor created outside the batch. "
                       "Create `t` from the batch (e.g. torch.zeros_like(h), h.new_zeros(...)) or collect the pieces "
                       "with torch.stack/torch.cat.")
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
        out = state_write(func, args, kwargs)
        if out is not NOT_STATE:
            return out
        fill_or_refuse(x, blocks_of(src),
                       "jvpreg clone mode: `t.copy_(h)` writes batch data into a tensor created outside the batch; "
                       "create `t` from the batch instead (torch.zeros_like(h)).")
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


register_handler(T.fill_, T.zero_, maybe(torch, "fill_"), maybe(torch, "zero_"))(_fill_like)


def _random_inplace(func, args, kwargs):
    """In-place random draws: one draw (on the primal block) shared by every block."""
    x = args[0]
    p = x.as_subclass(torch.Tensor)
    rest = [primal(a) for a in args[1:]]
    a, blocks = split(p, differences=False)
    getattr(a, func.__name__)(*rest, **kwargs)
    blocks.copy_(a)
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


def _pads_logical_dims_only(func, p: torch.Tensor, pad, rest: tuple) -> None:
    """A pad longer than twice the logical dims would pad the block dim of the physical tensor: torch refuses it on
    the logical tensor, so the primal block is called to raise torch's own error."""
    if len(pad) > 2 * (p.dim() - 1):
        func(p[0], pad, *rest)
        raise UnsupportedOpError(f"jvpreg clone mode: {op_name(func)}: a pad of length {len(pad)} on a "
                                 f"{p.dim() - 1}-d input would pad the block dim; pad at most 2 entries per dim.")


@register_op(torch.constant_pad_nd)
def _constant_pad_nd(func, input, pad, value=0):
    """``constant_pad_nd(x, pad, v)`` is affine in ``x`` (``v`` cancels in block differences): one call on the blocks."""
    if not is_clone(input) or is_clone(value):
        return fallback(func, (input, pad, value), {})
    p = input.as_subclass(torch.Tensor)
    _pads_logical_dims_only(func, p, pad, (value,))
    return wrap(torch.constant_pad_nd(p, pad, value), state=input._jvp_state)


@register_op(F.pad, torch._C._nn.pad if hasattr(torch._C._nn, "pad") else None)
def _pad(func, input, pad, mode="constant", value=None):
    x = input
    if not is_clone(x) or is_clone(value):
        return fallback(func, (input, pad, mode, value), {})
    p = x.as_subclass(torch.Tensor)
    _pads_logical_dims_only(func, p, pad, (mode, value))
    if mode == "constant":
        return wrap(F.pad(p, pad, mode, value), state=x._jvp_state)
    nsp = len(pad) // 2
    lead, sp = p.shape[:-nsp], p.shape[-nsp:]
    out = F.pad(p.reshape(-1, 1, *sp), pad, mode)
    return wrap(out.reshape(*lead, *out.shape[-nsp:]), state=x._jvp_state)
