"""Operators the rules call where autograd would save more for a composite than the op it replaces.

``jvpreg::relu_blocks(z) -> (out, keep)``: relu's clone rule on the physical ``(K, *L)`` blocks,
``out_j = 1[a > 0] * z_j`` with ``a = z_0`` (``keep = not (a <= 0)``, relu's own pass condition, NaN included).
Written with ``threshold_backward(z, a, 0)`` alone, autograd would keep ``a`` (a view that pins the whole
``(K, *L)`` input) or a float copy of it: one more activation per relu than the plain forward saves. This
op keeps ``keep`` as a bool block instead (a quarter of the bytes) and its backward is
``dz_j = keep * dout_j``. Registered with ``torch.library`` so a captured program records it as one node
(:mod:`jvpreg.clone.program.capture`) and its backward is replayed by autograd like any aten op's.

``jvpreg::batch_norm_tangent(d, a, gamma, mean, invstd, eps)``: train-mode BatchNorm's tangent blocks, the
BatchNorm backward kernel applied to ``d_j``; its backward is written out (:func:`_bn_tangent_backward`) instead of
autograd's double backward of that kernel, a composite of ~30 ops that took 13-16% of a regularized ResNet-18 step.

``jvpreg::batch_norm_blocks(z, gamma, beta, running_mean, running_var, momentum, eps)``: train-mode BatchNorm's whole
clone rule on the CPU, ``out_0 = BN(a)`` by the plain forward's kernel and ``out_j = out_0 + t_j``, written into one
output; autograd keeps the input blocks (as a plain BatchNorm keeps its input) and the backward writes ``dz`` in place.
The composite rule (a copy of ``a``, ``d``, ``t``, ``out_0 + t``, then a ``stack``) allocated seven blocks per call
where this allocates three. ``jvpreg::batch_norm_relu_blocks``: the same with ``relu_blocks`` applied in place on its
output (:mod:`jvpreg.clone.program.passes` fuses a relu that alone reads a BatchNorm, as a plain ``ReLU(inplace=True)`` does).
Together, on a regularized ResNet-18 step (train-mode BatchNorm, batch 64, 64x64, captured engine), they took the
tensors allocated per step from 2089 to 1730 MiB (the plain 2B step: 1342 MiB).

``jvpreg::attention_blocks(q, k, v, value_blocks, dq, dk, mask, scale, causal, blocks)``: scaled dot-product
attention linearised at the primal block (:func:`linearised_attention`), every block at once. Autograd would keep
three ``L x S`` tensors (``P``, ``dS``, ``dP``) where fused attention keeps none; the operator keeps its inputs and
recomputes the rest in its backward (one more forward of the attention, as activation checkpointing does).

``jvpreg::group_norm_tangent(d, a, gamma, mean, rstd, groups, eps)``: GroupNorm's, the GroupNorm backward kernel (no
weight) applied to ``d_j``, times gamma; torch has no derivative for that kernel, so the backward is written out
(:func:`_gn_tangent_backward`).

``jvpreg::layer_norm_tangent(d, a, gamma, mean, rstd, normalized_shape, eps)``: LayerNorm's, the LayerNorm backward
kernel (no weight) applied to ``d_j``, times gamma, its backward written out: torch's double backward of that kernel
is exact to first order only (it holds the statistics fixed in its own derivative), which made Hessian-vector
products of penalties through LayerNorm silently wrong.

Under ``create_graph`` the GroupNorm and LayerNorm operators differentiate their primitive-op form, with statistics
recomputed from ``a`` (exact at every order).

:func:`applies` says where the rules may call them.
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.autograd import forward_ad

from jvpreg.clone.core.device_paths import on_host
from jvpreg.clone.core.tensor import CloneTensor, compiling, each_block, stack_blocks, tile

__all__ = ["applies", "relu_blocks", "batch_norm_tangent", "group_norm_tangent", "attention_blocks",
           "attention_probs", "attention_recomputed", "layer_norm_tangent", "linearised_attention"]

_threshold_backward = torch.ops.aten.threshold_backward.default


# The operators' own Python functions, and the same forward, setup and backward as a plain ``autograd.Function``:
# :mod:`jvpreg.clone.program.replay` calls that one, skipping the custom-operator machinery (Python dispatch, schema
# checks), which cost 30-40 µs a call and up to 250 µs on a 1M-entry ``relu_blocks`` on this CPU.
_IMPLS: Dict[Any, Tuple[str, Callable]] = {}
DIRECT: Dict[torch._ops.OpOverload, Callable] = {}


def _operator(name: str) -> Callable:
    """``torch.library.custom_op("jvpreg::<name>")`` of the decorated function, which is kept for :data:`DIRECT`."""
    def wrap(fn):
        op = torch.library.custom_op(f"jvpreg::{name}", mutates_args=())(fn)
        _IMPLS[op] = (name, fn)
        return op
    return wrap


def _register_autograd(op: Any, backward: Callable, setup_context: Callable) -> None:
    """``op.register_autograd(backward, setup_context=...)``, and the same as an ``autograd.Function`` in
    :data:`DIRECT` (the call bound to positional arguments, as the custom operator binds it)."""
    op.register_autograd(backward, setup_context=setup_context)
    name, impl = _IMPLS[op]
    signature = inspect.signature(impl)

    def forward(ctx, *args):
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    fn = type(f"{name}_direct", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def call(*args, **kwargs):
        if kwargs:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        return fn.apply(*args)

    DIRECT[getattr(torch.ops.jvpreg, name).default] = call


def inside_transform() -> bool:
    """A ``torch.func`` transform (grad, vjp, jacrev, jvp) or a forward-mode AD dual level is active: tensors may
    be wrapped or carry forward tangents, which neither the operators' autograd (no functorch support, no
    forward-mode formulas) nor a recorded program (plain tensors) can take."""
    return torch._C._functorch.peek_interpreter_stack() is not None or forward_ad._current_level >= 0


def applies(t: torch.Tensor) -> bool:
    """Whether a rule may call these operators on ``t``: under autograd, outside ``torch.func`` transforms and
    forward-mode AD's dual levels (the operators' autograd has neither functorch support nor forward-mode formulas),
    on a plain or clone tensor (not a DTensor: no sharding rule).

    In programs for ``engine="compiled"`` on the CPU too, where Inductor calls them as opaque kernels: its C++
    code stores a bool mask 10-20x slower than ATen on this (AVX-512) CPU (relu(h) and h <= 0 of 128x200: 215 µs
    compiled, 12 µs eager), and the compiled engine's ResNet-18 training step (train-mode BatchNorm, batch 32)
    took 120 ms with the operators and 143 ms with Inductor's fusion of the decomposed rules (the 4-layer ViT
    was unchanged within noise). On other devices a compiled program leaves the decomposed rules to Inductor's
    fusion (not measured here: no GPU)."""

    return (torch.is_grad_enabled() and t.requires_grad and type(t) in (torch.Tensor, CloneTensor)
            and not inside_transform() and (on_host(t) or not compiling()))


@_operator("relu_blocks")
def relu_blocks(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(1[a > 0] * z_j for all j, not (a <= 0))`` with ``a = z[0]``."""
    a = z[0]
    out = _threshold_backward(z, a.expand_as(z), 0)
    # relu(a) with NaN kept is nonzero exactly where not (a <= 0): a cast to bool (vectorised; comparisons that
    # make bools run 7-9x slower on the CPU)
    return out, out[0].to(torch.bool)


