"""Normalisation layers linearised with the statistics of the primal block.

For ``y = gamma * xhat + beta``, ``xhat = (z - mu) * rstd`` over the reduced dims R:

    out_j = out_a + gamma * rstd * (d_j - mean_R(d_j) - xhat * mean_R(d_j * xhat)) + xhat * dgamma_j + dbeta_j

with ``d_j = block_j - a`` (plain differences: an infinite primal entry makes its whole row NaN anyway)
and ``mu``, ``rstd``, ``xhat`` of the primal block ``a`` only (kept in
the autograd graph, so gradients of a penalty on the JVP are exact). Train-mode BatchNorm
("clone-BN") takes R = batch + spatial dims of the primal block and updates the running
statistics once, from the primal block alone, by the same kernel a plain forward uses
(``num_batches_tracked`` is counted by the module, once per call). Eval-mode BatchNorm and
InstanceNorm with running statistics are affine and run on the merged batch.
"""
from __future__ import annotations

import math

from typing import Sequence

import torch
import torch.nn.functional as F

from jvpreg.clone.core.device_paths import on_host
from jvpreg.clone.eager.dispatch import fallback
from jvpreg.clone.rules.kinds import register_rule
from jvpreg.clone.rules import kernels
from jvpreg.clone.rules.kernels import batch_norm_tangent, group_norm_tangent
from jvpreg.clone.core.tensor import (autocast_enabled, block_delta, capturing, compiling, delta_blocks, each_block,
    is_clone, kept_primal, primal_block, raw, stack_blocks, tile, varies, wrap)


_primal, _delta = primal_block, delta_blocks


def _channel_view(p: torch.Tensor, ndim: int, channel_dim: int = 1) -> torch.Tensor:
    shape = [1] * ndim
    shape[channel_dim] = -1
    return p.reshape(shape)


def _batch_input(input, weight, bias):
    """A plain input normalised with batch (perturbed) weights: the input as a clone of zero tangent, so the
    weight tangents ``xhat * dgamma + dbeta`` come from the same linearisation."""
    if is_clone(input):
        return input
    k = next(t.shape[0] for t in (weight, bias) if is_clone(t))

    return wrap(tile(input, k), state=True)


def affine_tangent(xhat: torch.Tensor, weight, bias, view) -> torch.Tensor | None:
    """``xhat * dgamma_j + dbeta_j``, shape ``(k-1, *xhat.shape)``: the tangent of ``gamma * xhat + beta``
    carried by the affine parameters' blocks (``None`` if neither varies). ``view(p)`` reshapes one block
    of a per-feature parameter to broadcast against ``xhat``."""
    def blocks(dp):  # (k-1, 1.., *view) so the block dim never meets a dim of xhat
        v = view(dp[0])
        return dp.reshape(dp.shape[0], *([1] * (xhat.dim() - v.dim())), *v.shape)

    dw, db = _delta(weight), _delta(bias)
    t = None if dw is None else xhat * blocks(dw)
    if db is not None:
        t = blocks(db) if t is None else t + blocks(db)
    return t


def linearized_norm(x, out_a, xhat, rstd, red_dims: Sequence[int], weight, bias, affine_shape):
    """Assemble ``[out_a; out_j]`` for a normalisation with primal statistics (see module doc).

    ``red_dims`` are negative dims of the primal block; ``affine_shape(p)`` reshapes a
    per-feature parameter so it broadcasts against the primal block.
    """
    k1 = next(t.shape[0] - 1 for t in (x, weight, bias) if is_clone(t))
    tan = None
    d = _delta(x, nonfinite=False)
    if d is not None:
        rd = tuple(red_dims)
        dn = d - d.mean(rd, keepdim=True) - xhat * (d * xhat).mean(rd, keepdim=True)
        tan = (rstd if weight is None else rstd * affine_shape(_primal(weight))) * dn
    params = affine_tangent(xhat, weight, bias, affine_shape)
    if params is not None:
        tan = params if tan is None else tan + params
    if tan is None:
        return tile(out_a, k1 + 1)
    tan = out_a + tan
    if tan.dim() == out_a.dim():
        tan = tan.unsqueeze(0).expand(k1, *out_a.shape)
    return stack_blocks(out_a, tan)


