"""Products of two batch tensors: first-order (Leibniz) expansion at the primal block.

For a bilinear ``op`` (mul, matmul, bmm, einsum, attention products):
``out_j = op(z1_j, a2) + op(a1, z2_j - a2)``, i.e. ``op(a1, a2) + op(a1, d2) + op(d1, a2)``.
The first term is one call on every block at once. With a single varying operand the op is
affine in it and runs on every block directly. Division by a batch tensor:
``out_j = q + (d1 - q * d2) / a2``, ``q = a1 / a2``.
"""
from __future__ import annotations

import torch

from jvpreg.clone.eager.dispatch import fallback, flat_clones, per_block, state_eval
from jvpreg.clone.core.registry import COMPLEX_AFFINE, maybe, register_handler, register_op
from jvpreg.clone.eager.writes import detached_target, write_back
from jvpreg.clone.rules.structural import align, elementwise, elementwise_inplace
from jvpreg.clone.core.tensor import block_delta, is_clone, stack_blocks, tile, wrap

T = torch.Tensor


def _varying_positions(flat, idx):
    """Positions of the clones that carry tangents (real or complex: a complex one reaches a product rule only where
    the op is affine in it, :func:`jvpreg.clone.eager.dispatch.complex_exact`)."""
    return [i for i in idx if not flat[i]._jvp_state and (flat[i].is_floating_point() or flat[i].is_complex())]


def _aligned_pair(x, y):
    cx, cy = is_clone(x), is_clone(y)
    pos = [i for i, c in enumerate((cx, cy)) if c]
    x2, y2 = align([x, y], pos)
    return x2, y2


@register_handler(torch.mul, T.mul, T.__mul__, T.__rmul__, maybe(torch, "multiply"), maybe(T, "multiply"))
def mul(func, args, kwargs):
    flat, spec, idx = flat_clones(args, kwargs)
    if len(_varying_positions(flat, idx)) < 2:
        return elementwise(func, args, kwargs)
    x, y = _aligned_pair(args[0], args[1])
    a1, a2 = x[0], y[0]
    return wrap(stack_blocks(a1 * a2, a1 * y[1:] + block_delta(x[1:], a1) * a2))


COMPLEX_AFFINE.update(f for f in (torch.mul, T.mul, T.__mul__, T.__rmul__, maybe(torch, "multiply"),
                                  maybe(T, "multiply"), T.mul_, T.__imul__, maybe(T, "multiply_")) if f is not None)


@register_handler(T.mul_, T.__imul__, maybe(T, "multiply_"))
def mul_(func, args, kwargs):
    flat, spec, idx = flat_clones(args, kwargs)
    if len(_varying_positions(flat, idx)) < 2:
        return elementwise_inplace(func, args, kwargs)
    return write_back(func, args[0], mul(torch.mul, detached_target(args[:2], {}), {}))


def _divide(x, y, kwargs):
    """x / y with a varying denominator (and any numerator)."""
    vx = is_clone(x) and not x._jvp_state
    xx, yy = _aligned_pair(x, y)
    a1 = xx[0] if is_clone(x) else xx
    a2 = yy[0]
    q = a1 / a2
    d2 = block_delta(yy[1:], a2)
    d1 = block_delta(xx[1:], a1) if vx else 0
    return wrap(stack_blocks(q, q + (d1 - q * d2) / a2))


@register_op(torch.div, T.div, T.__truediv__, torch.true_divide, T.true_divide, maybe(torch, "divide"),
             maybe(T, "divide"))
def div(func, input, other, *, rounding_mode=None):
    """x / y; with ``rounding_mode`` ("floor", "trunc") piecewise constant: zero tangent (torch's convention)."""
    if rounding_mode is not None:
        return state_eval(func, (input, other), {"rounding_mode": rounding_mode})
    if not (is_clone(other) and not other._jvp_state):
        return elementwise(func, (input, other), {})
    return _divide(input, other, {})


@register_handler(T.__rtruediv__)
def rdiv(func, args, kwargs):
    y, x = args[0], args[1]  # other / self
    if not (is_clone(y) and not y._jvp_state):
        return elementwise(func, args, kwargs)
    if not torch.is_tensor(x):
        x = torch.as_tensor(x, dtype=y.dtype, device=y.device)
    return _divide(x, y, {})


@register_op(T.div_, T.__itruediv__, T.true_divide_, maybe(T, "divide_"))
def div_(func, input, other, *, rounding_mode=None):
    if rounding_mode is not None:
        return write_back(func, input, div(torch.div, input, other, rounding_mode=rounding_mode))
    if not (is_clone(other) and not other._jvp_state):
        return elementwise_inplace(func, (input, other), {})
    return write_back(func, input, _divide(detached_target((input,), {})[0], other, {}))


def _bilinear(func, args, kwargs):
    """Generic two-operand expansion (module docstring). Block 0 is the very call a plain forward makes
    (``op(a1, a2)``, bit-identical: batch statistics downstream match a plain forward exactly); the tangent
    blocks are ``op(z1_j, a2) (+ op(a1, d2_j))``, one batched call over blocks 1.. ."""
    flat, spec, idx = flat_clones(args, kwargs)
    var = _varying_positions(flat, idx)
    if not var:
        return state_eval(func, args, kwargs)
    if len(var) > 2:
        return fallback(func, args, kwargs)
    from torch.utils._pytree import tree_unflatten

    f0 = list(flat)
    for i in idx:
        f0[i] = flat[i][0]
    a0, k0 = tree_unflatten(f0, spec)
    out0 = func(*a0, **k0)
    tail = list(flat)
    for i in idx:  # blocks 1.. of every clone (state clones too), as a (K-1)-block clone
        tail[i] = wrap(flat[i][1:], state=flat[i]._jvp_state)
    if len(var) == 2:
        tail[var[1]] = flat[var[1]][0]
    ta, tk = tree_unflatten(tail, spec)
    rest = per_block(func, ta, tk).as_subclass(torch.Tensor)
    if len(var) == 2:
        i2 = var[1]
        k = flat[i2].shape[0]
        extras = []
        for j in range(1, k):
            f2 = list(f0)
            f2[i2] = block_delta(flat[i2][j], flat[i2][0])
            a2, k2 = tree_unflatten(f2, spec)
            extras.append(func(*a2, **k2))
        rest = rest + torch.stack(extras)
    return wrap(stack_blocks(out0, rest))


