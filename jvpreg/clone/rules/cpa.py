"""Continuous piecewise-affine elementwise ops: the slope pattern comes from the primal block.

For an op with frozen region at ``a`` (block 0), every block ``z`` maps to
``out(z) = out(a) + Q(a) * (z - a)``. Two shapes of rule cover the family:

* zero-intercept ops (relu, leaky_relu, prelu, abs): ``out = Q(a) * z`` for every block;
* clamp-like ops (hardtanh/relu6, clamp, threshold): ``out = z`` where ``a`` is inside the
  affine piece, ``out(a)`` where ``a`` is clamped (:func:`jvpreg.clone.rules.kinds.slope`).

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

from jvpreg.clone.core.registry import COMPLEX_EXACT, maybe
from jvpreg.clone.core.tensor import compiling, is_clone, raw, varies, wrap
from jvpreg.clone.rules import kernels
from jvpreg.clone.rules.blocks import align, assemble, count, each_block, primal, split, tangents
from jvpreg.clone.rules.kernels import relu_blocks
from jvpreg.clone.rules.kinds import register_rule, slope, smooth

T = torch.Tensor


def _relu_no_grad_inplace(x, inplace=True):
    """In place without autograd: tangent blocks through relu's backward kernel written over themselves
    (the primal block, read as the mask, is a separate region), then the primal block."""
    a, b = split(x, differences=False)
    torch.ops.aten.threshold_backward.grad_input(b, a.expand_as(b), 0, grad_input=b)
    a.clamp_min_(0)


@register_rule(F.relu, torch.relu, T.relu, inplace=(F.relu_, torch.relu_, T.relu_),
               no_grad_inplace=_relu_no_grad_inplace, inplace_safe=True)
def relu(input, inplace=False):
    """relu(z) = 1[a > 0] * z, as one fused kernel over all blocks (relu's own backward kernel,
    ``threshold_backward(z, a, 0)``: as fast as relu on the 2B-row batch, where a mask multiply is slower).

    Under autograd, blocks of :data:`BOOL_MASK_NUMEL` elements or more go through
    :func:`jvpreg.clone.rules.kernels.relu_blocks`, which saves the pattern as a bool block rather than a float one
    (a quarter of the saved bytes). Smaller blocks keep the float pattern: there the operator's Python overhead per
    call (forward and backward) costs more than the bytes it saves; in a program compiled for the CPU every block
    does (Inductor would save the pattern itself, through a slow bool store). Not where
    :func:`jvpreg.clone.rules.kernels.applies` says no.
    """
    if (primal(input).numel() >= BOOL_MASK_NUMEL or compiling()) and kernels.applies(input):
        return assemble(every_block=relu_blocks(raw(input))[0])
    return assemble(every_block=torch.ops.aten.threshold_backward(input, _mask_source(input), 0))


BOOL_MASK_NUMEL = 65536  # entries per block from which relu keeps a bool pattern for backward


def _mask_source(input: torch.Tensor) -> torch.Tensor:
    """The primal block that relu-like kernels read their pattern (``a > 0``) from, broadcast over the blocks.

    Under autograd the kernel keeps it for backward: ``relu(a)`` made without a graph (a new tensor of one
    block; ``relu(a) > 0`` exactly where ``a > 0``, NaN included, and the kernel has no gradient w.r.t. it)
    rather than a view of ``a``, which would keep the whole ``(K, ...)`` input alive and, for an in-place
    op, need a copy of it.
    """
    if torch.is_grad_enabled() and input.requires_grad:
        with torch.no_grad():
            return torch.relu(primal(input)).expand_as(input)
    return primal(input).expand_as(input)


@register_rule(F.leaky_relu, torch._C._nn.leaky_relu, inplace=(F.leaky_relu_, torch._C._nn.leaky_relu_),
               inplace_safe=True)
def leaky_relu(input, negative_slope=0.01, inplace=False):
    """leaky_relu(z) = (1[a > 0] + negative_slope * 1[a <= 0]) * z (fused, via leaky_relu's backward kernel)."""
    return assemble(every_block=torch.ops.aten.leaky_relu_backward(input, _mask_source(input), negative_slope, False))


@register_rule(F.prelu, torch.prelu)
def prelu(input, weight):
    """prelu(z) = (1[a > 0] + w * 1[a <= 0]) * z, w broadcast over the channel dim (dim 1); a weight tangent adds
    min(a, 0) dw."""
    a, w = primal(input), primal(weight)
    if a.dim() >= 2 and w.numel() > 1:
        w = w.reshape(1, -1, *([1] * (a.dim() - 2)))
    elif a.dim() == 0:  # a 0-d input takes a one-element weight
        w = w.reshape(())
    slope_a = torch.where(a >= 0, torch.ones_like(a), w.to(a.dtype).expand_as(a))
    dw = tangents(weight)
    if dw is None and is_clone(input):
        return assemble(every_block=input * slope_a)
    out_a = a * slope_a
    if dw is None:  # a constant weight direction
        return assemble(out_a, k=count(weight))
    t = torch.clamp(a, max=0) * dw.reshape(dw.shape[0], *([1] * (a.dim() - w.dim())), *w.shape)  # blocks first
    if not is_clone(input):  # a weight direction: the input is the same in every block
        return assemble(out_a, t)
    return assemble(out_a, blocks=split(input, differences=False)[1] * slope_a + t)


@register_rule(torch.abs, T.abs, T.__abs__, maybe(torch, "absolute"), maybe(T, "absolute"),
               inplace=(torch.abs_, T.abs_, maybe(T, "absolute_")), inplace_safe=True)
def abs(input):
    """abs(z) = sign(a) * z (slope 0 at a = 0); complex ``z``: ``|a| + Re(conj(sgn(a)) (z - a))`` (smooth but at 0,
    where torch's derivative is 0: sgn(0) = 0)."""
    if input.is_complex():
        a, d = split(input)
        out_a = a.abs()
        return assemble(out_a, (torch.sgn(a).conj() * d).real)
    # a constant slope (sign' = 0): the product saves no view of the input, which an in-place abs_ overwrites
    return assemble(every_block=input * torch.sign(primal(input).detach()))


COMPLEX_EXACT.update(abs.__jvpreg_funcs__)


@slope(F.hardtanh, torch._C._nn.hardtanh, inplace=(F.hardtanh_, torch._C._nn.hardtanh_), identity_inside=True)
def hardtanh(a, min_val=-1.0, max_val=1.0):
    """hardtanh(z) = z where min < a < max, else hardtanh(a)."""
    return F.hardtanh(a, min_val, max_val), (a > min_val) & (a < max_val)


@slope(F.relu6, maybe(torch._C._nn, "relu6"), inplace=(maybe(torch._C._nn, "relu6_"),), identity_inside=True)
def relu6(a):
    """relu6(z) = z where 0 < a < 6, else relu6(a)."""
    return F.hardtanh(a, 0.0, 6.0), (a > 0.0) & (a < 6.0)


@slope(identity_inside=True)
def _clamp_to_numbers(a, min=None, max=None):
    """clamp(z) = z where min < a < max (slope 0 at the bounds, as torch), else clamp(a)."""
    inside = torch.ones_like(a, dtype=torch.bool)
    if min is not None:
        inside = inside & (a > min)
    if max is not None:
        inside = inside & (a < max)
    return torch.clamp(a, min, max), inside


@register_rule(torch.clamp, T.clamp, torch.clip, T.clip, inplace=(torch.clamp_, T.clamp_, torch.clip_, T.clip_),
               inplace_kwarg=None)
def clamp(input, min=None, max=None):
    """clamp(z) = z where min < a < max (slope 0 at number bounds, as torch), else clamp(a);
    tensor bounds: max/min with the bound tensors."""
    if not is_clone(input) or torch.is_tensor(min) or torch.is_tensor(max):
        return _clamp_with_tensor_bounds(input, min, max)
    return _clamp_to_numbers(input, min, max)


def _clamp_with_tensor_bounds(input, min, max):
    """clamp with varying tensor bounds = min(max(x, lo), hi), each piece by the maximum rule."""
    out = input
    for bound, op, kw in ((min, torch.maximum, "min"), (max, torch.minimum, "max")):
        if bound is None:
            continue
        if is_clone(out) or is_clone(bound):
            out = wrap(extremum(out, bound, op))
        else:  # neither operand from the batch (yet): a plain clamp
            out = torch.clamp(out, **{kw: bound})
    return out


@register_rule(torch.clamp_min, T.clamp_min, inplace=(torch.clamp_min_, T.clamp_min_), inplace_kwarg=None)
def clamp_min(input, min):
    return clamp(input, min, None)


@register_rule(torch.clamp_max, T.clamp_max, inplace=(torch.clamp_max_, T.clamp_max_), inplace_kwarg=None)
def clamp_max(input, max):
    return clamp(input, None, max)


@slope(F.threshold, torch.threshold, inplace=(F.threshold_, torch.threshold_), identity_inside=True)
def threshold(a, threshold, value):
    """threshold(z) = z where a > threshold, else value."""
    return F.threshold(a, threshold, value), a > threshold


@register_rule(F.hardsigmoid, torch._C._nn.hardsigmoid, inplace=(torch._C._nn.hardsigmoid_,))
def hardsigmoid(input, inplace=False):
    """hardsigmoid(z) = out(a) + (z - a)/6 on -3 < a < 3, else out(a). The mask is hardtanh's backward kernel
    (``hardsigmoid_backward`` has no double backward), one block at a time; its 0 off the open interval also
    covers an infinite ``a``: no non-finite fix."""
    a, d = split(input, nonfinite=False)
    out_a = F.hardsigmoid(a)
    return assemble(out_a, each_block(lambda b: torch.ops.aten.hardtanh_backward(b, a, -3.0, 3.0), d) / 6)


@smooth(F.hardswish, torch._C._nn.hardswish, inplace=(torch._C._nn.hardswish_,), per_block=True)
def hardswish(d, a, out):
    """hardswish(z) ~ out(a) + h'(a) (z - a), h'(a) = 0 (a <= -3) | (2a + 3)/6 | 1 (a >= 3): hardswish's own
    backward kernel, one block at a time."""
    return torch.ops.aten.hardswish_backward(d, a)


def extremum(x, y, op):
    """maximum/minimum of two operands (clones or constants): ``out(a) + w dx + (1 - w) dy``, ``w = 1`` where ``x``
    wins at the primal, ties split 0.5/0.5 (torch's convention)."""
    aligned = align([x, y], [i for i, c in enumerate((is_clone(x), is_clone(y))) if c])
    (xa, dx), (ya, dy) = (split(z) if varies(v) else (primal(v), 0) for v, z in zip((x, y), aligned))
    if not torch.is_tensor(xa):
        xa = torch.as_tensor(xa, dtype=ya.dtype, device=ya.device)
    if not torch.is_tensor(ya):
        ya = torch.as_tensor(ya, dtype=xa.dtype, device=xa.device)
    out_a = op(xa, ya)
    win_x = (xa > ya) if op in (torch.maximum, torch.fmax) else (xa < ya)
    w = torch.where(xa == ya, torch.full_like(out_a, 0.5), win_x.to(out_a.dtype))
    return assemble(out_a, w * dx + (1 - w) * dy)


@register_rule(torch.maximum, T.maximum, maybe(torch, "fmax"), maybe(T, "fmax"))
def maximum(input, other):
    """maximum(x, y) = w x + (1 - w) y, w = 1[a_x > a_y] (0.5 on ties)."""
    return extremum(input, other, torch.maximum)


@register_rule(torch.minimum, T.minimum, maybe(torch, "fmin"), maybe(T, "fmin"))
def minimum(input, other):
    """minimum(x, y) = w x + (1 - w) y, w = 1[a_x < a_y] (0.5 on ties)."""
    return extremum(input, other, torch.minimum)
