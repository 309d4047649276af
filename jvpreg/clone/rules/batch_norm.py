"""BatchNorm in clone mode ("clone-BN"), read in one place: the rules, the operators they call, and where a captured
program fuses them with a relu.

Train mode: ``y = gamma * xhat + beta``, ``xhat = (z - mu) * rstd`` over the batch and spatial dims, with ``mu`` and
``rstd`` of the primal block ``a`` only (kept in the autograd graph):

    out_j = out_a + gamma * rstd * (d_j - mean(d_j) - xhat * mean(d_j * xhat)) + xhat * dgamma_j + dbeta_j

``out_a`` is the very call a plain forward makes (bit-identical output, running statistics updated once from the
primal block by the same kernel; ``num_batches_tracked`` is counted by the module, once per call), and the input
tangent is BatchNorm's own input-gradient kernel applied to ``d_j``. Eval mode is affine: every block through the op
on the merged batch. SyncBatchNorm gathers the primal statistics and the tangents' means across ranks.

The rule takes one of three forms (:func:`batch_norm`):

* on the CPU, float32/64, constant affine parameters: :func:`batch_norm_blocks`, one operator that writes every
  block into one output (three blocks allocated per call where the composite form allocates seven) and whose
  backward writes ``dz`` in place; a captured program fuses it with a relu that alone reads it
  (:func:`batch_norm_relu_blocks`; the pass: ``jvpreg.clone.program.passes._fuse_batch_norm_relu``), as a plain
  ``ReLU(inplace=True)`` does;
* under autograd otherwise: the primal by the native kernel, the tangents by :func:`batch_norm_tangent`, whose
  backward is written out (:func:`_bn_tangent_backward`) instead of autograd's double backward of the kernel (a
  composite of ~30 ops); on an accelerator in the form with fewer, larger kernels (:func:`few_launches`);
* elsewhere (``torch.func`` transforms, no autograd): the native backward kernel applied to each ``d_j``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from jvpreg.clone.core.device_paths import on_host
from jvpreg.clone.core.tensor import capturing, compiling, is_clone, raw, varies, wrap
from jvpreg.clone.eager.dispatch import fallback
from jvpreg.clone.eager.functions import register_function_rule
from jvpreg.clone.rules import kernels
from jvpreg.clone.rules.blocks import assemble, count, each_block, primal, split, stacked, tangents
from jvpreg.clone.rules.kernels import (custom_operator, fake_tangent_and_sums, keeping_inputs, masked_by,
    register_autograd)
from jvpreg.clone.rules.kinds import register_rule
from jvpreg.clone.rules.normalization import affine_tangent, channel_view, verify_batch_size


@register_rule(F.batch_norm)
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Clone-BN: batch statistics from the primal block; eval mode is affine (merged batch)."""
    if is_clone(running_mean) or is_clone(running_var):
        return fallback(F.batch_norm, (input, running_mean, running_var, weight, bias, training, momentum, eps), {})
    a = primal(input)
    w0, b0 = primal(weight), primal(bias)
    ch = lambda p: channel_view(p, a.dim())
    if not training:
        if is_clone(input):
            p = input
            merged = F.batch_norm(p.reshape(-1, *p.shape[2:]), running_mean, running_var, w0, b0, False, momentum, eps)
            out = merged.reshape(p.shape)
            if not varies(weight) and not varies(bias):
                return assemble(every_block=out)
            out_a, blocks = split(out, differences=False)
        else:
            out_a, blocks = F.batch_norm(a, running_mean, running_var, w0, b0, False, momentum, eps), None
        xhat = (a - ch(running_mean)) * ch(torch.rsqrt(running_var + eps))
        params = affine_tangent(xhat, weight, bias, ch)
        return assemble(out_a, params) if blocks is None else assemble(out_a, blocks=blocks + params)
    # The primal block is the very call a plain forward makes (bit-identical output and running statistics,
    # updated once); the tangent is batch norm's own input-gradient kernel applied to d_j. Both keep their
    # input for backward: a copy of the primal block under autograd (kept).
    verify_batch_size(a.size())  # the error a plain call raises (one value per channel: no batch statistics)
    momentum = 0.0 if momentum is None else momentum
    if _blocks_in_one_output(input, weight, bias):
        return _batch_norm_blocks(input, w0, b0, running_mean, running_var, momentum, eps)
    a = primal(input, kept=True)
    if on_host(a) and (w0 is None or w0.dtype == a.dtype):
        # the kernel F.batch_norm runs on the CPU, called for its statistics too (a separate var_mean costs more)
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
    """Train-mode BatchNorm through :func:`batch_norm_blocks` (every block written into one output): a clone input of
    float32/64 on the CPU with constant affine parameters, outside ``torch.func`` transforms, forward-mode AD
    (:func:`jvpreg.clone.rules.kernels.inside_transform`) and programs for ``engine="compiled"`` (there Inductor fuses
    the composite rule). Other devices keep the composite rule (cuDNN's kernel for the primal block; the operator is
    not measured on a GPU)."""
    if not is_clone(x) or varies(weight) or varies(bias):
        return False
    z, w0 = raw(x), primal(weight)
    return (type(z) is torch.Tensor and on_host(z) and z.dtype in (torch.float32, torch.float64)
            and (w0 is None or w0.dtype == z.dtype) and not compiling() and not kernels.inside_transform())


