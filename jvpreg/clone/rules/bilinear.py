"""Products of two batch tensors: first-order (Leibniz) expansion at the primal block.

For a bilinear ``op`` (mul, matmul, bmm, einsum, attention products):
``out_j = op(z1_j, a2) + op(a1, z2_j - a2)``, i.e. ``op(a1, a2) + op(a1, d2) + op(d1, a2)``
(:func:`jvpreg.clone.rules.kinds.bilinear`). With a single varying operand the op is affine in it and runs on every
block directly. Division by a batch tensor: ``out_j = q + (d1 - q * d2) / a2``, ``q = a1 / a2``.
"""
from __future__ import annotations

import torch

from jvpreg.clone.core.registry import COMPLEX_AFFINE, maybe, register_handler, register_op
from jvpreg.clone.core.tensor import varies, wrap
from jvpreg.clone.eager.dispatch import fallback, state_eval
from jvpreg.clone.eager.writes import detached_target, write_back
from jvpreg.clone.rules.blocks import assemble, count, each_block, primal, split, tangents
from jvpreg.clone.rules.kinds import aligned, bilinear, composite, elementwise, elementwise_inplace

T = torch.Tensor

_MUL = (torch.mul, T.mul, T.__mul__, T.__rmul__, maybe(torch, "multiply"), maybe(T, "multiply"))
_MUL_ = (T.mul_, T.__imul__, maybe(T, "multiply_"))
bilinear(*_MUL, inplace=_MUL_, elementwise_op=True)
COMPLEX_AFFINE.update(f for f in _MUL + _MUL_ if f is not None)  # one varying operand: c z

_MATMUL = (torch.matmul, T.matmul, T.__matmul__)
matmul = bilinear(*_MATMUL, leading_batch=True)
bilinear(torch.mm, T.mm, torch.bmm, T.bmm, torch.einsum, maybe(torch, "mv"), maybe(T, "mv"), maybe(torch, "dot"),
         maybe(T, "dot"), maybe(torch, "inner"), maybe(torch, "outer"), maybe(T, "outer"), maybe(torch, "tensordot"),
         maybe(torch, "kron"), maybe(torch, "cross"), maybe(torch.linalg, "vecdot"))
COMPLEX_AFFINE.update(f for f in (*_MATMUL, torch.mm, T.mm, torch.bmm, T.bmm, torch.einsum, maybe(torch, "mv"),
                                  maybe(T, "mv"), maybe(torch, "tensordot"))
                      if f is not None)  # one varying operand: op(z_j, W) on every block (a Fourier layer's einsum)


@register_handler(T.__rmatmul__)
def rmatmul(func, args, kwargs):
    """``y @ x`` for ``x.__rmatmul__(y)``."""
    return matmul(torch.matmul, (args[1], args[0]), {})


def _divide(x, y):
    """x / y with a varying denominator (and any numerator): ``q + (d1 - q d2) / a2``."""
    xx, yy = aligned(x, y)
    a1, d1 = split(xx) if varies(x) else (primal(x), 0)
    a2, d2 = split(yy)
    q = a1 / a2
    return wrap(assemble(q, (d1 - q * d2) / a2))


@register_op(torch.div, T.div, T.__truediv__, torch.true_divide, T.true_divide, maybe(torch, "divide"),
             maybe(T, "divide"))
def div(func, input, other, *, rounding_mode=None):
    """x / y; with ``rounding_mode`` ("floor", "trunc") piecewise constant: zero tangent (torch's convention)."""
    if rounding_mode is not None:
        return state_eval(func, (input, other), {"rounding_mode": rounding_mode})
    if not varies(other):
        return elementwise(func, (input, other), {})
    return _divide(input, other)


@register_handler(T.__rtruediv__)
def rdiv(func, args, kwargs):
    """``x / y`` for ``y.__rtruediv__(x)``, ``x`` a number or a tensor."""
    y, x = args[0], args[1]
    if not varies(y):
        return elementwise(func, args, kwargs)
    if not torch.is_tensor(x):
        x = torch.as_tensor(x, dtype=y.dtype, device=y.device)
    return _divide(x, y)


@register_op(T.div_, T.__itruediv__, T.true_divide_, maybe(T, "divide_"))
def div_(func, input, other, *, rounding_mode=None):
    if rounding_mode is not None:
        return write_back(func, input, div(torch.div, input, other, rounding_mode=rounding_mode))
    if not varies(other):
        return elementwise_inplace(func, (input, other), {})
    return write_back(func, input, _divide(detached_target((input,), {})[0], other))


def _scaled(t, c):
    return t if c == 1 else t * c


def _affine_product(name, product):
    def body(input, t1, t2, beta=1, alpha=1):
        prod = product(t1, t2)
        return _scaled(input, beta) + _scaled(prod, alpha) if beta != 0 else _scaled(prod, alpha)

    body.__name__ = body.__qualname__ = name
    body.__doc__ = (f"{name}: beta * input + alpha * (t1 op t2) through the product rules (beta = 0 ignores the input, "
                    "NaN and infinities included, as torch does).")
    return body


for _name, _product in (("addmm", torch.mm), ("baddbmm", torch.bmm), ("addmv", torch.mv), ("addr", torch.outer),
                        ("addbmm", lambda t1, t2: torch.bmm(t1, t2).sum(0))):
    composite(getattr(torch, _name), getattr(T, _name), own_primal=False)(_affine_product(_name, _product))


@composite(torch.addcmul, T.addcmul, own_primal=False)
def addcmul(input, tensor1, tensor2, value=1):
    """addcmul: input + value * t1 * t2 through the product rules."""
    return input + _scaled(tensor1 * tensor2, value)


@composite(torch.addcdiv, T.addcdiv, own_primal=False)
def addcdiv(input, tensor1, tensor2, value=1):
    """addcdiv: input + value * t1 / t2 through the quotient rule."""
    return input + _scaled(tensor1 / tensor2, value)


@register_op(maybe(torch, "_grouped_mm"))
def grouped_mm(func, input, mat2, offs=None, bias=None, out_dtype=None):
    """``_grouped_mm(a, b, offs)`` (Mixture-of-Experts layers: each group of rows of ``a`` times its own matrix of
    ``b``), bilinear: ``out_j = gmm(a_j, b_0) + gmm(a_0, b_j - b_0)``, one call per block (the groups are rows of one
    block, so blocks cannot share a call). ``offs`` is state (the primal block's); a bias that varies with the batch
    takes the exact fallback (torch's CPU kernel has no bias to check a rule against)."""
    if varies(bias):
        return fallback(func, (input, mat2), {"offs": offs, "bias": bias, "out_dtype": out_dtype})
    offs0, bias0 = primal(offs), primal(bias)
    a0, b0 = primal(input), primal(mat2)
    db = tangents(mat2)

    def gmm(a, b, with_bias=True):
        return func(a, b, offs=offs0, bias=bias0 if with_bias else None, out_dtype=out_dtype)

    out0 = gmm(a0, b0)
    if not varies(input) and db is None:
        return wrap(assemble(out0, k=count(input, mat2, offs, bias)), state=True)
    rest = each_block(lambda z: gmm(z, b0), split(input, differences=False)[1]) if varies(input) else out0
    if db is not None:
        rest = rest + each_block(lambda d: gmm(a0, d, with_bias=False), db)
    return wrap(assemble(out0, blocks=rest))