def _verify_batch_size(size) -> None:
    """``F.batch_norm``'s check in training mode, which the rules replace: more than one value per channel."""
    check = getattr(F, "_verify_batch_size", None)  # private in torch; absent: the statistics are NaN-free anyway
    if check is not None:
        check(size)


@register_rule(F.batch_norm)
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Clone-BN: batch statistics from the primal block; eval mode is affine (merged batch)."""
    if is_clone(running_mean) or is_clone(running_var):
        return fallback(F.batch_norm, (input, running_mean, running_var, weight, bias, training, momentum, eps), {})
    a = _primal(input)
    w0, b0 = _primal(weight), _primal(bias)
    ch = lambda p: _channel_view(p, a.dim())
    if not training:
        if is_clone(input):
            p = input
            merged = F.batch_norm(p.reshape(-1, *p.shape[2:]), running_mean, running_var, w0, b0, False, momentum, eps)
            out = merged.reshape(p.shape)
            if not varies(weight) and not varies(bias):
                return out
            out_a = out[0]
        else:
            out_a = F.batch_norm(a, running_mean, running_var, w0, b0, False, momentum, eps)
        xhat = (a - ch(running_mean)) * ch(torch.rsqrt(running_var + eps))
        k = (input if is_clone(input) else (weight if is_clone(weight) else bias)).shape[0]
        tan = out[1:] if is_clone(input) else tile(out_a, k)[1:]
        return stack_blocks(out_a, tan + affine_tangent(xhat, weight, bias, ch))
    # The primal block is the very call a plain forward makes (bit-identical output and running statistics,
    # updated once); the tangent is batch norm's own input-gradient kernel applied to d_j. Both keep their
    # input for backward: a copy of the primal block under autograd (kept_primal).
    _verify_batch_size(a.size())  # the error a plain call raises (one value per channel: no batch statistics)
    momentum = 0.0 if momentum is None else momentum
    if _blocks_in_one_output(input, weight, bias):
        return _batch_norm_blocks(input, w0, b0, running_mean, running_var, momentum, eps)
    if is_clone(input):
        a = kept_primal(input)
    if on_host(a) and (w0 is None or w0.dtype == a.dtype):
        # the kernel F.batch_norm runs on the CPU, called for its statistics too (a separate var_mean: 3x its time)
        out_a, mean, invstd = torch.ops.aten.native_batch_norm(a, w0, b0, running_mean, running_var, True,
                                                               momentum, eps)
        mean, invstd = mean.detach(), invstd.detach()
    else:  # cuDNN's kernel on a GPU (its statistics are not returned the same way everywhere)
        out_a = F.batch_norm(a, running_mean, running_var, w0, b0, True, momentum, eps)
        with torch.no_grad():
            a32 = a.float() if a.dtype in (torch.float16, torch.bfloat16) else a  # the kernel's statistics dtype
            var, mean = torch.var_mean(a32, dim=(0,) + tuple(range(2, a.dim())), correction=0)
            invstd = torch.rsqrt(var + eps)
    return _bn_tangents(input, a, out_a, mean, invstd, weight, bias, eps, ch)


def _blocks_in_one_output(x, weight, bias) -> bool:
    """Train-mode BatchNorm through :func:`jvpreg.clone.rules.kernels.batch_norm_blocks` (every block written into one
    output, three blocks allocated per call where the composite rule allocates seven): a clone input of
    float32/64 on the CPU with constant affine parameters, outside ``torch.func`` transforms, forward-mode AD
    (:func:`jvpreg.clone.rules.kernels.inside_transform`) and programs for ``engine="compiled"`` (there Inductor fuses the
    composite rule). Other devices keep the composite rule
    (cuDNN's kernel for the primal block; the operator is not measured on a GPU)."""
    if not is_clone(x) or varies(weight) or varies(bias):
        return False
    z, w0 = raw(x), _primal(weight)
    return (type(z) is torch.Tensor and on_host(z) and z.dtype in (torch.float32, torch.float64)
            and (w0 is None or w0.dtype == z.dtype) and not compiling() and not kernels.inside_transform())


def _batch_norm_blocks(x, w0, b0, running_mean, running_var, momentum, eps):
    """The operator, then its running statistics copied into the module's buffers.

    Eager: written as the native kernel writes them, without bumping the buffers' version counters (``.data``), so
    a forward of the same module earlier in the step, which saved the buffers for its backward, stays valid. While
    capturing, a copy the tracer sees (the replay writes the buffers as :mod:`jvpreg.clone.program.side_effects` says)."""
    out, *_, new_mean, new_var = kernels.batch_norm_blocks(raw(x), w0, b0, running_mean, running_var, momentum, eps)
    for buffer, new in ((running_mean, new_mean), (running_var, new_var)):
        if buffer is not None:  # (no graph: neither requires grad)
            (buffer if capturing() else buffer.data).copy_(new)
    return out


def _written_out_backward(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Use :func:`jvpreg.clone.rules.kernels.batch_norm_tangent` (its backward written out): float32/64, where
    :func:`jvpreg.clone.rules.kernels.applies` (under autograd)."""
    return a.dtype in (torch.float32, torch.float64) and kernels.applies(x)


def _bn_tangents(x, a, out_a, mean, invstd, weight, bias, eps, ch):
    """``out_j = out_a + BN_backward(d_j) + xhat * dgamma_j + dbeta_j`` with the primal statistics."""
    w0 = _primal(weight)
    k = next(t.shape[0] for t in (x, weight, bias) if is_clone(t))
    d = _delta(x, nonfinite=False)
    if d is None:
        tan = out_a.unsqueeze(0).expand(k - 1, *out_a.shape)
    elif _written_out_backward(x, a):
        tan = out_a + batch_norm_tangent(raw(d), a, w0, mean, invstd, eps)[0]
    else:
        tan = torch.stack([out_a + torch.ops.aten.native_batch_norm_backward(
            d[j], a, w0, None, None, mean, invstd, True, eps, [True, False, False])[0] for j in range(k - 1)])
    if varies(weight) or varies(bias):
        # differentiable statistics here (the kernel's saved mean/invstd carry no gradient)
        dims = (0,) + tuple(range(2, a.dim()))
        var, mu = torch.var_mean(a, dim=dims, correction=0, keepdim=True)
        xhat = (a - mu) * torch.rsqrt(var + eps)
        tan = tan + affine_tangent(xhat, weight, bias, ch)
    return stack_blocks(out_a, tan)


@register_rule(torch.batch_norm)
def torch_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True):
    return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


@register_rule(F.instance_norm)
def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.1, eps=1e-5):
    """InstanceNorm: per-sample, per-channel statistics of the primal block (running stats from it)."""
    a = _primal(input)
    w0, b0 = _primal(weight), _primal(bias)
    ch = lambda p: _channel_view(p, a.dim())
    if not use_input_stats and is_clone(input) and not varies(weight) and not varies(bias):
        # running statistics: affine and per sample, so one call on the merged batch
        out = F.instance_norm(input.reshape(-1, *input.shape[2:]), running_mean, running_var, w0, b0, False,
                              momentum, eps)
        return out.reshape(input.shape)
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
    a = kept_primal(input)
    w0, b0 = _primal(weight), _primal(bias)
    if autocast_enabled(a.device.type):  # autocast's layer_norm (float32) for the primal, as a plain forward
        out_a = F.layer_norm(a, normalized_shape, w0, b0, eps)
        a = a.to(out_a.dtype)
        _, mean, rstd = torch.native_layer_norm(a, normalized_shape, None, None, eps)
    else:
        out_a, mean, rstd = torch.native_layer_norm(a, normalized_shape, w0, b0, eps)
    if mean.requires_grad:  # not differentiable outputs in torch; layer_norm_backward's double backward
        mean, rstd = mean.detach(), rstd.detach()  # differentiates through the input instead
    d = _delta(input, nonfinite=False)
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
    return tile(out_a, input.shape[0]) if tan is None else stack_blocks(out_a, out_a + tan)


@register_rule(F.group_norm, torch.group_norm)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *args):
    """GroupNorm: statistics over (channels of a group, spatial) of each primal sample; the input tangent
    ``rstd * (d - mean(d) - xhat * mean(xhat * d))`` is ``native_group_norm_backward`` (no weight) applied to
    ``d_j``, times gamma; under autograd :func:`jvpreg.clone.rules.kernels.group_norm_tangent` (that kernel has no
    derivative in torch)."""
    input = _batch_input(input, weight, bias)
    a = kept_primal(input)
    w0, b0 = _primal(weight), _primal(bias)
    n, c = a.shape[0], a.shape[1]
    hw = math.prod(a.shape[2:])
    if c % num_groups == 0:  # as a plain call checks (torch's own kernel reports the other case)
        _verify_batch_size([n * c // num_groups, num_groups, *a.shape[2:]])
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
    ch = lambda p: _channel_view(p, a.dim())
    d = _delta(input, nonfinite=False)
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
    return tile(out_a, input.shape[0]) if tan is None else stack_blocks(out_a, out_a + tan)


def _sync_batch_norm_rule(args, kwargs):
    """SyncBatchNorm across ranks: statistics of the primal blocks of all ranks (sums all-reduced,
    differentiably), running statistics updated once from them, tangents linearised with the
    global means of ``d`` and ``d * xhat``."""
    from torch.distributed.nn.functional import all_reduce

    names = ("input", "weight", "bias", "running_mean", "running_var", "eps", "momentum", "process_group",
             "world_size")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, weight, bias = bound["input"], bound["weight"], bound["bias"]
    rm, rv, eps, momentum, group = (bound["running_mean"], bound["running_var"], bound["eps"], bound["momentum"],
                                    bound["process_group"])
    a = x[0]
    c = a.shape[1]
    dims = (0,) + tuple(range(2, a.dim()))
    count = torch.full((1,), a.numel() // c, dtype=a.dtype, device=a.device)
    stats = all_reduce(torch.cat([a.sum(dims), (a * a).sum(dims), count]), group=group)
    n = stats[-1]
    mean = stats[:c] / n
    var = stats[c:2 * c] / n - mean * mean
    ch = lambda p: _channel_view(p, a.dim())
    rstd = torch.rsqrt(ch(var) + eps)
    xhat = (a - ch(mean)) * rstd
    w0, b0 = _primal(weight), _primal(bias)
    out_a = xhat if w0 is None else xhat * ch(w0)
    out_a = out_a if b0 is None else out_a + ch(b0)
    if rm is not None:
        with torch.no_grad():
            rm.mul_(1 - momentum).add_(mean.detach() * momentum)
            rv.mul_(1 - momentum).add_(var.detach() * (n / (n - 1)) * momentum)
    k1 = x.shape[0] - 1
    d = block_delta(x[1:], a, nonfinite=False)
    ddims = (1,) + tuple(i + 1 for i in dims[1:])
    sums = all_reduce(torch.cat([d.sum(ddims).flatten(), (d * xhat).sum(ddims).flatten()]), group=group)
    md = sums[: k1 * c].reshape(k1, 1, c, *([1] * (a.dim() - 2))) / n
    mdx = sums[k1 * c:].reshape(k1, 1, c, *([1] * (a.dim() - 2))) / n
    g = rstd if w0 is None else rstd * ch(w0)
    tan = g * (d - md - xhat * mdx)
    params = affine_tangent(xhat, weight, bias, ch)

    return wrap(stack_blocks(out_a, out_a + (tan if params is None else tan + params)))


try:  # the autograd.Function behind nn.SyncBatchNorm (world size > 1)
    from torch.nn.modules._functions import SyncBatchNorm as _SyncBatchNormFunction

    from jvpreg.clone.eager.functions import register_function_rule

    register_function_rule(_SyncBatchNormFunction)(_sync_batch_norm_rule)
except ImportError:  # pragma: no cover - very old torch
    pass


def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """aten._batch_norm_with_update (train-mode BN with running statistics, as torch.compile emits it):
    clone-BN, plus the primal's saved mean / inverse std and an empty reserve, repeated in every block."""
    out = batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)
    a = _primal(input)
    dims = (0,) + tuple(range(2, a.dim()))
    with torch.no_grad():
        var, mean = torch.var_mean(a, dim=dims, correction=0)
        k = out.shape[0]
        stats = (tile(mean, k), tile(torch.rsqrt(var + eps), k))
    reserve = torch.empty((k, 0), dtype=torch.uint8, device=a.device)
    return (out, *stats, reserve)


register_rule(torch.ops.aten._batch_norm_with_update, torch.ops.aten._batch_norm_with_update.default,
              inplace_kwarg=None)(_batch_norm_with_update)