def _batch_norm_blocks(x, w0, b0, running_mean, running_var, momentum, eps):
    """The operator, then its running statistics copied into the module's buffers.

    Eager: written as the native kernel writes them, without bumping the buffers' version counters (``.data``), so
    a forward of the same module earlier in the step, which saved the buffers for its backward, stays valid. While
    capturing, a copy the tracer sees (the replay writes the buffers as :mod:`jvpreg.clone.program.side_effects`
    says)."""
    out, *_, new_mean, new_var = batch_norm_blocks(raw(x), w0, b0, running_mean, running_var, momentum, eps)
    for buffer, new in ((running_mean, new_mean), (running_var, new_var)):
        if buffer is not None:  # (no graph: neither requires grad)
            (buffer if capturing() else buffer.data).copy_(new)
    return assemble(every_block=out)


def _written_out_backward(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Use :func:`batch_norm_tangent` (its backward written out): float32/64, where
    :func:`jvpreg.clone.rules.kernels.applies` (under autograd)."""
    return a.dtype in (torch.float32, torch.float64) and kernels.applies(x)


def _bn_tangents(x, a, out_a, mean, invstd, weight, bias, eps, ch):
    """``out_j = out_a + BN_backward(d_j) + xhat * dgamma_j + dbeta_j`` with the primal statistics."""
    w0 = primal(weight)
    d = tangents(x, nonfinite=False)
    t = None
    if d is None:
        pass
    elif _written_out_backward(x, a):
        t = batch_norm_tangent(raw(d), a, w0, mean, invstd, eps)[0]
    else:
        t = each_block(lambda dj: torch.ops.aten.native_batch_norm_backward(
            dj, a, w0, None, None, mean, invstd, True, eps, [True, False, False])[0], d)
    if varies(weight) or varies(bias):
        # differentiable statistics here (the kernel's saved mean/invstd carry no gradient)
        dims = (0,) + tuple(range(2, a.dim()))
        var, mu = torch.var_mean(a, dim=dims, correction=0, keepdim=True)
        params = affine_tangent((a - mu) * torch.rsqrt(var + eps), weight, bias, ch)
        t = params if t is None else t + params
    return assemble(out_a, k=count(x, weight, bias)) if t is None else assemble(out_a, t)


@register_rule(torch.batch_norm)
def torch_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True):
    """``torch.batch_norm``: :func:`batch_norm`."""
    return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


@register_rule(torch.ops.aten._batch_norm_with_update, torch.ops.aten._batch_norm_with_update.default,
               inplace_kwarg=None)
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """aten._batch_norm_with_update (train-mode BN with running statistics, as torch.compile emits it):
    clone-BN, plus the primal's saved mean / inverse std and an empty reserve, repeated in every block."""
    out = batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)
    a = primal(input)
    dims = (0,) + tuple(range(2, a.dim()))
    k = out.shape[0]
    with torch.no_grad():
        var, mean = torch.var_mean(a, dim=dims, correction=0)
        stats = (assemble(mean, k=k), assemble(torch.rsqrt(var + eps), k=k))
    reserve = assemble(torch.empty((0,), dtype=torch.uint8, device=a.device), k=k)
    return (out, *stats, reserve)


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
    a, d = split(x, nonfinite=False)
    c = a.shape[1]
    dims = (0,) + tuple(range(2, a.dim()))
    entries = torch.full((1,), a.numel() // c, dtype=a.dtype, device=a.device)
    stats = all_reduce(torch.cat([a.sum(dims), (a * a).sum(dims), entries]), group=group)
    n = stats[-1]
    mean = stats[:c] / n
    var = stats[c:2 * c] / n - mean * mean
    ch = lambda p: channel_view(p, a.dim())
    rstd = torch.rsqrt(ch(var) + eps)
    xhat = (a - ch(mean)) * rstd
    w0, b0 = primal(weight), primal(bias)
    out_a = xhat if w0 is None else xhat * ch(w0)
    out_a = out_a if b0 is None else out_a + ch(b0)
    if rm is not None:
        with torch.no_grad():
            rm.mul_(1 - momentum).add_(mean.detach() * momentum)
            rv.mul_(1 - momentum).add_(var.detach() * (n / (n - 1)) * momentum)
    k1 = d.shape[0]
    ddims = (1,) + tuple(i + 1 for i in dims[1:])
    sums = all_reduce(torch.cat([d.sum(ddims).flatten(), (d * xhat).sum(ddims).flatten()]), group=group)
    md = sums[: k1 * c].reshape(k1, 1, c, *([1] * (a.dim() - 2))) / n
    mdx = sums[k1 * c:].reshape(k1, 1, c, *([1] * (a.dim() - 2))) / n
    g = rstd if w0 is None else rstd * ch(w0)
    tan = g * (d - md - xhat * mdx)
    params = affine_tangent(xhat, weight, bias, ch)
    return wrap(assemble(out_a, tan if params is None else tan + params))


try:  # the autograd.Function behind nn.SyncBatchNorm (world size > 1)
    from torch.nn.modules._functions import SyncBatchNorm as _SyncBatchNormFunction
except ImportError:  # pragma: no cover - very old torch
    _SyncBatchNormFunction = None
if _SyncBatchNormFunction is not None:
    register_function_rule(_SyncBatchNormFunction)(_sync_batch_norm_rule)


# ---------------------------------------------------------------------------------------------------- operators

_bn_backward = torch.ops.aten.native_batch_norm_backward.default


def _sums_weight(weight: Optional[torch.Tensor], mean: torch.Tensor) -> torch.Tensor:
    """``weight``, or ones for a BatchNorm without one: the clone rules read ``sum(g * xhat)`` from
    ``native_batch_norm_backward``'s weight gradient, which CUDA's kernel returns empty when no weight is passed (the
    CPU's computes it); a weight of ones changes no other output (``gamma = 1``)."""
    return torch.ones_like(mean) if weight is None else weight


@custom_operator("batch_norm_tangent")
def batch_norm_tangent(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                       invstd: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train-mode BatchNorm's tangents ``t_j = gamma * r * (d_j - mean(d_j) - xhat * mean(d_j * xhat))`` (``(C,)``
    statistics ``mean``, ``invstd = r`` of the primal block ``a``, reduced over every dim but 1), with the
    per-channel sums ``sum(d_j * xhat)`` and ``sum(d_j)`` that the backward reuses (``(K-1, C)`` each)."""
    w = _sums_weight(weight, mean)
    outs = [_bn_backward(dj, a, w, None, None, mean, invstd, True, eps, [True, True, True]) for dj in d]
    return (stacked([o[0] for o in outs]), stacked([o[1].to(mean.dtype) for o in outs]),
            stacked([o[2].to(mean.dtype) for o in outs]))


batch_norm_tangent.register_fake(fake_tangent_and_sums)


def _bn_tangent_backward(ctx, grad, _g_sdx, _g_sd):
    """Gradients of ``L = sum_j <g_j, t_j>`` w.r.t. ``d``, ``a`` and ``gamma`` (``mean``, ``invstd`` are functions
    of ``a``, accounted for here). Per channel, with ``N`` entries, ``G = gamma g_j``, sums ``S_x = sum(x)``:

        dL/dd_j = BN_backward(g_j)    (t is gamma r P(d) with P a symmetric projection)
        dL/da   = -(r^2/N) sum_j [xhat (A_j - 3 c_j S_Gxhat) + S_Gxhat (d_j - mean d_j) + N c_j (G - mean G)]
        dL/dgamma = r sum_j (S_gd - mean(d_j) S_g - c_j S_gxhat)

    with ``A_j = S_Gd - mean(d_j) S_G``, ``c_j = mean(d_j xhat)``: two BatchNorm backward kernels and three fused
    multiply-adds per tangent, far fewer than autograd's double backward of ``native_batch_norm_backward`` runs.
    Under ``create_graph`` torch's own double backward runs instead (higher orders as in torch)."""
    if grad is None:
        return None, None, None, None, None, None
    d, a, weight, mean, invstd, sum_dx, sum_d = ctx.saved_tensors
    eps = ctx.setting
    if torch.is_grad_enabled():
        return _bn_tangent_backward_graph(grad, d, a, weight, mean, invstd, eps)
    grad_d, grad_a, grad_w = _bn_tangent_grads(grad, d, a, weight, mean, invstd, sum_dx, sum_d, eps)
    return grad_d, grad_a, grad_w, None, None, None


def _bn_tangent_grads(grad, d, a, weight, mean, invstd, sum_dx, sum_d, eps):
    """``(dL/dd, dL/da, dL/dgamma)`` of :func:`_bn_tangent_backward` (no graph), ``dL/dgamma`` ``None`` without a
    weight; on an accelerator by :func:`_bn_tangent_grads_few_launches`."""
    if few_launches(a):
        return _bn_tangent_grads_few_launches(grad, d, a, weight, mean, invstd, sum_dx, eps)
    ch, w, n = _channels(a, weight, mean)
    grad_d, grad_a, grad_w = [], None, None
    for j in range(d.shape[0]):
        gj, dj = grad[j], d[j]
        gd, (coef_a, coef_d, coef_g, const, dgamma) = _bn_tangent_terms(gj, dj, a, weight, mean, invstd, sum_dx[j],
                                                                        sum_d[j], eps, w, n)
        grad_d.append(gd)
        ga = (a * ch(coef_a)).add_(ch(const))  # (an addcmul with a broadcast first operand is slower)
        ga.addcmul_(ch(coef_d), dj).addcmul_(ch(coef_g), gj)
        grad_a = ga if grad_a is None else grad_a.add_(ga)
        grad_w = _accumulated(grad_w, dgamma)
    return stacked(grad_d), grad_a.to(a.dtype), None if weight is None else grad_w.to(weight.dtype)


def few_launches(t: torch.Tensor) -> bool:
    """Whether the BatchNorm tangent's backward takes the form with fewer, larger kernels
    (:func:`_bn_tangent_grads_few_launches`): on an accelerator, where a small network's step is launch-bound. The
    CPU keeps the form expanded in ``a``, ``d_j``, ``g_j`` (one BatchNorm backward pass fewer: faster there)."""
    return not on_host(t)


def _bn_tangent_grads_few_launches(grad, d, a, weight, mean, invstd, sum_dx, eps):
    """:func:`_bn_tangent_grads` as ``dL/da = -r sum_j [mean(G u_j) xhat + mean(d_j xhat) h_j + mean(G xhat) u_j]``
    (:func:`_bn_tangent_backward`), with ``u_j = r P(d_j)`` from a third BatchNorm backward kernel and six
    ``(C,)`` products per tangent instead of eighteen (fewer launches for one more pass over the activations)."""
    ch, w, n = _channels(a, weight, mean)
    ones, zeros = (w if weight is None else torch.ones_like(mean)), torch.zeros_like(mean)
    q = invstd * (-1.0 / n)
    qw = q if weight is None else q * w
    grad_d, grad_a, coef_a, grad_w = [], None, None, None
    for j in range(d.shape[0]):
        gj = grad[j]
        h, s_gx, _ = _bn_backward(gj, a, w, None, None, mean, invstd, True, eps, [True, True, False])
        u = _bn_backward(d[j], a, None, None, None, mean, invstd, True, eps, [True, False, False])[0]
        s_gu = _bn_backward(gj, u, ones, None, None, zeros, ones, True, 0.0, [False, True, False])[1]  # sum(g u)
        s_gx, s_gu = s_gx.to(mean.dtype), s_gu.to(mean.dtype)
        grad_d.append(h)
        ga = torch.mul(h, ch(q * sum_dx[j])).addcmul_(u, ch(qw * s_gx))
        grad_a = ga if grad_a is None else grad_a.add_(ga)
        coef_a = _accumulated(coef_a, torch.mul(qw, invstd).mul_(s_gu))
        grad_w = _accumulated(grad_w, None if weight is None else s_gu)  # dL/dgamma = sum(g u)
    grad_a.addcmul_(a, ch(coef_a)).sub_(ch(coef_a.mul_(mean)))  # + (a - mean) * sum_j (-r^2 gamma / N) sum(g u)
    return stacked(grad_d), grad_a.to(a.dtype), None if weight is None else grad_w.to(weight.dtype)


def _channels(a, weight, mean):
    """``(view of a (C,) vector broadcasting over a, gamma (ones without a weight), entries per channel)``."""
    ch = lambda p: p.reshape(-1, *([1] * (a.dim() - 2)))
    w = weight.to(mean.dtype) if weight is not None else torch.ones_like(mean)
    return ch, w, a.numel() // a.shape[1]


def _accumulated(total: Optional[torch.Tensor], term: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``total + term`` in place, ``term`` itself for the first term (no zero tensor to start from); ``None`` terms
    (no weight) add nothing."""
    if term is None:
        return total
    return term if total is None else total.add_(term)


def _bn_tangent_terms(gj, dj, a, weight, mean, invstd, sum_dx_j, sum_d_j, eps, w, n):
    """``dL/dd_j`` and the per-channel ``(coef_a, coef_d, coef_g, const, dL/dgamma_j)`` of
    ``dL/da_j = coef_a a + const + coef_d d_j + coef_g g_j`` (the formulas of :func:`_bn_tangent_backward`), with
    ``q = -r^2 gamma / N``, ``b = S_gd - mean(d_j) S_g - c_j S_gxhat``:

        coef_a = q r (b - 2 c_j S_gxhat),  coef_d = q S_gxhat,  coef_g = q S_dxhat,
        const = -coef_a mean - q (mean(d_j) S_gxhat + c_j S_g),  dL/dgamma_j = r b

    in 18 small (C,) kernels (on a GPU each is a launch, and the step of a small network is launch-bound);
    ``dL/dgamma_j`` is ``None`` without a weight."""
    r = invstd
    gd, s_gx, s_g = _bn_backward(gj, a, w, None, None, mean, invstd, True, eps, [True, True, True])  # (w: gamma or 1)
    ones = torch.ones_like(mean)  # sum(g_j d_j): the weight gradient of a BatchNorm of d_j with mean 0, invstd 1
    s_gd = _bn_backward(gj, dj, ones, None, None, torch.zeros_like(mean), ones, True, 0.0, [False, True, False])[1]
    s_gx, s_g, s_gd = s_gx.to(mean.dtype), s_g.to(mean.dtype), s_gd.to(mean.dtype)
    dbar, c = sum_d_j / n, sum_dx_j / n
    b = torch.addcmul(s_gd, dbar, s_g, value=-1).addcmul_(c, s_gx, value=-1)
    q = torch.mul(r, w).mul_(r).div_(-n)
    coef_a = torch.addcmul(b, c, s_gx, value=-2).mul_(q).mul_(r)
    const = torch.mul(s_gx, dbar).addcmul_(c, s_g).mul_(q).addcmul_(coef_a, mean).neg_()
    return gd, (coef_a, q * s_gx, q * sum_dx_j, const, None if weight is None else r * b)


def _bn_tangent_backward_graph(grad, d, a, weight, mean, invstd, eps):
    """The same gradients through autograd of ``native_batch_norm_backward`` (differentiable once more)."""
    inputs = [(i, x) for i, x in enumerate((d, a, weight)) if x is not None and x.requires_grad]
    t = torch.stack([_bn_backward(dj, a, weight, None, None, mean, invstd, True, eps, [True, False, False])[0]
                     for dj in d])
    grads = torch.autograd.grad(t, [x for _, x in inputs], grad, create_graph=True, allow_unused=True)
    out = [None, None, None, None, None, None]
    for (i, _), g in zip(inputs, grads):
        out[i] = g
    return tuple(out)


register_autograd(batch_norm_tangent, _bn_tangent_backward, keeping_inputs(1, sums=True))


def _dense_layout(t: torch.Tensor) -> Optional[torch.memory_format]:
    """The memory format ``t`` is contiguous in (channels-last first, as torch suggests it), or ``None``."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    if t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()]) and not t.is_contiguous():
        return formats[t.dim()]
    return torch.contiguous_format if t.is_contiguous() else None


def _blocks(shape: torch.Size, like: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    """An empty ``(K, *like.shape)`` tensor (not a view: an operator's output may be written in place) whose blocks
    are each contiguous in ``layout``."""
    strides = torch.empty(like.shape, device="meta", memory_format=layout).stride()
    return torch.empty_strided(shape, (like.numel(), *strides), dtype=like.dtype, device=like.device)


def _bn_blocks(z: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float,
               eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor]:
    """Clone-BN on the physical blocks ``z = [a; z_1; ...]``: ``out_0 = BN(a)`` by the plain forward's kernel,
    ``out_j = out_0 + t_j`` with :func:`batch_norm_tangent`'s ``t_j`` of ``d_j = z_j - a``, written into one output in
    ``z``'s layout; with the primal ``mean``, ``invstd``, the sums ``sum(d_j * xhat)``, ``sum(d_j)`` and the running
    statistics updated from ``a`` by that kernel (new tensors: an operator with a derivative may not mutate its
    inputs; empty where there are none), which the caller copies into the module's buffers."""
    a = z[0]
    new_mean = a.new_empty(0) if running_mean is None else running_mean.clone()
    new_var = a.new_empty(0) if running_var is None else running_var.clone()
    running = (None if running_mean is None else new_mean, None if running_var is None else new_var)
    layout = _dense_layout(a)
    if layout is not None:  # the kernel writes block 0 of the output (its .out reads other layouts wrong: torch 2.15)
        out = _blocks(z.shape, a, layout)
        mean, invstd = a.new_empty(a.shape[1]), a.new_empty(a.shape[1])
        torch.ops.aten.native_batch_norm.out(a, weight, bias, *running, True, momentum, eps, out=out[0],
                                             save_mean=mean, save_invstd=invstd)
    else:  # e.g. a transposed token batch: the functional kernel, then a copy
        out_a, mean, invstd = torch.ops.aten.native_batch_norm(a, weight, bias, *running, True, momentum, eps)
        out = _blocks(z.shape, out_a, _dense_layout(out_a) or torch.contiguous_format)
        out[0].copy_(out_a)
    sum_dx, sum_d, w = [], [], _sums_weight(weight, mean)
    for j in range(1, z.shape[0]):
        dj = torch.sub(z[j], a, out=out[j])  # d_j in its output slot, overwritten by out_0 + t_j below
        t, s_dx, s_d = _bn_backward(dj, a, w, None, None, mean, invstd, True, eps, [True, True, True])
        torch.add(out[0], t, out=out[j])
        sum_dx.append(s_dx.to(mean.dtype))
        sum_d.append(s_d.to(mean.dtype))
    return out, mean, invstd, stacked(sum_dx), stacked(sum_d), new_mean, new_var


batch_norm_blocks = custom_operator("batch_norm_blocks")(_bn_blocks)


@batch_norm_blocks.register_fake
def _bn_blocks_fake(z, weight, bias, running_mean, running_var, momentum, eps):
    stats = z.new_empty(z.shape[2])
    sums = z.new_empty((z.shape[0] - 1, z.shape[2]))
    running = [z.new_empty(0) if r is None else torch.empty_like(r) for r in (running_mean, running_var)]
    return torch.empty_like(z), stats, torch.empty_like(stats), sums, torch.empty_like(sums), *running


def _bn_blocks_setup(ctx, inputs, output, *kept):
    z, weight, bias, _, _, _, eps = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.eps, ctx.has_bias = eps, bias is not None
    ctx.save_for_backward(z, weight, *output[1:5], *kept)


def _bn_blocks_backward(ctx, grad, *_stats_grads):
    if grad is None:
        return None, None, None, None, None, None, None
    return _bn_blocks_grad(ctx, grad, ctx.saved_tensors)


def _bn_blocks_grad(ctx, grad, saved):
    """``out_j = out_0 + t_j(d_j, a)``: the primal block's BatchNorm backward of ``g_0 + sum_j g_j``, plus
    :func:`_bn_tangent_backward`'s gradients of ``sum_j <g_j, t_j>``; ``dz_0 = dx_a - sum_j dL/dd_j``,
    ``dz_j = dL/dd_j``. ``saved``: ``ctx.saved_tensors``, read once (a checkpoint unpacks each saved tensor once)."""
    z, weight, mean, invstd, sum_dx, sum_d = saved[:6]
    a, eps = z[0], ctx.eps
    mask = [True, weight is not None and ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    if torch.is_grad_enabled():  # create_graph: torch's double backward of the kernels (higher orders as in torch)
        dx, dw, db = _bn_backward(grad.sum(0), a, weight, None, None, mean, invstd, True, eps, mask)
        d = z[1:] - a
        t = torch.stack([_bn_backward(dj, a, weight, None, None, mean, invstd, True, eps, [True, False, False])[0]
                         for dj in d])
        wants_w = weight is not None and weight.requires_grad
        grads = torch.autograd.grad(t, [z, weight] if wants_w else [z], grad[1:], create_graph=True,
                                    allow_unused=True)
        gz, gw = grads[0], grads[1] if wants_w else None
        dz = torch.cat([(gz[0] + dx).unsqueeze(0), gz[1:]])
    else:
        dz, gw, spare = _bn_blocks_grads(grad, z, weight, mean, invstd, sum_dx, sum_d, eps)
        dx, dw, db = _bn_backward(torch.sum(grad, 0, out=spare), a, weight, None, None, mean, invstd, True, eps, mask)
        dz[0].add_(dx)
    if dw is not None and gw is not None:
        dw = dw + gw.to(dw.dtype)
    return dz, dw if mask[1] else None, db if mask[2] else None, None, None, None, None


def _bn_blocks_grads(grad, z, weight, mean, invstd, sum_dx, sum_d, eps):
    """``dz`` of ``sum_j <g_j, t_j>`` (``dz_j = dL/dd_j``, ``dz_0 = dL/da - sum_j dL/dd_j``, written in place: at most
    two blocks of temporaries beside ``dz``), ``dL/dgamma`` and the last ``d_j`` (a block the caller may reuse)."""
    a = z[0]
    ch, w, n = _channels(a, weight, mean)
    grad_w = None
    dz = torch.empty_like(z)
    dz0 = dz[0]
    for j in range(1, z.shape[0]):
        gj, dj = grad[j], z[j] - a
        gd, (coef_a, coef_d, coef_g, const, dgamma) = _bn_tangent_terms(gj, dj, a, weight, mean, invstd,
                                                                        sum_dx[j - 1], sum_d[j - 1], eps, w, n)
        dz[j].copy_(gd)
        del gd
        if j == 1:
            torch.mul(a, ch(coef_a), out=dz0)
        else:
            dz0.addcmul_(ch(coef_a), a)
        dz0.add_(ch(const)).addcmul_(ch(coef_d), dj).addcmul_(ch(coef_g), gj).sub_(dz[j])
        grad_w = _accumulated(grad_w, dgamma)
    return dz, grad_w, dj


register_autograd(batch_norm_blocks, _bn_blocks_backward, _bn_blocks_setup)


@custom_operator("batch_norm_relu_blocks")
def batch_norm_relu_blocks(z: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                           running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float,
                           eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`batch_norm_blocks` then :func:`relu_blocks` in place on its output: ``(out, keep, mean, invstd, sum_dx,
    sum_d, new running mean, new running var)``. One output where the two operators make two (a plain forward's
    BatchNorm -> ReLU(inplace=True) makes one); :mod:`jvpreg.clone.program.passes` puts it in captured programs."""
    out, *rest = _bn_blocks(z, weight, bias, running_mean, running_var, momentum, eps)
    tangents = out[1:]  # masked first, reading the primal block before it is clamped (same pattern either way)
    torch.ops.aten.threshold_backward.grad_input(tangents, out[0].expand_as(tangents), 0, grad_input=tangents)
    out[0].clamp_min_(0)  # relu, NaN kept
    return out, out[0].to(torch.bool), *rest


@batch_norm_relu_blocks.register_fake
def _(z, weight, bias, running_mean, running_var, momentum, eps):
    out, *rest = _bn_blocks_fake(z, weight, bias, running_mean, running_var, momentum, eps)
    return out, torch.empty_like(z[0], dtype=torch.bool), *rest


def _bn_relu_blocks_setup(ctx, inputs, output):
    _bn_blocks_setup(ctx, inputs, (output[0], *output[2:]), output[1])
    ctx.mark_non_differentiable(*output[1:])


def _bn_relu_blocks_backward(ctx, grad, *_grads):
    """Relu's backward ``keep * g``, then :func:`_bn_blocks_backward`'s."""
    if grad is None:
        return None, None, None, None, None, None, None
    saved = ctx.saved_tensors  # read once (a checkpoint unpacks each saved tensor once)
    return _bn_blocks_grad(ctx, masked_by(grad, saved[6]), saved)


register_autograd(batch_norm_relu_blocks, _bn_relu_blocks_backward, _bn_relu_blocks_setup)


