"""Registration of clone rules by kind: each helper turns an op's formula into its rule.

A rule is called like the op, with clone arguments seen as physical ``(K, *L)`` batches, and returns the physical
output; :mod:`jvpreg.clone.rules.blocks` splits the batches (primal block ``a``, differences ``d_j = z_j - a``) and
stacks the output (``[out_a; out_a + t_1; ...]``). The kinds:

* :func:`smooth` -- an elementwise ``f`` linearised at the primal: the formula is ``t = f'(a) d``;
* :func:`slope` -- a continuous piecewise-affine op: the formula is ``out(a)`` and the slope ``Q`` of the primal's
  piece (``relu'(0) = 0``: the kink conventions are the formulas');
* :func:`linear` -- affine in its clone arguments: every block through the op, nothing to linearise;
* :func:`bilinear` -- products of two clone arguments: the product rule in difference form;
* :func:`composite` -- a composition of ops that have rules (losses, norms);
* :func:`register_state` -- piecewise-constant outputs (comparisons, argmax, random draws): block 0, repeated;
* :func:`register_rule` -- any other rule written on blocks (the helpers above build on it).

Users add a rule for their own op the same way::

    from jvpreg.clone.rules import kinds

    @kinds.slope(torch.ops.mylib.soft_threshold.default)
    def soft_threshold(a, lam):                   # a: the primal block
        keep = a.abs() > lam                      # the slope: 1 off the dead zone, 0 in it (0 at the kink)
        return torch.ops.mylib.soft_threshold(a, lam), keep.to(a.dtype)
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_map, tree_unflatten

from jvpreg.clone.core.registry import COMPLEX_AFFINE, HANDLERS, existing, position, register_handler, register_op
from jvpreg.clone.core.tensor import (CloneTensor, any_clone, is_clone, iter_clones, raw, varies, wrap,
    wrap_tree)
from jvpreg.clone.eager.dispatch import NOT_STATE, fallback, flat_clones, into_plain_target, per_block, state_eval
from jvpreg.clone.eager.writes import detached_target, finish, write_back
from jvpreg.clone.rules.blocks import align, assemble, count, each_block, primal, split, stacked, tangents


def register_rule(*funcs: Any, inplace: Iterable[Any] = (), inplace_kwarg: str | None = "inplace",
                  inplace_safe: bool = False, no_grad_inplace: Callable | None = None):
    """Register a rule written on blocks for ``funcs`` (and their in-place variants).

    The rule is called like the op, with clone arguments seen as physical ``(K, *L)``
    tensors, and returns the physical output(s). In-place variants (listed in
    ``inplace``, or called with ``inplace=True``) write the result back into the input; the
    rule then runs on a copy of the input unless ``inplace_safe`` (it saves no view of its
    input for backward, e.g. ``x * mask`` with a constant mask). ``no_grad_inplace(x, *args)``, if
    given, mutates ``x`` directly when no gradient is recorded (no copy back). With no ``funcs`` the rule is
    returned unregistered (a piece another rule calls).
    """
    inplace = tuple(existing(inplace))

    def deco(rule: Callable) -> Callable:
        sig = inspect.signature(rule)
        names = list(sig.parameters)
        accepts_inplace = inplace_kwarg is not None and inplace_kwarg in sig.parameters
        pos = names.index(inplace_kwarg) if accepts_inplace else -1
        if accepts_inplace and sig.parameters[inplace_kwarg].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            pos = -1  # keyword-only

        def run_in_place(args, kwargs):
            target = args[0] if args else None
            if no_grad_inplace is not None and is_clone(target) and not (
                    torch.is_grad_enabled() and target.requires_grad):
                no_grad_inplace(target, *args[1:], **kwargs)
                target._jvp_state = False
                return target
            return finish(rule(*detached_target(args, kwargs, not inplace_safe), **kwargs), args, kwargs, True,
                           funcs[0] if funcs else rule)

        def out_of_place(func, args, kwargs):
            at = position(func, inplace_kwarg) if accepts_inplace and pos < 0 else None
            if at is not None and len(args) > at:  # ``F.silu(x, True)``: the flag by position, read by name
                kwargs = dict(kwargs, **{inplace_kwarg: args[at]})
                args = args[:at] + args[at + 1:]
            is_ip = False
            if accepts_inplace:
                if kwargs.get(inplace_kwarg):
                    is_ip = True
                elif 0 <= pos < len(args):
                    is_ip = bool(args[pos])
            if not is_ip:
                return finish(rule(*args, **kwargs), args, kwargs, False)
            return run_in_place(args, {k: v for k, v in kwargs.items() if k != inplace_kwarg} if kwargs else kwargs)

        def in_place(func, args, kwargs):
            return run_in_place(args, {k: v for k, v in kwargs.items() if k != inplace_kwarg})

        rule.__dict__.setdefault("__jvpreg_kind__", "rule")
        functools.wraps(rule)(out_of_place)
        functools.wraps(rule)(in_place)
        for f in existing(funcs):
            HANDLERS[f] = out_of_place
        for f in inplace:
            HANDLERS[f] = in_place
        rule.__jvpreg_funcs__ = tuple(existing(funcs)) + inplace
        return rule

    return deco


def register_state(*funcs: Any) -> None:
    """Declare ops whose outputs carry state only (zero tangent): evaluated on block 0."""
    for f in existing(funcs):
        HANDLERS[f] = state_eval


def _named(rule: Callable, formula: Callable, kind: str) -> Callable:
    """``rule`` under the name, docstring and module of the formula it was built from, tagged with its kind (what
    :func:`jvpreg.clone.rule_for` and ``python -m jvpreg.clone.rules`` show); not ``functools.wraps``, whose
    ``__wrapped__`` would hand the formula's signature to :func:`register_rule`."""
    rule.__name__, rule.__qualname__ = formula.__name__, formula.__qualname__
    rule.__doc__, rule.__module__ = formula.__doc__, formula.__module__
    rule.__jvpreg_kind__ = kind
    return rule


