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

import torch
import torch.nn.functional as F

from jvpreg.clone.core.registry import maybe
from jvpreg.clone.core.tensor import is_clone, neg_dim
from jvpreg.clone.eager.dispatch import fallback
from jvpreg.clone.rules.blocks import assemble, each_block, split
from jvpreg.clone.rules.kinds import register_rule, smooth

T = torch.Tensor
aten = torch.ops.aten


@smooth(torch.sigmoid, T.sigmoid, F.sigmoid, inplace=(torch.sigmoid_, T.sigmoid_), per_block=True)
def sigmoid(d, a, out):
    """sigmoid'(a) = s (1 - s)"""
    return aten.sigmoid_backward(d, out)


@smooth(torch.tanh, T.tanh, F.tanh, inplace=(torch.tanh_, T.tanh_), per_block=True)
def tanh(d, a, out):
    """tanh'(a) = 1 - tanh(a)^2"""
    return aten.tanh_backward(d, out)


@smooth(torch.exp, T.exp, inplace=(torch.exp_, T.exp_))
def exp(d, a, out):
    """exp'(a) = exp(a)"""
    return out * d


@smooth(torch.log, T.log, inplace=(torch.log_, T.log_))
def log(d, a, out):
    """log'(a) = 1/a"""
    return (1 / a) * d


@smooth(torch.sqrt, T.sqrt, inplace=(torch.sqrt_, T.sqrt_))
def sqrt(d, a, out):
    """sqrt'(a) = 1/(2 sqrt(a))"""
    return (0.5 / out) * d


@smooth(torch.rsqrt, T.rsqrt, inplace=(torch.rsqrt_, T.rsqrt_))
def rsqrt(d, a, out):
    """rsqrt'(a) = -rsqrt(a)^3 / 2"""
    return (-0.5 * out ** 3) * d


@smooth(torch.reciprocal, T.reciprocal, inplace=(torch.reciprocal_, T.reciprocal_))
def reciprocal(d, a, out):
    """(1/a)' = -1/a^2"""
    return (-out * out) * d


@smooth(torch.sin, T.sin, inplace=(torch.sin_, T.sin_))
def sin(d, a, out):
    """sin'(a) = cos(a)"""
    return torch.cos(a) * d


@smooth(torch.cos, T.cos, inplace=(torch.cos_, T.cos_))
def cos(d, a, out):
    """cos'(a) = -sin(a)"""
    return -torch.sin(a) * d


@smooth(torch.square, T.square, inplace=(maybe(torch, "square_"), maybe(T, "square_")))
def square(d, a, out):
    """square'(a) = 2a"""
    return (2 * a) * d


# silu_backward and mish_backward have no double backward in torch: their slopes stay in primitive ops
@smooth(F.silu)
def silu(d, a, out):
    """silu'(a) = s (1 + a (1 - s)), s = sigmoid(a)"""
    return (torch.sigmoid(a) * (1 + a * (1 - torch.sigmoid(a)))) * d


@smooth(F.mish, maybe(torch._C._nn, "mish"), inplace=(maybe(torch._C._nn, "mish_"),))
def mish(d, a, out):
    """mish'(a) = tanh(sp) + a sigmoid(a) (1 - tanh(sp)^2), sp = softplus(a)"""
    t = torch.tanh(F.softplus(a))
    return (t + a * torch.sigmoid(a) * (1 - t * t)) * d


@smooth(F.logsigmoid, maybe(torch._C._nn, "log_sigmoid"))
def logsigmoid(d, a, out):
    """logsigmoid'(a) = sigmoid(-a)"""
    return torch.sigmoid(-a) * d


@smooth(F.gelu, maybe(torch._C._nn, "gelu"), inplace=(maybe(torch._C._nn, "gelu_"),), per_block=True)
def gelu(d, a, out, approximate="none"):
    """gelu'(a) = Phi(a) + a phi(a)"""
    return aten.gelu_backward(d, a, approximate=approximate)


@smooth(F.softplus, maybe(torch._C._nn, "softplus"), per_block=True)
def softplus(d, a, out, beta=1.0, threshold=20.0):
    """softplus'(a) = sigmoid(beta a) (1 above the threshold)"""
    return aten.softplus_backward(d, a, beta, threshold)


@smooth(F.elu, maybe(torch._C._nn, "elu"), inplace=(F.elu_, maybe(torch._C._nn, "elu_")), per_block=True)
def elu(d, a, out, alpha=1.0):
    """elu'(a) = 1 (a > 0) | alpha exp(a)"""
    return aten.elu_backward(d, alpha, 1, 1, False, a)


@smooth(F.celu, torch.celu, inplace=(maybe(F, "celu_"), torch.celu_), per_block=True)
def celu(d, a, out, alpha=1.0):
    """celu'(a) = 1 (a > 0) | exp(a / alpha)"""
    return aten.elu_backward(d, alpha, 1, 1 / alpha, False, a)  # celu(x) = elu(x; alpha, input_scale = 1 / alpha)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@smooth(F.selu, torch.selu, inplace=(maybe(F, "selu_"), torch.selu_), per_block=True)
def selu(d, a, out):
    """selu'(a) = scale (a > 0) | scale alpha exp(a)"""
    return aten.elu_backward(d, _SELU_ALPHA, _SELU_SCALE, 1, False, a)  # selu(x) = scale elu(x; alpha)


@register_rule(torch.pow, T.pow, T.__pow__, inplace=(T.pow_, T.__ipow__), inplace_kwarg=None)
def pow(input, exponent):
    """(a^e)' = e a^(e-1) for a constant exponent; other cases use the exact fallback."""
    if not is_clone(input) or (is_clone(exponent) and not exponent._jvp_state) or torch.is_tensor(exponent):
        return fallback(torch.pow, (input, exponent), {})
    a, d = split(input)
    out_a = torch.pow(a, exponent)
    s = exponent * torch.pow(a, exponent - 1) if exponent != 0 else torch.zeros_like(a)
    return assemble(out_a, s * d)


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
        dim, dtype = _softmax_args(args, kwargs, input.dim() - 1)
        a, d = split(input if dtype is None else input.to(dtype))
        if log:
            out_a = torch.log_softmax(a, dim)
            p = out_a.exp()
            return assemble(out_a, d - (p * d).sum(dim, keepdim=True))
        # softmax's Jacobian is symmetric: its backward kernel applied to d_j is J d_j
        out_a = aten._safe_softmax(a, dim) if safe else torch.softmax(a, dim)  # safe: 0 on all -inf rows
        # (out_a's dtype, not a's: CUDA's autocast runs softmax in float32, and the kernel takes one dtype)
        return assemble(out_a, each_block(lambda b: aten._softmax_backward_data(b.to(out_a.dtype), out_a, dim,
                                                                                out_a.dtype), d))

    rule.__name__ = rule.__qualname__ = "log_softmax" if log else ("safe_softmax" if safe else "softmax")
    rule.__doc__ = ("log_softmax: out_j = out_a + d_j - sum(p d_j)" if log
                    else "softmax: out_j = p + p (d_j - sum(p d_j))")
    return rule


register_rule(F.softmax, torch.softmax, T.softmax, maybe(torch, "_softmax"), inplace_kwarg=None)(_softmax(False))
register_rule(F.log_softmax, torch.log_softmax, T.log_softmax, inplace_kwarg=None)(_softmax(True))
if hasattr(aten, "_safe_softmax"):  # what the math attention kernel runs: rows of -inf give 0, not NaN
    register_rule(aten._safe_softmax, aten._safe_softmax.default, inplace_kwarg=None)(_softmax(False, safe=True))
