"""Normalisation layers linearised with the statistics of the primal block.

For ``y = gamma * xhat + beta``, ``xhat = (z - mu) * rstd`` over the reduced dims R:

    out_j = out_a + gamma * rstd * (d_j - mean_R(d_j) - xhat * mean_R(d_j * xhat)) + xhat * dgamma_j + dbeta_j

with ``d_j = block_j - a`` (plain differences: an infinite primal entry makes its whole row NaN anyway)
and ``mu``, ``rstd``, ``xhat`` of the primal block ``a`` only (kept in
the autograd graph, so gradients of a penalty on the JVP are exact). InstanceNorm with running statistics is affine
and runs on the merged batch. BatchNorm, with its operators: :mod:`jvpreg.clone.rules.batch_norm`.
"""
from __future__ import annotations

import math

from typing import Sequence

import torch
import torch.nn.functional as F

from jvpreg.clone.core.tensor import autocast_enabled, is_clone, raw, varies, wrap
from jvpreg.clone.eager.dispatch import fallback
from jvpreg.clone.rules import kernels
from jvpreg.clone.rules.blocks import assemble, count, each_block, primal, tangents
from jvpreg.clone.rules.kernels import group_norm_tangent
from jvpreg.clone.rules.kinds import register_rule


def channel_view(p: torch.Tensor, ndim: int, channel_dim: int = 1) -> torch.Tensor:
    """A per-channel ``(C,)`` vector viewed to broadcast against an ``ndim``-dim input with channels at
    ``channel_dim``."""
    shape = [1] * ndim
    shape[channel_dim] = -1
    return p.reshape(shape)


def _batch_input(input, weight, bias):
    """A plain input normalised with batch (perturbed) weights: the input as a clone of zero tangent, so the
    weight tangents ``xhat * dgamma + dbeta`` come from the same linearisation."""
    if is_clone(input):
        return input
    return wrap(assemble(input, k=count(weight, bias)), state=True)


def affine_tangent(xhat: torch.Tensor, weight, bias, view) -> torch.Tensor | None:
    """``xhat * dgamma_j + dbeta_j``, shape ``(k-1, *xhat.shape)``: the tangent of ``gamma * xhat + beta``
    carried by the affine parameters' blocks (``None`` if neither varies). ``view(p)`` reshapes one block
    of a per-feature parameter to broadcast against ``xhat``."""
    def blocks(dp):  # (k-1, 1.., *view) so the block dim never meets a dim of xhat
        v = view(dp[0])
        return dp.reshape(dp.shape[0], *([1] * (xhat.dim() - v.dim())), *v.shape)

    dw, db = tangents(weight), tangents(bias)
    t = None if dw is None else xhat * blocks(dw)
    if db is not None:
        t = blocks(db) if t is None else t + blocks(db)
    return t


def linearized_norm(x, out_a, xhat, rstd, red_dims: Sequence[int], weight, bias, affine_shape):
    """Assemble ``[out_a; out_j]`` for a normalisation with primal statistics (see module doc).

    ``red_dims`` are negative dims of the primal block; ``affine_shape(p)`` reshapes a
    per-feature parameter so it broadcasts against the primal block.
    """
    tan = None
    d = tangents(x, nonfinite=False)
    if d is not None:
        rd = tuple(red_dims)
        dn = d - d.mean(rd, keepdim=True) - xhat * (d * xhat).mean(rd, keepdim=True)
        tan = (rstd if weight is None else rstd * affine_shape(primal(weight))) * dn
    params = affine_tangent(xhat, weight, bias, affine_shape)
    if params is not None:
        tan = params if tan is None else tan + params
    return assemble(out_a, k=count(x, weight, bias)) if tan is None else assemble(out_a, tan)


def verify_batch_size(size) -> None:
    """``F.batch_norm``'s check in training mode, which the rules replace: more than one value per channel."""
    check = getattr(F, "_verify_batch_size", None)  # private in torch; absent: the statistics are NaN-free anyway
    if check is not None:
        check(size)