def smooth(*funcs: Any, inplace: Iterable[Any] = (), per_block: bool = False):
    """Register an elementwise op ``f`` linearised at the primal: ``out_j = f(a) + f'(a) d_j``.

    The decorated formula ``tangent(d, a, out, *args, **kwargs)`` returns ``f'(a) d`` (``out = f(a)``; the op's
    other arguments as in the call, ``inplace`` left out): for every tangent block at once, or with ``per_block`` one
    block of the primal's shape at a time, for torch's own backward kernels (``sigmoid_backward(d, out)`` is
    ``d f'(a)`` in one fused kernel with its own double backward; some CPU kernels refuse to broadcast). ``f(a)`` is
    the first of ``funcs`` called on the primal block. The rule keeps a copy of the primal block for backward, never
    a view of its input, so the in-place variants write over their input.

    Example::

        @smooth(torch.exp, torch.Tensor.exp, inplace=(torch.exp_,))
        def exp(d, a, out):
            \"\"\"exp'(a) = exp(a)\"\"\"
            return out * d
    """
    op = next(iter(existing(funcs)), None)

    def deco(formula: Callable) -> Callable:
        def rule(input, *args, inplace=False, **kwargs):
            a, d = split(input, kept=True)
            out_a = op(a, *args, **kwargs)
            if per_block:
                t = each_block(lambda b: formula(b, a, out_a, *args, **kwargs), d)
            else:
                t = formula(d, a, out_a, *args, **kwargs)
            return assemble(out_a, t)

        return register_rule(*funcs, inplace=inplace, inplace_safe=True)(_named(rule, formula, "smooth"))

    return deco


