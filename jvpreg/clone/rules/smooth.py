"""Smooth elementwise ops and softmax: first-order expansion at the primal block.

``out_j = sigma(a) + sigma'(a) * (z_j - a)`` — the difference form then carries
``J u`` exactly (no truncation error: every rule is linear in ``z_j - a``).
``sigma'(a) * d`` is the op's own backward kernel where torch has one with a double backward
(``gelu_backward(d, a)``: one fused kernel), else differentiable primitive ops, so gradients of a
penalty on the JVP include the second-order terms. Softmax along ``dim``:
``out_j = p + p * (d_j - sum(p * d_j))``, ``p = softmax(a)`` (softmax's own backward kernel: its Jacobian
is symmetric); log_softmax:
``out_j = out_a + d_j - sum(p * d_j)``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from jvpreg.clone.eager.dispatch import fallback
from jvpreg.clone.core.registry import maybe
from jvpreg.clone.rules.kinds import register_rule
from jvpreg.clone.core.tensor import block_delta, each_block, is_clone, kept_primal, neg_dim, stack_blocks

T = torch.Tensor
aten = torch.ops.aten


def def_smooth(funcs, inplace=(), *, primal: Callable, doc: str, slope: Callable | None = None,
               kernel: Callable | None = None):
    """Register ``out_j = primal(a) + sigma'(a) * d_j`` for an elementwise op, ``d_j = z_j - a``.

    ``kernel(d, a, out_a)``: torch's own backward kernel of the op (``sigmoid_backward(d, out)`` is
    ``d * sigma'(a)`` in one fused kernel, with its own double backward), called on one block at a
    time (some CPU kernels refuse broadcasting); else ``slope(a, out_a) * d_j`` in primitive ops.
    """

    def rule(input, *args, inplace=False, **kwargs):
        a = kept_primal(input)
        out_a = primal(a, *args, **kwargs)
        d = block_delta(input[1:], a)
        if kernel is not None:
            tan = each_block(lambda b: kernel(b, a, out_a, *args, **kwargs), d)
        else:
            tan = slope(a, out_a, *args, **kwargs) * d
        return stack_blocks(out_a, out_a + tan)

    rule.__doc__ = doc
    rule.__name__ = rule.__qualname__ = doc.split("'")[0] if "'" in doc else doc.split("(")[0]
    return register_rule(*funcs, inplace=inplace, inplace_safe=True)(rule)  # saves no view of its input


_sig = torch.sigmoid
def_smooth([torch.sigmoid, T.sigmoid, F.sigmoid], [torch.sigmoid_, T.sigmoid_], primal=torch.sigmoid,
           kernel=lambda d, a, o: aten.sigmoid_backward(d, o), doc="sigmoid'(a) = s (1 - s)")
def_smooth([torch.tanh, T.tanh, F.tanh], [torch.tanh_, T.tanh_], primal=torch.tanh,
           kernel=lambda d, a, o: aten.tanh_backward(d, o), doc="tanh'(a) = 1 - tanh(a)^2")
def_smooth([torch.exp, T.exp], [torch.exp_, T.exp_], primal=torch.exp, slope=lambda a, o: o, doc="exp'(a) = exp(a)")
def_smooth([torch.log, T.log], [torch.log_, T.log_], primal=torch.log, slope=lambda a, o: 1 / a, doc="log'(a) = 1/a")
def_smooth([torch.sqrt, T.sqrt], [torch.sqrt_, T.sqrt_], primal=torch.sqrt, slope=lambda a, o: 0.5 / o,
           doc="sqrt'(a) = 1/(2 sqrt(a))")
def_smooth([torch.rsqrt, T.rsqrt], [torch.rsqrt_, T.rsqrt_], primal=torch.rsqrt, slope=lambda a, o: -0.5 * o ** 3,
           doc="rsqrt'(a) = -rsqrt(a)^3 / 2")
def_smooth([torch.reciprocal, T.reciprocal], [torch.reciprocal_, T.reciprocal_], primal=torch.reciprocal,
           slope=lambda a, o: -o * o, doc="(1/a)' = -1/a^2")
def_smooth([torch.sin, T.sin], [torch.sin_, T.sin_], primal=torch.sin, slope=lambda a, o: torch.cos(a),
           doc="sin'(a) = cos(a)")
def_smooth([torch.cos, T.cos], [torch.cos_, T.cos_], primal=torch.cos, slope=lambda a, o: -torch.sin(a),
           doc="cos'(a) = -sin(a)")
def_smooth([torch.square, T.square], [maybe(torch, "square_"), maybe(T, "square_")], primal=torch.square,
           slope=lambda a, o: 2 * a, doc="square'(a) = 2a")
# silu_backward and mish_backward have no double backward in torch: their slopes stay in primitive ops
def_smooth([F.silu], [], primal=F.silu, slope=lambda a, o: _sig(a) * (1 + a * (1 - _sig(a))),
           doc="silu'(a) = s (1 + a (1 - s))")
def_smooth([F.logsigmoid, maybe(torch._C._nn, "log_sigmoid")], [], primal=F.logsigmoid,
           slope=lambda a, o: _sig(-a), doc="logsigmoid'(a) = sigmoid(-a)")
def_smooth([F.gelu, maybe(torch._C._nn, "gelu")], [maybe(torch._C._nn, "gelu_")], primal=F.gelu,
           kernel=lambda d, a, o, approximate="none": aten.gelu_backward(d, a, approximate=approximate),
           doc="gelu'(a) = Phi(a) + a phi(a)")
def_smooth([F.softplus, maybe(torch._C._nn, "softplus")], [], primal=F.softplus,
           kernel=lambda d, a, o, beta=1.0, threshold=20.0: aten.softplus_backward(d, a, beta, threshold),
           doc="softplus'(a) = sigmoid(beta a) (1 above the threshold)")


def _elu_primal(a, alpha=1.0, inplace=False):
    return F.elu(a, alpha)


def _elu_kernel(d, a, o, alpha=1.0, inplace=False):
    return aten.elu_backward(d, alpha, 1, 1, False, a)


def_smooth([F.elu, maybe(torch._C._nn, "elu")], [F.elu_, maybe(torch._C._nn, "elu_")], primal=_elu_primal,
           kernel=_elu_kernel, doc="elu'(a) = 1 (a > 0) | alpha exp(a)")


def _celu_primal(a, alpha=1.0, inplace=False):
    return F.celu(a, alpha)


def _celu_kernel(d, a, o, alpha=1.0, inplace=False):
    return aten.elu_backward(d, alpha, 1, 1 / alpha, False, a)  # celu(x) = elu(x; alpha, input_scale = 1 / alpha)


def_smooth([F.celu, torch.celu], [maybe(F, "celu_"), torch.celu_], primal=_celu_primal, kernel=_celu_kernel,
           doc="celu'(a) = 1 (a > 0) | exp(a / alpha)")

_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _selu_primal(a, inplace=False):
    return F.selu(a)


def _selu_kernel(d, a, o, inplace=False):
    return aten.elu_backward(d, _SELU_ALPHA, _SELU_SCALE, 1, False, a)  # selu(x) = scale elu(x; alpha)


def_smooth([F.selu, torch.selu], [maybe(F, "selu_"), torch.selu_], primal=_selu_primal, kernel=_selu_kernel,
           doc="selu'(a) = scale (a > 0) | scale alpha exp(a)")


@register_rule(F.mish, maybe(torch._C._nn, "mish"), inplace=(maybe(torch._C._nn, "mish_"),))
def mish(input, inplace=False):
    """mish'(a) = tanh(sp) + a sigmoid(a) (1 - tanh(sp)^2), sp = softplus(a)."""
    a = input[0]
    t = torch.tanh(F.softplus(a))
    out_a = a * t
    s = t + a * torch.sigmoid(a) * (1 - t * t)
    return stack_blocks(out_a, out_a + s * block_delta(input[1:], a))