@register_rule(F.instance_norm)
def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.1, eps=1e-5):
    """InstanceNorm: per-sample, per-channel statistics of the primal block (running stats from it)."""
    a = primal(input)
    w0, b0 = primal(weight), primal(bias)
    ch = lambda p: channel_view(p, a.dim())
    if not use_input_stats and is_clone(input) and not varies(weight) and not varies(bias):
        # running statistics: affine and per sample, so one call on the merged batch
        out = F.instance_norm(input.reshape(-1, *input.shape[2:]), running_mean, running_var, w0, b0, False,
                              momentum, eps)
        return assemble(every_block=out.reshape(input.shape))
    if not use_input_stats or not is_clone(input):
        return fallback(F.instance_norm, (input, running_mean, running_var, weight, bias, use_input_stats,
                                          momentum, eps), {})
    out_a = F.instance_norm(a, running_mean, running_var, w0, b0, True, momentum, eps)
    dims = tuple(range(2, a.dim()))
    var, mean = torch.var_mean(a, dim=dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xhat = (a - mean) * rstd
    return linearized_norm(input, out_a, xhat, rstd, tuple(d - a.dim() for d in dims), weight, bias, ch)


@register_rule(F.layer_norm, torch.layer_norm)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *args):
    """LayerNorm over the trailing ``normalized_shape`` dims, statistics of the primal block; the input tangent
    ``rstd * (d - mean(d) - xhat * mean(xhat * d))`` is ``native_layer_norm_backward`` applied to ``d_j``, under
    autograd through :func:`jvpreg.clone.rules.kernels.layer_norm_tangent` (torch's double backward of that kernel is
    exact to first order only)."""
    input = _batch_input(input, weight, bias)
    a = primal(input, kept=True)
    w0, b0 = primal(weight), primal(bias)
    if autocast_enabled(a.device.type):  # autocast's layer_norm (float32) for the primal, as a plain forward
        out_a = F.layer_norm(a, normalized_shape, w0, b0, eps)
        a = a.to(out_a.dtype)
        _, mean, rstd = torch.native_layer_norm(a, normalized_shape, None, None, eps)
    else:
        out_a, mean, rstd = torch.native_layer_norm(a, normalized_shape, w0, b0, eps)
    if mean.requires_grad:  # not differentiable outputs in torch; layer_norm_backward's double backward
        mean, rstd = mean.detach(), rstd.detach()  # differentiates through the input instead
    d = tangents(input, nonfinite=False)
    tan = None
    if d is not None:  # the normalisation's Jacobian is symmetric: its backward kernel (no weight) applied to d_j
        exact_dtype = a.dtype in (torch.float32, torch.float64) and (w0 is None or w0.dtype == a.dtype)
        if exact_dtype and kernels.applies(input):
            tan = kernels.layer_norm_tangent(raw(d).to(a.dtype), a, w0, mean, rstd, list(normalized_shape), eps)
        elif torch.is_grad_enabled() and (input.requires_grad or varies(weight)):
            # torch.func transforms, other dtypes: differentiable statistics (torch's double backward of
            # the kernel is exact to first order only), in at least float32
            up = torch.promote_types(a.dtype, torch.float32)
            tan = kernels.layer_norm_tangent_composite(d.to(up), a.to(up), None if w0 is None else w0.to(up),
                                                       len(normalized_shape), eps).to(a.dtype)
        else:
            tan = each_block(lambda b: torch.ops.aten.native_layer_norm_backward(
                b.to(a.dtype), a, normalized_shape, mean, rstd, None, None, [True, False, False])[0], d)
            tan = tan if w0 is None else tan * w0
    if varies(weight) or varies(bias):  # xhat with differentiable statistics
        var, mu = torch.var_mean(a, dim=tuple(range(-len(normalized_shape), 0)), correction=0, keepdim=True)
        params = affine_tangent((a - mu) * torch.rsqrt(var + eps), weight, bias, lambda p: p)
        tan = params if tan is None else tan + params
    return assemble(out_a, k=count(input)) if tan is None else assemble(out_a, tan)


@register_rule(F.group_norm, torch.group_norm)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *args):
    """GroupNorm: statistics over (channels of a group, spatial) of each primal sample; the input tangent
    ``rstd * (d - mean(d) - xhat * mean(xhat * d))`` is ``native_group_norm_backward`` (no weight) applied to
    ``d_j``, times gamma; under autograd :func:`jvpreg.clone.rules.kernels.group_norm_tangent` (that kernel has no
    derivative in torch)."""
    input = _batch_input(input, weight, bias)
    a = primal(input, kept=True)
    w0, b0 = primal(weight), primal(bias)
    n, c = a.shape[0], a.shape[1]
    hw = math.prod(a.shape[2:])
    if c % num_groups == 0:  # as a plain call checks (torch's own kernel reports the other case)
        verify_batch_size([n * c // num_groups, num_groups, *a.shape[2:]])
    if autocast_enabled(a.device.type):  # autocast's group_norm (float32) for the primal
        out_a = F.group_norm(a, num_groups, w0, b0, eps)
        a = a.to(out_a.dtype)
        _, mean, rstd = torch.native_group_norm(a, None, None, n, c, hw, num_groups, eps)
    elif w0 is None or w0.dtype == a.dtype:
        out_a, mean, rstd = torch.native_group_norm(a, w0, b0, n, c, hw, num_groups, eps)
    else:
        out_a = F.group_norm(a, num_groups, w0, b0, eps)
        _, mean, rstd = torch.native_group_norm(a, None, None, n, c, hw, num_groups, eps)
    mean, rstd = mean.detach(), rstd.detach()  # the tangent's kernels differentiate through ``a`` themselves
    ch = lambda p: channel_view(p, a.dim())
    d = tangents(input, nonfinite=False)
    tan = None
    if d is not None:
        if a.dtype in (torch.float32, torch.float64) and kernels.applies(input):
            tan = group_norm_tangent(raw(d).to(a.dtype), a, w0, mean, rstd, num_groups, eps)[0]  # (autocast: a upcast)
        elif torch.is_grad_enabled() and (input.requires_grad or varies(weight)):
            tan = kernels.group_norm_tangent_composite(d, a, w0, num_groups, eps)
        else:
            tan = each_block(lambda b: torch.ops.aten.native_group_norm_backward(
                b.to(a.dtype), a, mean, rstd, None, n, c, hw, num_groups, [True, False, False])[0], d)
            tan = tan if w0 is None else tan * ch(w0)
    if varies(weight) or varies(bias):  # xhat with differentiable statistics
        ag = a.reshape(n, num_groups, c // num_groups * hw)  # explicit: -1 is ambiguous for an empty batch
        var, mu = torch.var_mean(ag, dim=-1, correction=0, keepdim=True)
        params = affine_tangent(((ag - mu) * torch.rsqrt(var + eps)).reshape(a.shape), weight, bias, ch)
        tan = params if tan is None else tan + params
    return assemble(out_a, k=count(input)) if tan is None else assemble(out_a, tan)