def clamped(z: torch.Tensor, inside: torch.Tensor, out_a: torch.Tensor) -> torch.Tensor:
    """``out_j = z_j`` where the primal is inside the identity piece, ``out(a)`` elsewhere, every block in one op:
    ``out_a (1 - m) + z m`` with a float mask (a broadcast ``torch.where`` over the block dim is much slower on the
    CPU); exact on block 0, where ``z_0 = a = out(a)`` inside."""
    m = inside.to(z.dtype)
    return assemble(every_block=torch.addcmul(out_a * (1 - m), z, m))


def slope(*funcs: Any, inplace: Iterable[Any] = (), identity_inside: bool = False, **options: Any):
    """Register a continuous piecewise-affine op, linearised on the primal's piece: ``out_j = out(a) + Q(a) d_j``.

    The decorated formula ``(a, *args, **kwargs) -> (out(a), Q)`` gives the op's output at the primal block and the
    slope of its piece there; at a kink, ``Q`` is the op's convention (the one torch's derivative takes), and a test
    places inputs exactly there. With ``identity_inside``, ``Q`` is the bool mask of the piece where the op is the
    identity, the op being constant on the others (clamps): every block in one op (:func:`clamped`).
    ``options``: :func:`register_rule`'s. With no ``funcs`` the rule is returned unregistered."""
    def deco(formula: Callable) -> Callable:
        def rule(input, *args, inplace=False, **kwargs):
            if identity_inside:
                out_a, inside = formula(primal(input), *args, **kwargs)
                return clamped(input, inside, out_a)
            a, d = split(input)
            out_a, q = formula(a, *args, **kwargs)
            return assemble(out_a, q * d)

        return register_rule(*funcs, inplace=inplace, **options)(_named(rule, formula, "slope"))

    return deco


# ---------------------------------------------------------------------------------------------------- linear


def _with_state(*xs: Any) -> bool:
    return all(x._jvp_state for x in xs if is_clone(x))


def elementwise(func: Callable, args: tuple, kwargs: dict) -> CloneTensor:
    """An elementwise op affine in its clone arguments, on the physical tensors aligned by their logical shapes."""
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
    flat, spec, idx = flat_clones(args, kwargs)
    state = all(flat[i]._jvp_state for i in idx)
    a, k = tree_unflatten(align(flat, idx), spec)
    return wrap(func(*a, **k), state=state)