@relu_blocks.register_fake
def _(z):
    return torch.empty_like(z), torch.empty_like(z[0], dtype=torch.bool)


def _setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zero gradient for the bool output
    ctx.save_for_backward(output[1])


def _backward(ctx, grad, _grad_keep):
    if grad is None:
        return None
    (keep,) = ctx.saved_tensors
    return _masked(grad, keep)


def _masked(grad: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keep * grad`` by relu's backward kernel (0 where not kept, whatever ``grad`` holds there). The bool pattern
    is cast through a uint8 view (7x faster on the CPU), except where a compiled backward is traced (on fake tensors:
    Inductor fuses the cast, and torch 2.11's cannot lower a bool -> uint8 view)."""
    traced = torch._subclasses.fake_tensor.is_fake(grad)
    keep = keep.to(grad.dtype) if traced else keep.view(torch.uint8).to(grad.dtype)
    return _threshold_backward(grad, keep.expand_as(grad), 0)


_register_autograd(relu_blocks, _backward, _setup)


_bn_backward = torch.ops.aten.native_batch_norm_backward.default


def _sums_weight(weight: Optional[torch.Tensor], mean: torch.Tensor) -> torch.Tensor:
    """``weight``, or ones for a BatchNorm without one: the clone rules read ``sum(g * xhat)`` from
    ``native_batch_norm_backward``'s weight gradient, which CUDA's kernel returns empty when no weight is passed (the
    CPU's computes it); a weight of ones changes no other output (``gamma = 1``)."""
    return torch.ones_like(mean) if weight is None else weight


@_operator("batch_norm_tangent")
def batch_norm_tangent(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                       invstd: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train-mode BatchNorm's tangents ``t_j = gamma * r * (d_j - mean(d_j) - xhat * mean(d_j * xhat))`` (``(C,)``
    statistics ``mean``, ``invstd = r`` of the primal block ``a``, reduced over every dim but 1), with the
    per-channel sums ``sum(d_j * xhat)`` and ``sum(d_j)`` that the backward reuses (``(K-1, C)`` each)."""
    w = _sums_weight(weight, mean)
    outs = [_bn_backward(dj, a, w, None, None, mean, invstd, True, eps, [True, True, True]) for dj in d]
    return (_stacked([o[0] for o in outs]), _stacked([o[1].to(mean.dtype) for o in outs]),
            _stacked([o[2].to(mean.dtype) for o in outs]))


def _stacked(parts):
    """``torch.stack(parts)`` without its copy for the usual single tangent (a view of a fresh tensor)."""
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


def _fake_tangent_and_sums(d, a, weight, mean, rstd, _setting):
    """Shapes of a normalisation tangent operator's outputs: the tangents, and two sums per statistic."""
    sums = d.new_empty((d.shape[0], *mean.shape), dtype=mean.dtype)
    return torch.empty_like(d), sums, torch.empty_like(sums)


def _keeping(settings: int, sums: bool) -> Callable:
    """A normalisation tangent operator's ``setup_context``: save its tensor inputs (all but the trailing
    ``settings`` ones, which become ``ctx.setting``: the one, or their tuple) and, with ``sums``, its two sum
    outputs (not differentiable, and given no zero gradients)."""
    def setup(ctx, inputs, output):
        kept = ()
        if sums:
            ctx.mark_non_differentiable(output[1], output[2])
            ctx.set_materialize_grads(False)
            kept = (output[1], output[2])
        ctx.setting = inputs[-1] if settings == 1 else inputs[-settings:]
        ctx.save_for_backward(*inputs[:-settings], *kept)
    return setup


batch_norm_tangent.register_fake(_fake_tangent_and_sums)


def _bn_tangent_backward(ctx, grad, _g_sdx, _g_sd):
    """Gradients of ``L = sum_j <g_j, t_j>`` w.r.t. ``d``, ``a`` and ``gamma`` (``mean``, ``invstd`` are functions
    of ``a``, accounted for here). Per channel, with ``N`` entries, ``G = gamma g_j``, sums ``S_x = sum(x)``:

        dL/dd_j = BN_backward(g_j)    (t is gamma r P(d) with P a symmetric projection)
        dL/da   = -(r^2/N) sum_j [xhat (A_j - 3 c_j S_Gxhat) + S_Gxhat (d_j - mean d_j) + N c_j (G - mean G)]
        dL/dgamma = r sum_j (S_gd - mean(d_j) S_g - c_j S_gxhat)

    with ``A_j = S_Gd - mean(d_j) S_G``, ``c_j = mean(d_j xhat)``: two BatchNorm backward kernels and three fused
    multiply-adds per tangent, where autograd's double backward of ``native_batch_norm_backward`` takes ~7x longer.
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
        ga = (a * ch(coef_a)).add_(ch(const))  # (an addcmul with a broadcast first operand is 3-6x slower)
        ga.addcmul_(ch(coef_d), dj).addcmul_(ch(coef_g), gj)
        grad_a = ga if grad_a is None else grad_a.add_(ga)
        grad_w = _accumulated(grad_w, dgamma)
    return _stacked(grad_d), grad_a.to(a.dtype), None if weight is None else grad_w.to(weight.dtype)


def few_launches(t: torch.Tensor) -> bool:
    """Whether the BatchNorm tangent's backward takes the form with fewer, larger kernels
    (:func:`_bn_tangent_grads_few_launches`): on an accelerator, where a small network's step is launch-bound. The
    CPU keeps the form expanded in ``a``, ``d_j``, ``g_j`` (one BatchNorm backward pass fewer: 1.3x faster here)."""
    return not on_host(t)


def _bn_tangent_grads_few_launches(grad, d, a, weight, mean, invstd, sum_dx, eps):
    """:func:`_bn_tangent_grads` as ``dL/da = -r sum_j [mean(G u_j) xhat + mean(d_j xhat) h_j + mean(G xhat) u_j]``
    (:func:`_bn_tangent_backward`), with ``u_j = r P(d_j)`` from a third BatchNorm backward kernel and six
    ``(C,)`` products per tangent instead of eighteen (35 kernels per BatchNorm of a regularized step on a GPU's
    path, 25 with this form; one more pass over the activations)."""
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
    return _stacked(grad_d), grad_a.to(a.dtype), None if weight is None else grad_w.to(weight.dtype)


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

    in 18 small (C,) kernels (36 before: on a GPU each is a launch, and the step of a small network is launch-bound);
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


_register_autograd(batch_norm_tangent, _bn_tangent_backward, _keeping(1, sums=True))


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
    return out, mean, invstd, _stacked(sum_dx), _stacked(sum_d), new_mean, new_var


batch_norm_blocks = _operator("batch_norm_blocks")(_bn_blocks)


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


_register_autograd(batch_norm_blocks, _bn_blocks_backward, _bn_blocks_setup)


@_operator("batch_norm_relu_blocks")
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
    return _bn_blocks_grad(ctx, _masked(grad, saved[6]), saved)


_register_autograd(batch_norm_relu_blocks, _bn_relu_blocks_backward, _bn_relu_blocks_setup)


_gn_backward = torch.ops.aten.native_group_norm_backward.default


def _gn_dims(a: torch.Tensor, groups: int):
    n, c = a.shape[0], a.shape[1]
    return n, c, a.numel() // (n * c) if n * c else 0


@_operator("group_norm_tangent")
def group_norm_tangent(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                       rstd: torch.Tensor, groups: int, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupNorm's tangents ``t_j = gamma * r * (d_j - mean(d_j) - xhat * mean(d_j * xhat))`` (means over each
    sample's group; ``(N, G)`` statistics ``mean``, ``rstd = r`` of the primal block ``a``), with the per-group sums
    ``sum(d_j * xhat)`` and ``sum(d_j)`` the backward reuses (``(K-1, N, G)`` each)."""
    n, c, hw = _gn_dims(a, groups)
    xg = ((a.reshape(n, groups, -1) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1))
    ts, sdx, sd = [], [], []
    for dj in d:
        t = _gn_backward(dj, a, mean, rstd, None, n, c, hw, groups, [True, False, False])[0]
        ts.append(t if weight is None else t * weight.reshape(1, c, *([1] * (a.dim() - 2))))
        dg = dj.reshape(n, groups, -1)
        sdx.append((dg * xg).sum(-1).to(mean.dtype))
        sd.append(dg.sum(-1).to(mean.dtype))
    return _stacked(ts), _stacked(sdx), _stacked(sd)


@group_norm_tangent.register_fake
def _(d, a, weight, mean, rstd, groups, eps):
    return _fake_tangent_and_sums(d, a, weight, mean, rstd, groups)


def group_norm_tangent_composite(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], groups: int,
                                 eps: float) -> torch.Tensor:
    """:func:`group_norm_tangent`'s ``t`` from differentiable primitive ops (statistics recomputed from ``a``)."""
    n = a.shape[0]
    ag = a.reshape(n, groups, -1)
    var, mean = torch.var_mean(ag, dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xg = (ag - mean) * rstd
    dg = d.reshape(d.shape[0], n, groups, -1)
    dn = ((dg - dg.mean(-1, keepdim=True) - xg * (dg * xg).mean(-1, keepdim=True)) * rstd).reshape(d.shape)
    return dn if weight is None else dn * weight.reshape(-1, *([1] * (a.dim() - 2)))


def _gn_tangent_backward(ctx, grad, _g_sdx, _g_sd):
    """Gradients of ``sum_j <g_j, t_j>`` (:func:`_group_tangent_grads`)."""
    if grad is None:
        return None, None, None, None, None, None, None
    d, a, weight, mean, rstd, sum_dx, sum_d = ctx.saved_tensors
    groups, eps = ctx.setting
    if torch.is_grad_enabled():  # create_graph: through the primitive-op form
        inputs = [(i, x) for i, x in enumerate((d, a, weight)) if x is not None and x.requires_grad]
        grads = torch.autograd.grad(group_norm_tangent_composite(d, a, weight, groups, eps), [x for _, x in inputs],
                                    grad, create_graph=True, allow_unused=True)
        out = [None] * 7
        for (i, _), g in zip(inputs, grads):
            out[i] = g
        return tuple(out)
    return (*_group_tangent_grads(grad, d, a, weight, mean, rstd, sum_dx, sum_d, groups), None, None, None, None)


def _group_tangent_grads(grad, d, a, weight, mean, rstd, sum_dx, sum_d, groups):
    """``(dL/dd, dL/da, dL/dgamma)`` of ``L = sum_j <g_j, t_j>`` for :func:`group_norm_tangent`'s ``t``: the formulas
    of :func:`_bn_tangent_backward` per sample and group (``N`` there is the group's size ``M``), with
    ``G = gamma * g_j`` varying along the group's channels."""
    n, c, hw = _gn_dims(a, groups)
    m = (c // groups) * hw
    cview = lambda p: p.reshape(1, c, *([1] * (a.dim() - 2)))
    gview = lambda p: p.reshape(n, groups, 1)  # per-(sample, group) scalars against (N, G, M)
    r, mu = gview(rstd), gview(mean)
    ag = a.reshape(n, groups, -1)
    grad_d, grad_a = [], None
    grad_w = None if weight is None else torch.zeros_like(weight)
    for j in range(d.shape[0]):
        gj, dj = grad[j], d[j]
        grad_d.append(_gn_backward(gj, a, mean, rstd, weight, n, c, hw, groups, [True, False, False])[0])
        big = (gj if weight is None else gj * cview(weight)).reshape(n, groups, -1)
        dg = dj.reshape(n, groups, -1)
        # sums over each group; sum(G xhat) = r (sum(G a) - mu sum(G)): no xhat tensor (fewer fresh buffers)
        s_g, s_ga, s_gd = (big.sum(-1, keepdim=True), (big * ag).sum(-1, keepdim=True),
                           (big * dg).sum(-1, keepdim=True))
        s_gx = r * (s_ga - mu * s_g)
        dbar, cc = gview(sum_d[j]) / m, gview(sum_dx[j]) / m
        k = r * r / m
        kappa = -k * (s_gd - dbar * s_g - 3 * cc * s_gx)  # coefficient of xhat = r (a - mu)
        ga = (ag * (kappa * r)).add_(-kappa * r * mu + k * s_gx * dbar + r * r * cc * s_g / m)
        ga.addcmul_(-k * s_gx, dg).addcmul_(-r * r * cc, big)
        grad_a = ga if grad_a is None else grad_a.add_(ga)
        if weight is not None:  # sum over samples and positions of g * r P(d), per channel, from per-(n, c) sums
            g3, d3 = gj.reshape(n, c, -1), dj.reshape(n, c, -1)
            p_g, p_gd, p_ga = g3.sum(-1), (g3 * d3).sum(-1), (g3 * a.reshape(n, c, -1)).sum(-1)
            rc = lambda q: q.repeat_interleave(c // groups, dim=1)  # (N, G) -> (N, C)
            r_c, mu_c, dbar_c, cc_c = rc(rstd), rc(mean), rc(sum_d[j] / m), rc(sum_dx[j] / m)
            p_gx = r_c * (p_ga - mu_c * p_g)
            grad_w += (r_c * (p_gd - dbar_c * p_g - cc_c * p_gx)).sum(0).to(weight.dtype)
    return _stacked(grad_d), grad_a.reshape(a.shape).to(a.dtype), grad_w


_register_autograd(group_norm_tangent, _gn_tangent_backward, _keeping(2, sums=True))


_ln_backward = torch.ops.aten.native_layer_norm_backward.default


@_operator("layer_norm_tangent")
def layer_norm_tangent(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                       rstd: torch.Tensor, normalized_shape: List[int], eps: float) -> torch.Tensor:
    """LayerNorm's tangents ``t_j = gamma * r * (d_j - mean(d_j) - xhat * mean(d_j * xhat))`` (means over each row's
    trailing ``normalized_shape`` entries; ``mean``, ``rstd = r`` from ``native_layer_norm`` of the primal block
    ``a``): the LayerNorm backward kernel (no weight) applied to each ``d_j``, times ``gamma``. The product is
    part of the operator, so nothing but ``d`` and ``a`` is kept for backward (the plain step keeps the 2B input)."""
    ts = [_ln_backward(dj, a, normalized_shape, mean, rstd, None, None, [True, False, False])[0] for dj in d]
    return _stacked(ts if weight is None else [t.mul_(weight) for t in ts])


@layer_norm_tangent.register_fake
def _(d, a, weight, mean, rstd, normalized_shape, eps):
    return torch.empty_like(d)


def _ln_tangent_backward(ctx, grad):
    """Gradients of ``L = sum_j <g_j, t_j>`` w.r.t. ``d``, ``a`` and ``gamma``: per row of ``N`` entries, with
    ``P(v) = v - mean(v) - xhat mean(v xhat)`` (a symmetric projection), ``G = gamma g_j``, ``u_j = r P(d_j)`` (the
    tangent without ``gamma``) and ``h_j = r P(G)`` (the LayerNorm backward kernel of ``g_j``),

        dL/dd_j = h_j
        dL/da   = -r sum_j [mean(G u_j) xhat + mean(d_j xhat) h_j + mean(G xhat) u_j]
        dL/dgamma = sum over rows of g_j u_j

    (``L = r <G, P(d_j)>`` per row; ``r`` and ``xhat`` are the functions of ``a`` that carry its derivative: two
    LayerNorm backward kernels, three row dot products scaled in one ``(3, rows)`` product and three passes over
    the rows per tangent: 1.2x faster on this CPU than the form expanded in ``d``, ``g``, ``xhat`` with ~15 kernels
    fewer on a GPU). Under ``create_graph``: autograd of the tangent's primitive-op form with statistics recomputed
    from ``a`` (exact at every order; torch's double backward of ``native_layer_norm_backward`` holds the statistics
    fixed in its own derivative)."""
    if grad is None:
        return None, None, None, None, None, None, None
    d, a, weight, mean, rstd = ctx.saved_tensors
    shape, eps = ctx.setting
    if torch.is_grad_enabled():
        inputs = [(i, x) for i, x in enumerate((d, a, weight)) if x is not None and x.requires_grad]
        grads = torch.autograd.grad(layer_norm_tangent_composite(d, a, weight, len(shape), eps),
                                    [x for _, x in inputs], grad, create_graph=True, allow_unused=True)
        out = [None] * 7
        for (i, _), g in zip(inputs, grads):
            out[i] = g
        return tuple(out)
    rows = mean.numel()
    n = a.numel() // rows if rows else 0
    need_a, need_w = ctx.needs_input_grad[1], weight is not None and ctx.needs_input_grad[2]
    if need_a:  # xhat, and -r / N for the row means
        xhat = (a.reshape(rows, n) - mean.reshape(rows, 1)).mul_(rstd.reshape(rows, 1))
        dot, q = torch.linalg.vecdot, rstd.reshape(rows) * (-1.0 / n)
    grad_d, grad_a, grad_w = [], None, None
    for j in range(d.shape[0]):
        h = _ln_backward(grad[j], a, shape, mean, rstd, weight, None, [True, False, False])[0]
        grad_d.append(h)
        if not (need_a or need_w):
            continue
        u = _ln_backward(d[j], a, shape, mean, rstd, None, None, [True, False, False])[0].reshape(rows, n)
        gj = grad[j].reshape(rows, n)
        if need_w:
            gw = (gj * u).sum(0)
            grad_w = gw if grad_w is None else grad_w.add_(gw)
        if need_a:
            big = gj if weight is None else gj * weight.reshape(1, n)
            # -r times the three row means, as one (3, rows) product
            coefs = torch.stack([dot(big, u), dot(d[j].reshape(rows, n), xhat), dot(big, xhat)]).mul_(q)
            ga = xhat * coefs[0].unsqueeze(-1)
            ga.addcmul_(h.reshape(rows, n), coefs[1].unsqueeze(-1)).addcmul_(u, coefs[2].unsqueeze(-1))
            grad_a = ga if grad_a is None else grad_a.add_(ga)
    grad_a = None if grad_a is None else grad_a.reshape(a.shape)
    grad_w = None if grad_w is None else grad_w.reshape(weight.shape).to(weight.dtype)
    return _stacked(grad_d), grad_a, grad_w, None, None, None, None


def layer_norm_tangent_composite(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], dims: int,
                                 eps: float) -> torch.Tensor:
    """:func:`layer_norm_tangent`'s ``t`` from differentiable primitive ops over the trailing ``dims`` dims."""
    red = tuple(range(-dims, 0))
    var, mu = torch.var_mean(a, dim=red, correction=0, keepdim=True)
    r = torch.rsqrt(var + eps)
    xhat = (a - mu) * r
    t = r * (d - d.mean(red, keepdim=True) - xhat * (d * xhat).mean(red, keepdim=True))
    return t if weight is None else t * weight


_register_autograd(layer_norm_tangent, _ln_tangent_backward, _keeping(2, sums=False))


def attention_probs(q: torch.Tensor, k: torch.Tensor, m: Optional[torch.Tensor], sc: float,
                    causal: bool, scale_scores: bool = False) -> torch.Tensor:
    """``P = softmax(q k^T sc + mask)`` of the primal block (a bool mask or ``causal`` masks with ``-inf``; a row
    whose keys are all masked is 0, as in torch's SDPA).
    The smaller of ``q`` and the scores is scaled, or the scores with ``scale_scores`` (under autograd, where another
    product keeps ``q`` for backward anyway: ``q sc`` would be one more ``L x E`` tensor kept)."""
    L, S = q.shape[-2], k.shape[-2]
    if S > q.shape[-1] and not scale_scores:
        s = (q * sc) @ k.transpose(-2, -1)
    else:
        s = (q @ k.transpose(-2, -1)) * sc
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=0), float("-inf"))
    if m is None:
        return torch.softmax(s, dim=-1)
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    return torch.ops.aten._safe_softmax(s, -1)  # as torch's SDPA: 0, not NaN, on a row whose keys are all masked


def linearised_attention(p: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         blocks: Optional[torch.Tensor], dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                         dm: Optional[torch.Tensor], dropout_p: float, sc: float, kk: int) -> torch.Tensor:
    """The ``(K, ..., L, Ev)`` blocks of SDPA linearised at the primal: ``[(P M) v; (P M) z_j + (dP_j M) v]`` with
    ``P`` from :func:`attention_probs`, ``dS_j = (dq_j k^T + q dk_j^T) sc + dm_j``, ``dP_j = P (dS_j - sum(P dS_j))``,
    ``M`` one dropout mask for all blocks. ``q, k, v``: primal blocks; ``blocks``: every value block (``z_j``) when
    the value carries tangents, else ``None``; ``dq, dk, dm``: ``(K-1, ...)`` differences or ``None``."""

    keep = torch.empty_like(p).bernoulli_(1 - dropout_p) / (1 - dropout_p) if dropout_p > 0 else None
    pd = p if keep is None else p * keep
    ds = None
    if dq is not None and dk is not None and k.shape[-2] > 2 * q.shape[-1]:
        # long keys: the scale on the L x E side and one product for both terms, no L x S pass but the product's
        # (0.8x the step of a ViT with 257 tokens; with few keys the two concatenations cost more than they save)
        left = torch.cat([dq, q.expand_as(dq)], -1) * sc
        ds = left @ torch.cat([k.expand_as(dk), dk], -1).transpose(-2, -1)
    else:
        if dq is not None:
            ds = dq @ k.transpose(-2, -1)
        if dk is not None:
            qdk = q @ dk.transpose(-2, -1)
            ds = qdk if ds is None else ds + qdk
        if ds is not None:
            ds = ds * sc
    if dm is not None:
        ds = dm if ds is None else ds + dm
    dpv = None
    if ds is not None:  # dP = P * (dS - sum(P * dS)): softmax's backward kernel (its Jacobian is symmetric); dS in
        # P's dtype (CUDA's autocast runs softmax in float32 and the kernel takes one dtype)
        dp = each_block(lambda b: torch.ops.aten._softmax_backward_data(b.expand_as(p).to(p.dtype), p, -1, p.dtype),
                        ds)
        dpv = (dp if keep is None else dp * keep) @ v
    if blocks is not None:  # [(P M) v; (P M) z_j]: one product per value block (one product of P with all of
        first, *rest = (pd @ z for z in blocks.unbind(0))  # them would keep a copy of P per block for backward)
        rest = _stacked(rest) if dpv is None else _stacked(rest) + dpv
        return stack_blocks(first, rest)
    out_a = pd @ v
    return tile(out_a, kk) if dpv is None else stack_blocks(out_a, out_a + dpv)


# Entries of one block's P from which the rule runs the recomputing operator: 0, every attention under autograd, so
# that the rule keeps what fused attention keeps (its inputs), not three L x S tensors. Measured on this CPU (regularized
# training step of a 4-layer ViT, dim 64, captured engine, interleaved medians): 257 tokens at batch 8, 0.89x the step
# time of the composite, which keeps P, dS, dP (an earlier engine had it 1.3x); 65 tokens at batch 32, 1.00x; 17 tokens
# at batch 32 (P small beside the L x E activations), 1.09x, with 1.99x the plain step's saved-for-backward bytes
# instead of 2.22x (the plain step on the doubled batch: 2.00x). Raise it (``float("inf")``: never) to trade that
# memory for the 9% where sequences are short.
ATTENTION_RECOMPUTE_NUMEL = 0
# The same in programs for ``engine="compiled"``, where Inductor fuses the composite (and its partitioner chooses what
# to keep): 2^24 (64 MiB of float32 per L x S tensor). The 17-token ViT's compiled step took 1.08x the time with the
# operator at every size; the 257-token ViT's at batch 8 (2^21 entries of P) 1.2x (220-227 against 180-185 ms, `bench
# train`, two fresh processes each) for a live-tensor peak of 139 MiB instead of 225 MiB (lower it to trade the time).
COMPILED_ATTENTION_RECOMPUTE_NUMEL = 1 << 24


def attention_recomputed(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the rule runs :func:`attention_blocks`: where :func:`applies` on the clone ``x``, for floating-point
    scores ``P`` of :data:`ATTENTION_RECOMPUTE_NUMEL` entries or more (by default every one: no ``L x S`` tensor kept
    for backward; :data:`COMPILED_ATTENTION_RECOMPUTE_NUMEL` in a program to be compiled)."""

    if not q.is_floating_point():
        return False
    n = q.shape[-2] * k.shape[-2]
    for a, b in itertools.zip_longest(reversed(q.shape[:-2]), reversed(k.shape[:-2]), fillvalue=1):
        n *= max(a, b)  # the broadcast batch dims (torch.broadcast_shapes takes ~0.2 ms a call)
    return n >= (COMPILED_ATTENTION_RECOMPUTE_NUMEL if compiling() else ATTENTION_RECOMPUTE_NUMEL) and applies(x)


@_operator("attention_blocks")
def attention_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Optional[torch.Tensor],
                     dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], mask: Optional[torch.Tensor], scale: float,
                     causal: bool, kk: int) -> torch.Tensor:
    """:func:`linearised_attention` of :func:`attention_probs` without dropout, as one operator that keeps only its
    inputs for backward."""
    return _attention(q, k, v, blocks, dq, dk, mask, scale, causal, kk)


def _attention(q, k, v, blocks, dq, dk, mask, scale, causal, kk):
    q, k = q.contiguous(), k.contiguous()  # once, not in each product (the rule's copies already are)
    p = attention_probs(q, k, mask, scale, causal)
    return linearised_attention(p, q, k, v, blocks, dq, dk, None, 0.0, scale, kk)


attention_blocks.register_fake(_attention)

_ATTENTION_TENSORS = 7  # q, k, v, blocks, dq, dk, mask; then scale, causal, kk


def _keep_attention_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_ATTENTION_TENSORS])
    ctx.setting = inputs[_ATTENTION_TENSORS:]


# Entries of one block's P that the recomputing operator's backward differentiates at once on the CPU: above it the
# backward runs over chunks of the leading batch dim, so that the L x S tensors it recomputes (P, dS, dP for every
# block, and their gradients) live for one chunk at a time. Measured on this CPU (regularized step of a 4-layer ViT
# with 257 tokens at batch 8, 1 thread): live-tensor peak 146 -> 84 MiB (plain step on the doubled batch: 54 MiB), RSS
# peak 266 -> 168 MiB; step time 232-263 ms against 315-348 ms (`bench train --methods plain_2b,clone`, fresh
# processes; plain 2B 119-125 ms): smaller temporaries. ``float("inf")``: the whole batch at once.
ATTENTION_BACKWARD_CHUNK_NUMEL = 1 << 20
# The same on accelerators, where each chunk launches the backward's kernels again (~40): 2^24 (64 MiB of float32
# per L x S tensor; a ViT-B/16 at batch 32 runs in one chunk, at batch 128 in four).
ACCELERATOR_ATTENTION_BACKWARD_CHUNK_NUMEL = 1 << 24
_BLOCKED = (3, 4, 5)  # blocks, dq, dk: (K or K-1, *batch, L, E); q, k, v, mask: (*batch, L, E)


def _attention_batch_chunks(saved: list, grad: torch.Tensor) -> list:
    """``(start, length)`` chunks of the leading batch dim of the output (``grad``: ``(K, *batch, L, Ev)``) for
    :data:`ATTENTION_BACKWARD_CHUNK_NUMEL` (CPU) or :data:`ACCELERATOR_ATTENTION_BACKWARD_CHUNK_NUMEL`;
    ``[(0, None)]``, the whole batch, where it fits or there is no batch dim."""
    batch = grad.shape[1:-2]
    if not batch:
        return [(0, None)]
    per_row = saved[0].shape[-2] * saved[1].shape[-2]  # L x S
    for d in batch[1:]:
        per_row *= d
    budget = ATTENTION_BACKWARD_CHUNK_NUMEL if on_host(grad) else ACCELERATOR_ATTENTION_BACKWARD_CHUNK_NUMEL
    if per_row * batch[0] <= budget:
        return [(0, None)]
    rows = max(1, int(budget // per_row))
    return [(lo, min(rows, batch[0] - lo)) for lo in range(0, batch[0], rows)]


def _batch_dim(i: int) -> int:
    return 1 if i in _BLOCKED else 0


def _chunk(t: Optional[torch.Tensor], i: int, lo: int, n: Optional[int]) -> Optional[torch.Tensor]:
    """Rows ``lo:lo+n`` of input ``i`` along its batch dim; the whole of it where it broadcasts there (size 1)."""
    if t is None or n is None or t.shape[_batch_dim(i)] == 1:
        return t
    return t.narrow(_batch_dim(i), lo, n)


def _softmax_grad(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``P * (x - sum(P * x))`` over the last dim: softmax's backward kernel (its Jacobian is symmetric)."""
    return torch.ops.aten._softmax_backward_data(x.expand_as(p).to(p.dtype), p, -1, p.dtype)


def _block_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the leading block dim; the block itself (a view, no kernel) for the usual single tangent."""
    return x[0] if x.shape[0] == 1 else x.sum(0)


def _attention_grads(q, k, v, blocks, dq, dk, mask, sc, causal, kk, g, wanted):
    """First-order gradients of ``L = sum_j <g_j, out_j>`` for :func:`_attention`'s inputs numbered in ``wanted``,
    written out (no graph): 39 kernels for a ViT's self-attention with a transposed output gradient where autograd of
    the recomputed attention launched 50, and 0.88x the time of a small ViT's regularized step on this CPU.
    With ``out_0 = P z_0``, ``out_j = P z_j + dP_j v`` (``z_j`` the value blocks, or ``v``), ``dP_j = P (dS_j -
    c_j)``, ``c_j = rowsum(P dS_j)``, ``H_j = g_j v^T``, ``r_j = rowsum(P H_j)``:

        dL/dz_j = P^T g_j,   dL/dv = sum_j dP_j^T g_j,   dL/d(dS_j) = T_j = P (H_j - r_j)
        dL/dP = sum_j g_j z_j^T + sum_j (H_j dS_j - c_j H_j - r_j dS_j),   dL/dS = P (dL/dP - rowsum(P dL/dP))
        dL/dq = sc (dL/dS k + sum_j T_j dk_j),   dL/dk = sc (dL/dS^T q + sum_j T_j^T dq_j)
        dL/d(dq_j) = sc T_j k,   dL/d(dk_j) = sc T_j^T q,   dL/dmask = dL/dS (an additive mask)

    each summed to its input's shape where it broadcasts."""

    qc, kc = q.contiguous(), k.contiguous()
    p = attention_probs(qc, kc, mask, sc, causal)
    ds = None  # (K-1, ..., L, S)
    if dq is not None:
        ds = dq @ kc.mT
    if dk is not None:
        ds = qc @ dk.mT if ds is None else ds.add_(qc @ dk.mT)
    if ds is not None:
        ds = ds.mul_(sc).expand(ds.shape[0], *p.shape).to(p.dtype)
    g = g.contiguous()  # once (the output's gradient arrives transposed), not a copy in each product
    rest = g[1:]
    grads = {}
    if blocks is not None:  # dL/dz_j = P^T g_j; dL/dP = sum_j g_j z_j^T
        if 3 in wanted:
            grads[3] = torch.stack([p.mT @ gj for gj in g.unbind(0)])
        dlp = g[0] @ blocks[0].mT
        for gj, zj in zip(rest.unbind(0), blocks[1:].unbind(0)):
            dlp = dlp.baddbmm_(gj, zj.mT) if dlp.dim() == 3 else dlp.add_(gj @ zj.mT)
    else:
        total = g.sum(0)
        dlp = total @ v.mT
        if 2 in wanted:
            grads[2] = p.mT @ total
    t = None
    if ds is not None:
        h = rest @ v.mT  # H_j = g_j v^T
        if 2 in wanted:
            dv = _block_sum(each_block(lambda dsj: _softmax_grad(dsj, p), ds).mT @ rest)
            grads[2] = dv if 2 not in grads else grads[2].add_(dv)
        t = each_block(lambda hj: _softmax_grad(hj, p), h)
        c = (p * ds).sum(-1, keepdim=True)
        r = (p * h).sum(-1, keepdim=True)
        x = (h * ds).addcmul_(c, h, value=-1).addcmul_(r, ds, value=-1)
        dlp = dlp.add_(_block_sum(x))
    dls = _softmax_grad(dlp, p)
    if 0 in wanted:
        gq = dls @ kc
        if t is not None and dk is not None:
            gq = gq.add_(_block_sum(t @ dk))
        grads[0] = gq.mul_(sc)
    if 1 in wanted:
        gk = dls.mT @ qc
        if t is not None and dq is not None:
            gk = gk.add_(_block_sum(t.mT @ dq))
        grads[1] = gk.mul_(sc)
    if 4 in wanted:
        grads[4] = (t @ kc).mul_(sc)
    if 5 in wanted:
        grads[5] = (t.mT @ qc).mul_(sc)
    if 6 in wanted:
        grads[6] = dls
    ins = (q, k, v, blocks, dq, dk, mask)
    return [grads[i].sum_to_size(ins[i].shape).to(ins[i].dtype) if i in grads else None for i in wanted]


def _attention_backward(ctx, grad):
    """The gradients from ``P``, ``dS``, ``dP`` recomputed from the saved inputs (:func:`_attention_grads`; under
    ``create_graph``: autograd of the recomputed attention through views of the saved inputs, so higher orders work
    as without the operator), chunk by chunk of the batch (:data:`ATTENTION_BACKWARD_CHUNK_NUMEL`): a sliced
    input's gradient is the concatenation of its chunks', a broadcast one's their sum."""
    saved = list(ctx.saved_tensors)
    wanted = [i for i, t in enumerate(saved) if t is not None and ctx.needs_input_grad[i]]
    out = [None] * (_ATTENTION_TENSORS + 3)
    if not wanted:
        return tuple(out)
    create = torch.is_grad_enabled()
    chunks = _attention_batch_chunks(saved, grad)
    parts = {i: [] for i in wanted}
    for lo, n in chunks:
        g = grad if n is None else grad.narrow(1, lo, n)
        if not create:  # first order: the gradients written out
            ins = [_chunk(t, i, lo, n) for i, t in enumerate(saved)]
            grads = _attention_grads(*ins, *ctx.setting, g, wanted)
        else:
            with torch.enable_grad():
                # each input a node of its own: a view of it (the inputs can descend from one another: v from the
                # value blocks, k from a value that is also the key)
                ins = [_chunk(t if t is None else t.view_as(t), i, lo, n) for i, t in enumerate(saved)]
                y = _attention(*ins, *ctx.setting)
                grads = torch.autograd.grad(y, [ins[i] for i in wanted], g, create_graph=True, allow_unused=True)
        for i, gi, t in zip(wanted, grads, (ins[i] for i in wanted)):
            parts[i].append(torch.zeros_like(t) if gi is None and len(chunks) > 1 else gi)
    for i in wanted:
        if len(chunks) == 1:
            out[i] = parts[i][0]
        elif saved[i].shape[_batch_dim(i)] == 1:
            out[i] = torch.stack(parts[i]).sum(0)
        else:
            out[i] = torch.cat(parts[i], _batch_dim(i))
    return tuple(out)


_register_autograd(attention_blocks, _attention_backward, _keep_attention_inputs)