@register_rule(torch.pow, T.pow, T.__pow__, inplace=(T.pow_, T.__ipow__), inplace_kwarg=None)
def pow(input, exponent):
    """(a^e)' = e a^(e-1) for a constant exponent; other cases use the exact fallback."""
    if not is_clone(input) or (is_clone(exponent) and not exponent._jvp_state) or torch.is_tensor(exponent):
        return fallback(torch.pow, (input, exponent), {})
    a = input[0]
    out_a = torch.pow(a, exponent)
    s = exponent * torch.pow(a, exponent - 1) if exponent != 0 else torch.zeros_like(a)
    return stack_blocks(out_a, out_a + s * block_delta(input[1:], a))


def _softmax_args(args, kwargs, ndim):
    dim = args[0] if args else kwargs.get("dim")
    dtype = kwargs.get("dtype")
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
    if dim is None:  # legacy implicit dim
        dim = 0 if ndim in (0, 1, 3) else 1
    return neg_dim(dim, ndim), dtype


def _softmax(log: bool, safe: bool = False):
    def rule(input, *args, **kwargs):
        a = input[0]
        dim, dtype = _softmax_args(args, kwargs, a.dim())
        x = input if dtype is None else input.to(dtype)
        a = x[0]
        d = block_delta(x[1:], a)
        if log:
            out_a = torch.log_softmax(a, dim)
            p = out_a.exp()
            tan = out_a + d - (p * d).sum(dim, keepdim=True)
        else:  # softmax's Jacobian is symmetric: its backward kernel applied to d_j is J d_j
            out_a = aten._safe_softmax(a, dim) if safe else torch.softmax(a, dim)  # safe: 0 on all -inf rows
            # (out_a's dtype, not a's: CUDA's autocast runs softmax in float32, and the kernel takes one dtype)
            tan = out_a + each_block(lambda b: aten._softmax_backward_data(b.to(out_a.dtype), out_a, dim, out_a.dtype),
                                     d)
        return stack_blocks(out_a, tan)

    rule.__doc__ = ("log_softmax: out_j = out_a + d_j - sum(p d_j)" if log
                    else "softmax: out_j = p + p (d_j - sum(p d_j))")
    return rule


register_rule(F.softmax, torch.softmax, T.softmax, maybe(torch, "_softmax"), inplace_kwarg=None)(_softmax(False))
register_rule(F.log_softmax, torch.log_softmax, T.log_softmax, inplace_kwarg=None)(_softmax(True))
if hasattr(aten, "_safe_softmax"):  # what the math attention kernel runs: rows of -inf give 0, not NaN
    register_rule(aten._safe_softmax, aten._safe_softmax.default, inplace_kwarg=None)(_softmax(False, safe=True))