def elementwise_inplace(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The in-place form of :func:`elementwise`: written into the physical target."""
    target = args[0]
    if not is_clone(target):
        out = into_plain_target(func, args, kwargs)
        if out is not NOT_STATE:
            return out
    flat, spec, idx = flat_clones(args, kwargs)
    state = all(flat[i]._jvp_state for i in idx)
    a, k = tree_unflatten(align(flat, idx), spec)
    func(*a, **k)
    target._jvp_state = state
    return target


def _merged_call(func: Callable, x: CloneTensor, rest: tuple, kwargs: dict, batch_dims: int):
    """``func(x, *rest)`` on every block at once, the physical output ``(K, *out)``; ``None`` where the input's rank
    is neither the op's batched nor its unbatched one."""
    p = raw(x)
    n = x.dim() - 1
    if batch_dims == 0:  # acts on trailing dims only: every leading dim is a batch
        return func(p, *rest, **kwargs)
    if n == batch_dims:
        k, b = p.shape[0], p.shape[1]
        out = func(p.reshape(k * b, *p.shape[2:]), *rest, **kwargs)
        return wrap_tree(out, lambda t: t.reshape(k, b, *t.shape[1:]))
    if n == batch_dims - 1:  # unbatched input: the block dim is the batch
        return func(p, *rest, **kwargs)
    return None


def _weighted(func: Callable, args: tuple, kwargs: dict, batch_dims: int) -> Any:
    """``op(x, W, b, ...)`` linear in ``x`` and in ``W``, affine in ``b``: block ``j`` is
    ``op(z_j, W_0, b_0) + op(a, W_j - W_0, b_j - b_0)``, the input's blocks in the merged batch and a weight's
    tangent (the "swapped layer weight" of docs/design.md §1) applied to the primal input only."""
    x = args[0]
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    rest = args[3:]
    kw = {key: v for key, v in kwargs.items() if key not in ("weight", "bias")}
    w0, b0 = primal(w), primal(b)
    k = count(x, w, b)
    if is_clone(x):
        out = _merged_call(func, x, (w0, b0) + rest, kw, x.dim() - 1 if batch_dims < 0 else batch_dims)
        if out is None:
            return fallback(func, args, kwargs)
    else:
        out = assemble(func(x, w0, b0, *rest, **kw), k=k)
    dw, db = tangents(w, nonfinite=False), tangents(b, nonfinite=False)
    if dw is None and db is None:
        return wrap(out, state=_with_state(x, w, b))
    x0 = primal(x)
    t = stacked([func(x0, torch.zeros_like(w0) if dw is None else dw[j], None if db is None else db[j], *rest, **kw)
                 for j in range(k - 1)])
    out_a, blocks = split(out, differences=False)
    return wrap(assemble(out_a, blocks=blocks + t))


def _batched(batch_dims: int, weighted: bool) -> Callable:
    def batched(func, args, kwargs):
        """Every block through the op in one call on the merged batch (:func:`linear`)."""
        x = args[0]
        others = any_clone(args[1:], kwargs)
        if weighted and (others or not is_clone(x)):
            return _weighted(func, args, kwargs, batch_dims)
        if not is_clone(x) or others:
            return fallback(func, args, kwargs)
        out = _merged_call(func, x, args[1:], kwargs, x.dim() - 1 if batch_dims < 0 else batch_dims)
        if out is None:
            return per_block(func, args, kwargs)
        return wrap_tree(out, lambda t: wrap(t, state=x._jvp_state))

    batched.__jvpreg_kind__ = "linear"
    return batched


def _with_fixed(handler: Callable, fixed: tuple) -> Callable:
    """``handler``, or the exact fallback where an argument named in ``fixed`` carries tangents."""
    @functools.wraps(handler)
    def checked(func, args, kwargs):
        for name in fixed:
            at = position(func, name)
            value = args[at] if at is not None and at < len(args) else kwargs.get(name)
            if varies(value):
                return fallback(func, args, kwargs)
        return handler(func, args, kwargs)

    return checked


def linear(*funcs: Any, batch_dims: int | None = None, weighted: bool = False, elementwise_op: bool = False,
           inplace: Iterable[Any] = (), fixed: tuple = ()) -> None:
    """Register ops affine in their clone arguments: every block goes through the op as the primal does, and the
    difference form carries the tangent with nothing to linearise (a constant offset cancels in ``z_j - a``).

    * ``elementwise_op``: an elementwise op (add, sub, where), clones broadcast by their logical shapes; ``inplace``
      its in-place variants;
    * ``batch_dims=n``: an op on a batch of ``n`` dims (``0``: it acts on trailing dims only, every leading dim a
      batch; ``-1``: the input's own rank), one call on the merged ``(K*B, ...)`` batch; ``weighted``: the op is
      ``op(x, W, b, ...)`` (linear, convolutions), whose varying weights take the difference form
      ``op(z_j, W_0, b_0) + op(a, W_j - W_0, b_j - b_0)``;
    * neither: every block through the op by ``torch.vmap`` (indexing with fixed indices, FFTs).

    ``fixed``: arguments (by name) the op is not affine in (an interpolation weight, a sampling grid): where one
    carries tangents the op takes the exact fallback. The op is exact on complex clones with one varying argument
    (affine over the reals)."""
    if elementwise_op:
        handler = elementwise
    elif batch_dims is not None:
        handler = _batched(batch_dims, weighted)
    else:
        handler = vmapped
    register_handler(*funcs)(_with_fixed(handler, fixed) if fixed else handler)
    if inplace:
        register_handler(*inplace)(elementwise_inplace)
    COMPLEX_AFFINE.update(existing(funcs), existing(inplace))


def vmapped(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Every block through the op (``torch.vmap``): affine in the clone arguments for fixed indices and masks."""
    return per_block(func, args, kwargs)


elementwise.__jvpreg_kind__ = elementwise_inplace.__jvpreg_kind__ = vmapped.__jvpreg_kind__ = "linear"


# ---------------------------------------------------------------------------------------------------- bilinear


def _varying(flat: list, idx: list) -> list:
    """Positions of the clones that carry tangents (real or complex: a complex one reaches a product only where the
    op is affine in it, :func:`jvpreg.clone.eager.dispatch.complex_exact`)."""
    return [i for i in idx if not flat[i]._jvp_state and (flat[i].is_floating_point() or flat[i].is_complex())]


def aligned(x: Any, y: Any) -> tuple:
    """``(x, y)`` aligned by their logical shapes (:func:`jvpreg.clone.rules.blocks.align`)."""
    return tuple(align([x, y], [i for i, c in enumerate((is_clone(x), is_clone(y))) if c]))


def _elementwise_product(func, args, kwargs):
    """Two varying operands of an elementwise product: ``out_j = op(a1, z2_j) + op(d1_j, a2)``, every block in one
    call each."""
    x, y = aligned(args[0], args[1])
    a1, d1 = split(x)
    a2, z2 = split(y, differences=False)
    return wrap(assemble(func(a1, a2), blocks=func(a1, z2) + func(d1, a2)))


def _general_product(func, args, kwargs):
    """Two-operand expansion for any product: block 0 is the very call a plain forward makes (``op(a1, a2)``,
    bit-identical: batch statistics downstream match a plain forward exactly); the tangent blocks are
    ``op(z1_j, a2) (+ op(a1, d2_j))``, one batched call over blocks 1.. ."""
    flat, spec, idx = flat_clones(args, kwargs)
    var = _varying(flat, idx)
    if not var:
        return state_eval(func, args, kwargs)
    if len(var) > 2:
        return fallback(func, args, kwargs)
    f0 = list(flat)
    for i in idx:
        f0[i] = primal(flat[i])
    a0, k0 = tree_unflatten(f0, spec)
    out0 = func(*a0, **k0)
    tail = list(flat)
    for i in idx:  # blocks 1.. of every clone (state clones too), as a (K-1)-block clone
        tail[i] = wrap(split(flat[i], differences=False)[1], state=flat[i]._jvp_state)
    if len(var) == 2:
        tail[var[1]] = f0[var[1]]
    ta, tk = tree_unflatten(tail, spec)
    rest = raw(per_block(func, ta, tk))
    if len(var) == 2:
        second = []
        for d2 in tangents(flat[var[1]]).unbind(0):
            f2 = list(f0)
            f2[var[1]] = d2
            a2, k2 = tree_unflatten(f2, spec)
            second.append(func(*a2, **k2))
        rest = rest + torch.stack(second)
    return wrap(assemble(out0, blocks=rest))


def bilinear(*funcs: Any, inplace: Iterable[Any] = (), elementwise_op: bool = False,
             leading_batch: bool = False) -> Callable:
    """Register products of two clone arguments (mul, matmul, einsum, attention's products), bilinear:
    ``out_j = op(z1_j, a2) + op(a1, z2_j - a2)``, i.e. ``op(a1, a2) + op(d1_j, a2) + op(a1, d2_j)`` with no
    second-order term; block 0 is the plain call ``op(a1, a2)``. With one varying operand the op is linear in it
    (:func:`linear`).

    * ``elementwise_op``: the op broadcasts over the block dim (mul): one call per term for every block;
      ``inplace`` its in-place variants (written back);
    * ``leading_batch``: the op takes every leading dim of its first operand as a batch (matmul): with a constant
      matrix on the right, one call on the physical batch;
    * else the first term runs every block through the op (``torch.vmap``), the second one call per tangent.

    Returns the handler (``handler(func, args, kwargs)``), for an op that is this one with its operands swapped."""
    def product(func, args, kwargs):
        """The product rule in difference form (:func:`bilinear`)."""
        flat, spec, idx = flat_clones(args, kwargs)
        two = len(_varying(flat, idx)) >= 2
        if elementwise_op:
            return _elementwise_product(func, args, kwargs) if two else elementwise(func, args, kwargs)
        if leading_batch and not two and is_clone(args[0]) and torch.is_tensor(args[1]) and not is_clone(args[1]) \
                and args[1].dim() <= 2:
            return wrap(torch.matmul(raw(args[0]), args[1]), state=args[0]._jvp_state)
        return _general_product(func, args, kwargs)

    def product_in_place(func, args, kwargs):
        """The product out of place, written back into its target."""
        flat, spec, idx = flat_clones(args, kwargs)
        if len(_varying(flat, idx)) < 2:
            return elementwise_inplace(func, args, kwargs)
        return write_back(func, args[0], product(funcs[0], detached_target(args[:2], {}), {}))

    product.__jvpreg_kind__ = product_in_place.__jvpreg_kind__ = "bilinear"
    register_handler(*funcs)(product)
    register_handler(*inplace)(product_in_place)
    return product


# ---------------------------------------------------------------------------------------------------- composite


def _primal_call(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The op itself on the primal blocks of its clone arguments: a plain call."""
    with DisableTorchFunctionSubclass():
        a0, k0 = tree_map(primal, (args, kwargs))
        return func(*a0, **k0)


def _fallback(func: Callable, args: tuple, kwargs: dict) -> Any:
    with DisableTorchFunctionSubclass():
        return fallback(func, args, kwargs)


def _combine(out_a: torch.Tensor, body_out: CloneTensor) -> CloneTensor:
    """``[out_a; out_a + (body_j - body_0)]`` as a clone: the tangents of ``body``, the primal of the op."""
    with DisableTorchFunctionSubclass():
        return wrap(assemble(out_a, split(raw(body_out))[1]))


def composite(*funcs: Any, aliases: dict | None = None, check: Callable | None = None, own_primal: bool = True):
    """Register ``body(input, ...)``, called like the op on clone batches, as the linearisation of ``funcs``: every op
    of the body goes through its own rule, so ``body`` only has to be a correct formula of the op (conventions where
    it is not smooth: those of its parts). The primal block is the op itself on the primal blocks (bit-identical to
    a plain call), the tangent blocks are the body's: ``out_j = op(a) + (body(z)_j - body(z)_0)``; with
    ``own_primal=False`` the body's output is the op's (a decomposition, where the op's own kernel would cost a
    call more). A body may return ``NotImplemented`` for arguments it does not cover: the exact fallback runs.
    ``check(out_a, out)``, if given, sees the op's primal output and the body's clone output before they combine.
    Tuple outputs: each floating-point part combined, the others (indices) the body's."""
    def deco(body: Callable) -> Callable:
        @register_op(*funcs, aliases=aliases, reentrant=True)
        def handler(func, *args, **kwargs):
            if not any(varies(t) for t in iter_clones((args, kwargs))):
                return _fallback(func, args, kwargs)
            if not own_primal:
                out = body(*args, **kwargs)
                return _fallback(func, args, kwargs) if out is NotImplemented else out
            out_a = _primal_call(func, args, kwargs)
            out = body(*args, **kwargs)
            if out is NotImplemented:
                return _fallback(func, args, kwargs)
            if check is not None:
                check(out_a, out)
            if isinstance(out, tuple):  # (var, mean) or (values, indices): indices are the primal's
                parts = tuple(_combine(a, b) if is_clone(b) and b.is_floating_point() else b
                              for a, b in zip(out_a, out))
                return type(out_a)(parts)
            return _combine(out_a, out)

        handler.__doc__ = body.__doc__
        handler.__wrapped__ = body
        body.__jvpreg_kind__ = "composite"
        return body

    return deco
