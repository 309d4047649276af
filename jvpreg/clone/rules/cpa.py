"""Continuous piecewise-affine elementwise ops: the slope pattern comes from the primal block.

For an op with frozen region at ``a`` (block 0), every block ``z`` maps to
``out(z) = out(a) + Q(a) * (z - a)``. Two shapes of rule cover the family:

* zero-intercept ops (relu, leaky_relu, prelu, abs): ``out = Q(a) * z`` for every block;
* clamp-like ops (hardtanh/relu6, clamp, threshold): ``out = z`` where ``a`` is inside the
  affine piece, ``out(a)`` where ``a`` is clamped.

Kink conventions follow PyTorch's own derivatives (torch 2.15's; tests check them at the kink; torch 2.11's clamp
takes slope 1 at its bounds, jvpreg keeps one convention on every torch version):
relu'(0) = 0; leaky_relu'(0) = negative_slope; prelu'(0) = 1 (torch's forward-mode formula; its
backward uses the weight there); abs'(0) = 0; hardtanh/relu6 and clamp with number bounds have
slope 0 at their bounds; clamp with tensor bounds is max/min with those tensors (ties 0.5);
threshold(x, t, v) has slope 0 at x = t; hardsigmoid has slope 0 at ±3;
hardswish'(x) = 0 for x <= -3, (2x + 3)/6 for -3 < x < 3, 1 for x >= 3 (piecewise smooth);
maximum/minimum split ties evenly (0.5 each), as torch does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from jvpreg.clone.rules import kernels
from jvpreg.clone.rules.kernels import relu_blocks
from jvpreg.clone.core.registry import COMPLEX_EXACT, maybe
from jvpreg.clone.rules.kinds import register_rule
from jvpreg.clone.rules.structural import align
from jvpreg.clone.core.tensor import (block_delta, compiling, each_block, is_clone, kept_primal, raw, stack_blocks,
    tile, wrap)

T = torch.Tensor


def _with_slope(x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """``out_j = slope(a) * x_j`` for every block (zero-intercept CPA ops)."""
    return x * slope


def _clamped(x: torch.Tensor, inside: torch.Tensor, out_a: torch.Tensor) -> torch.Tensor:
    """``out_j = x_j`` where the primal is in the identity piece, else the primal's output.

    Written as ``out_a * (1 - m) + x * m`` with a float mask: a broadcast ``torch.where`` over the
    block dim is 20x slower on CPU.
    """
    m = inside.to(x.dtype)
    return torch.addcmul(out_a * (1 - m), x, m)


def _relu_no_grad_inplace(x, inplace=True):
    """In place without autograd: tangent blocks through relu's backward kernel written over themselves
    (the primal block, read as the mask, is a separate region), then the primal block."""
    b = x[1:]
    torch.ops.aten.threshold_backward.grad_input(b, x[0].expand_as(b), 0, grad_input=b)
    x[0].clamp_min_(0)


@register_rule(F.relu, torch.relu, T.relu, inplace=(F.relu_, torch.relu_, T.relu_),
               no_grad_inplace=_relu_no_grad_inplace, inplace_safe=True)
def relu(input, inplace=False):
    """relu(z) = 1[a > 0] * z, as one fused kernel over all blocks (relu's own backward kernel,
    ``threshold_backward(z, a, 0)``: as fast as relu on the 2B-row batch; a mask multiply is 4x slower).

    Under autograd, blocks of :data:`BOOL_MASK_NUMEL` elements or more go through
    :func:`jvpreg.clone.rules.kernels.relu_blocks`, which saves the pattern as a bool block rather than a float one
    (the saved bytes of a relu network: 2.0x the plain forward's instead of 2.3x). Smaller blocks keep the float
    pattern: there the operator's ~25 µs of Python per call (forward and backward) would cost more than the
    ~100 KiB it saves (+9% on a 784-200-200-10 MLP's step at batch 64); in a program compiled for the CPU every
    block does (Inductor would save the pattern itself, through a slow bool store: 3.32 -> 3.02 ms for that
    MLP's compiled step). Not where :func:`jvpreg.clone.rules.kernels.applies` says no.
    """
    if (input[0].numel() >= BOOL_MASK_NUMEL or compiling()) and kernels.applies(input):
        return relu_blocks(raw(input))[0]
    return torch.ops.aten.threshold_backward(input, _mask_source(input), 0)


BOOL_MASK_NUMEL = 65536  # 256 KiB of float32 per block


def _mask_source(input: torch.Tensor) -> torch.Tensor:
    """The primal block that relu-like kernels read their pattern (``a > 0``) from, broadcast over the blocks.

    Under autograd the kernel keeps it for backward: ``relu(a)`` made without a graph (a new tensor of one
    block; ``relu(a) > 0`` exactly where ``a > 0``, NaN included, and the kernel has no gradient w.r.t. it)
    rather than a view of ``a``, which would keep the whole ``(K, ...)`` input alive and, for an in-place
    op, need a copy of it.
    """
    if torch.is_grad_enabled() and input.requires_grad:
        with torch.no_grad():
            return torch.relu(input[0]).expand_as(input)
    return input[0].expand_as(input)


@register_rule(F.leaky_relu, torch._C._nn.leaky_relu, inplace=(F.leaky_relu_, torch._C._nn.leaky_relu_),
               inplace_safe=True)
def leaky_relu(input, negative_slope=0.01, inplace=False):
    """leaky_relu(z) = (1[a > 0] + negative_slope * 1[a <= 0]) * z (fused, via leaky_relu's backward kernel)."""
    return torch.ops.aten.leaky_relu_backward(input, _mask_source(input), negative_slope, False)


@register_rule(F.prelu, torch.prelu)
def prelu(input, weight):
    """prelu(z) = (1[a > 0] + w * 1[a <= 0]) * z, w broadcast over the channel dim (dim 1)."""
    if not is_clone(input):  # a weight direction: the input repeated in every block (zero tangent)
        input = tile(input, weight.shape[0])
    a = input[0]
    w = weight[0] if is_clone(weight) else weight
    if a.dim() >= 2 and w.numel() > 1:
        w = w.reshape(1, -1, *([1] * (a.dim() - 2)))
    elif a.dim() == 0:  # a 0-d input takes a one-element weight
        w = w.reshape(())
    slope = torch.where(a >= 0, torch.ones_like(a), w.to(a.dtype).expand_as(a))
    out = _with_slope(input, slope)
    if is_clone(weight) and not weight._jvp_state:  # weight tangent: min(a, 0) * dw
        dw = block_delta(weight[1:], weight[0])
        if a.dim() >= 2 and weight[0].numel() > 1:
            dw = dw.reshape(dw.shape[0], 1, -1, *([1] * (a.dim() - 2)))
        elif a.dim() == 0:
            dw = dw.reshape(dw.shape[0])
        out = stack_blocks(out[0], out[1:] + torch.clamp(a, max=0) * dw)
    return out


@register_rule(torch.abs, T.abs, T.__abs__, maybe(torch, "absolute"), maybe(T, "absolute"),
               inplace=(torch.abs_, T.abs_, maybe(T, "absolute_")), inplace_safe=True)
def abs(input):
    """abs(z) = sign(a) * z (slope 0 at a = 0); complex ``z``: ``|a| + Re(conj(sgn(a)) (z - a))`` (smooth but at 0,
    where torch's derivative is 0: sgn(0) = 0)."""
    if input.is_complex():
        a = input[0]
        out0 = a.abs()
        return stack_blocks(out0, out0 + (torch.sgn(a).conj() * block_delta(input[1:], a)).real)
    return _with_slope(input, torch.sign(input[0].detach()))  # a constant slope (sign' = 0): the product saves
    # no view of the input, which an in-place abs_ overwrites


COMPLEX_EXACT.update(abs.__jvpreg_funcs__)


@register_rule(F.hardtanh, torch._C._nn.hardtanh, inplace=(F.hardtanh_, torch._C._nn.hardtanh_))
def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    """hardtanh(z) = z where min < a < max, else hardtanh(a)."""
    a = input[0]
    out_a = F.hardtanh(a, min_val, max_val)
    return _clamped(input, (a > min_val) & (a < max_val), out_a)


@register_rule(F.relu6, maybe(torch._C._nn, "relu6"), inplace=(maybe(torch._C._nn, "relu6_"),))
def relu6(input, inplace=False):
    """relu6(z) = z where 0 < a < 6, else relu6(a)."""
    return hardtanh(input, 0.0, 6.0)


def _bound(v, j=0):
    if is_clone(v):
        return v[j]
    return v


@register_rule(torch.clamp, T.clamp, torch.clip, T.clip, inplace=(torch.clamp_, T.clamp_, torch.clip_, T.clip_),
               inplace_kwarg=None)
def clamp(input, min=None, max=None):
    """clamp(z) = z where min < a < max (slope 0 at number bounds, as torch), else clamp(a);
    tensor bounds: max/min with the bound tensors."""
    if not is_clone(input) or torch.is_tensor(min) or torch.is_tensor(max):
        return _clamp_with_tensor_bounds(input, min, max)
    a = input[0]
    lo, hi = _bound(min), _bound(max)
    out_a = torch.clamp(a, lo, hi)
    inside = torch.ones_like(a, dtype=torch.bool)
    if lo is not None:
        inside = inside & (a > lo)
    if hi is not None:
        inside = inside & (a < hi)
    return _clamped(input, inside, out_a)


def _clamp_with_tensor_bounds(input, min, max):
    """clamp with varying tensor bounds = min(max(x, lo), hi), each piece by the maximum rule."""

    out = input
    for bound, op, kw in ((min, torch.maximum, "min"), (max, torch.minimum, "max")):
        if bound is None:
            continue
        if is_clone(out) or is_clone(bound):
            out = wrap(_extremum(out, bound, op))
        else:  # neither operand from the batch (yet): a plain clamp
            out = torch.clamp(out, **{kw: bound})
    return out


@register_rule(torch.clamp_min, T.clamp_min, inplace=(torch.clamp_min_, T.clamp_min_), inplace_kwarg=None)
def clamp_min(input, min):
    return clamp(input, min, None)


@register_rule(torch.clamp_max, T.clamp_max, inplace=(torch.clamp_max_, T.clamp_max_), inplace_kwarg=None)
def clamp_max(input, max):
    return clamp(input, None, max)


@register_rule(F.threshold, torch.threshold, inplace=(F.threshold_, torch.threshold_))
def threshold(input, threshold, value, inplace=False):
    """threshold(z) = z where a > threshold, else value."""
    a = input[0]
    return _clamped(input, a > threshold, F.threshold(a, threshold, value))


@register_rule(F.hardsigmoid, torch._C._nn.hardsigmoid, inplace=(torch._C._nn.hardsigmoid_,))
def hardsigmoid(input, inplace=False):
    """hardsigmoid(z) = out(a) + (z - a)/6 on -3 < a < 3, else out(a). The mask is hardtanh's backward kernel
    (``hardsigmoid_backward`` has no double backward), one block at a time; its 0 off the open interval also
    covers an infinite ``a``: no non-finite fix."""
    a = input[0]
    out_a = F.hardsigmoid(a)
    d = block_delta(input[1:], a, nonfinite=False)
    return stack_blocks(out_a, out_a + each_block(lambda b: torch.ops.aten.hardtanh_backward(b, a, -3.0, 3.0), d) / 6)


@register_rule(F.hardswish, torch._C._nn.hardswish, inplace=(torch._C._nn.hardswish_,), inplace_safe=True)
def hardswish(input, inplace=False):
    """hardswish(z) ~ out(a) + h'(a) (z - a), h'(a) = 0 (a <= -3) | (2a + 3)/6 | 1 (a >= 3): hardswish's own
    backward kernel, one block at a time."""
    a = kept_primal(input)
    out_a = F.hardswish(a)
    tan = each_block(lambda b: torch.ops.aten.hardswish_backward(b, a), block_delta(input[1:], a))
    return stack_blocks(out_a, out_a + tan)


def _extremum(x, y, op):
    """maximum/minimum of two operands: pick the primal winner; ties split 0.5/0.5 (torch's convention)."""
    vx, vy = is_clone(x) and not x._jvp_state, is_clone(y) and not y._jvp_state
    cx, cy = is_clone(x), is_clone(y)
    x, y = align([x, y], [i for i, c in enumerate((cx, cy)) if c])
    xa = x[0] if cx else x
    ya = y[0] if cy else y
    if not torch.is_tensor(xa):
        xa = torch.as_tensor(xa, dtype=ya.dtype, device=ya.device)
    if not torch.is_tensor(ya):
        ya = torch.as_tensor(ya, dtype=xa.dtype, device=xa.device)
    out_a = op(xa, ya)
    win_x = (xa > ya) if op in (torch.maximum, torch.fmax) else (xa < ya)
    w = torch.where(xa == ya, torch.full_like(out_a, 0.5), win_x.to(out_a.dtype))
    dx = block_delta(x[1:], xa) if vx else 0
    dy = block_delta(y[1:], ya) if vy else 0
    return stack_blocks(out_a, out_a + w * dx + (1 - w) * dy)


@register_rule(torch.maximum, T.maximum, maybe(torch, "fmax"), maybe(T, "fmax"))
def maximum(input, other):
    """maximum(x, y) = w x + (1 - w) y, w = 1[a_x > a_y] (0.5 on ties)."""
    return _extremum(input, other, torch.maximum)


@register_rule(torch.minimum, T.minimum, maybe(torch, "fmin"), maybe(T, "fmin"))
def minimum(input, other):
    """minimum(x, y) = w x + (1 - w) y, w = 1[a_x < a_y] (0.5 on ties)."""
    return _extremum(input, other, torch.minimum)