@register_handler(torch.matmul, T.matmul, T.__matmul__, torch.mm, T.mm, torch.bmm, T.bmm, torch.einsum,
                  maybe(torch, "mv"), maybe(T, "mv"), maybe(torch, "dot"), maybe(T, "dot"), maybe(torch, "inner"),
                  maybe(torch, "outer"), maybe(T, "outer"), maybe(torch, "tensordot"), maybe(torch, "kron"),
                  maybe(torch, "cross"), maybe(torch.linalg, "vecdot"))
def matmul(func, args, kwargs):
    flat, spec, idx = flat_clones(args, kwargs)
    var = _varying_positions(flat, idx)
    if len(var) < 2 and func in (torch.matmul, T.matmul, T.__matmul__) and is_clone(args[0]) \
            and torch.is_tensor(args[1]) and not is_clone(args[1]) and args[1].dim() <= 2:
        # x @ W with a constant W: every leading dim (blocks included) is a batch dim
        return wrap(torch.matmul(args[0].as_subclass(torch.Tensor), args[1]), state=args[0]._jvp_state)
    return _bilinear(func, args, kwargs)


COMPLEX_AFFINE.update(f for f in (torch.matmul, T.matmul, T.__matmul__, torch.mm, T.mm, torch.bmm, T.bmm,
                                  torch.einsum, maybe(torch, "mv"), maybe(T, "mv"), maybe(torch, "tensordot"))
                     if f is not None)  # one varying operand: op(z_j, W) on every block (a Fourier layer's einsum)


@register_handler(T.__rmatmul__)
def rmatmul(func, args, kwargs):
    return matmul(torch.matmul, (args[1], args[0]), {})


def _scaled(t, c):
    return t if c == 1 else t * c


@register_handler(torch.baddbmm, T.baddbmm, torch.addmm, T.addmm, torch.addbmm, T.addbmm, maybe(torch, "addmv"),
                  maybe(T, "addmv"), torch.addr, T.addr, torch.addcmul, T.addcmul, torch.addcdiv, T.addcdiv,
                  reentrant=True)
def add_product(func, args, kwargs):
    """``beta * input + alpha * (b1 op b2)`` (addmm, baddbmm, addbmm, addmv, addr; ``beta = 0`` ignores the input,
    NaN and infinities included, as torch does) and
    ``input + value * t1 op t2`` (addcmul, addcdiv), run as their parts through the product rules."""
    name = func.__name__
    input, t1, t2 = args[0], args[1], args[2]
    if name in ("addcmul", "addcdiv"):
        value = args[3] if len(args) > 3 else kwargs.get("value", 1)
        prod = t1 * t2 if name == "addcmul" else t1 / t2
        return input + _scaled(prod, value)
    beta = args[3] if len(args) > 3 else kwargs.get("beta", 1)
    alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
    prod = {"baddbmm": torch.bmm, "addmm": torch.mm, "addmv": torch.mv, "addr": torch.outer}.get(name)
    prod = prod(t1, t2) if prod is not None else torch.bmm(t1, t2).sum(0)  # addbmm
    return _scaled(input, beta) + _scaled(prod, alpha) if beta != 0 else _scaled(prod, alpha)


@register_op(maybe(torch, "_grouped_mm"))
def grouped_mm(func, input, mat2, offs=None, bias=None, out_dtype=None):
    """``_grouped_mm(a, b, offs)`` (Mixture-of-Experts layers: each group of rows of ``a`` times its own matrix of
    ``b``), bilinear: ``out_j = gmm(a_j, b_0) + gmm(a_0, b_j - b_0)``, one call per block (the groups are rows of one
    block, so blocks cannot share a call). ``offs`` is state (the primal block's); a bias that varies with the batch
    takes the exact fallback (torch's CPU kernel has no bias to check a rule against)."""
    if is_clone(bias) and not bias._jvp_state:
        return fallback(func, (input, mat2), {"offs": offs, "bias": bias, "out_dtype": out_dtype})
    offs0 = offs[0] if is_clone(offs) else offs
    bias0 = bias[0] if is_clone(bias) else bias
    da = is_clone(input) and not input._jvp_state
    db = is_clone(mat2) and not mat2._jvp_state
    a0 = input[0] if is_clone(input) else input
    b0 = mat2[0] if is_clone(mat2) else mat2
    k = next(t.shape[0] for t in (input, mat2, offs, bias) if is_clone(t))

    def gmm(a, b, with_bias=True):
        return func(a, b, offs=offs0, bias=bias0 if with_bias else None, out_dtype=out_dtype)

    out0 = gmm(a0, b0)
    if not (da or db):
        return wrap(tile(out0, k), state=True)
    blocks = [out0]
    for j in range(1, k):
        out = gmm(input[j], b0) if da else out0
        blocks.append(out + gmm(a0, block_delta(mat2[j], b0), with_bias=False) if db else out)
    return wrap(torch.stack(blocks))
