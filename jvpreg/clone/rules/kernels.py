"""Operators the rules call where autograd would save more for a composite than the op it replaces.

``jvpreg::relu_blocks(z) -> (out, keep)``: relu's clone rule on the physical ``(K, *L)`` blocks,
``out_j = 1[a > 0] * z_j`` with ``a = z_0`` (``keep = not (a <= 0)``, relu's own pass condition, NaN included).
Written with ``threshold_backward(z, a, 0)`` alone, autograd would keep ``a`` (a view that pins the whole
``(K, *L)`` input) or a float copy of it: one more activation per relu than the plain forward saves. This
op keeps ``keep`` as a bool block instead (a quarter of the bytes) and its backward is
``dz_j = keep * dout_j``. Registered with ``torch.library`` so a captured program records it as one node
(:mod:`jvpreg.clone.program.capture`) and its backward is replayed by autograd like any aten op's.

Train-mode BatchNorm's operators (``jvpreg::batch_norm_tangent``, ``batch_norm_blocks``, ``batch_norm_relu_blocks``)
sit with its rule, in :mod:`jvpreg.clone.rules.batch_norm`; they are made with :func:`custom_operator` and
:func:`register_autograd` like the ones here.

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
from jvpreg.clone.core.tensor import CloneTensor, compiling
from jvpreg.clone.rules.blocks import assemble, each_block, stacked

__all__ = ["DIRECT", "applies", "attention_blocks", "attention_probs", "attention_recomputed", "custom_operator",
           "fake_tangent_and_sums", "group_norm_tangent", "inside_transform", "keeping_inputs", "layer_norm_tangent",
           "linearised_attention", "masked_by", "register_autograd", "relu_blocks"]

_threshold_backward = torch.ops.aten.threshold_backward.default


# The operators' own Python functions, and the same forward, setup and backward as a plain ``autograd.Function``:
# :mod:`jvpreg.clone.program.replay` calls that one, skipping the custom-operator machinery (Python dispatch, schema
# checks), whose cost per call grows with the operator's inputs (experiments/results/rules_measurements.md).
_IMPLS: Dict[Any, Tuple[str, Callable]] = {}
DIRECT: Dict[torch._ops.OpOverload, Callable] = {}


def custom_operator(name: str) -> Callable:
    """``torch.library.custom_op("jvpreg::<name>")`` of the decorated function, which is kept for :data:`DIRECT`."""
    def wrap(fn):
        op = torch.library.custom_op(f"jvpreg::{name}", mutates_args=())(fn)
        _IMPLS[op] = (name, fn)
        return op
    return wrap


def register_autograd(op: Any, backward: Callable, setup_context: Callable) -> None:
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
    code stores a bool mask much slower than ATen on an AVX-512 CPU, and a compiled ResNet-18 training step was
    faster with the operators than with Inductor's fusion of the decomposed rules
    (experiments/results/rules_measurements.md). On other devices a compiled program leaves the decomposed rules to
    Inductor's fusion (not measured: no GPU)."""

    return (torch.is_grad_enabled() and t.requires_grad and type(t) in (torch.Tensor, CloneTensor)
            and not inside_transform() and (on_host(t) or not compiling()))


@custom_operator("relu_blocks")
def relu_blocks(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(1[a > 0] * z_j for all j, not (a <= 0))`` with ``a = z[0]``."""
    a = z[0]
    out = _threshold_backward(z, a.expand_as(z), 0)
    # relu(a) with NaN kept is nonzero exactly where not (a <= 0): a cast to bool (vectorised; comparisons that
    # make bools run slower on the CPU)
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
    return masked_by(grad, keep)


def masked_by(grad: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``keep * grad`` by relu's backward kernel (0 where not kept, whatever ``grad`` holds there). The bool pattern
    is cast through a uint8 view (faster on the CPU than a cast of the bools), except where a compiled backward is
    traced (on fake tensors: Inductor fuses the cast, and torch 2.11's cannot lower a bool -> uint8 view)."""
    traced = torch._subclasses.fake_tensor.is_fake(grad)
    keep = keep.to(grad.dtype) if traced else keep.view(torch.uint8).to(grad.dtype)
    return _threshold_backward(grad, keep.expand_as(grad), 0)


register_autograd(relu_blocks, _backward, _setup)


def fake_tangent_and_sums(d, a, weight, mean, rstd, _setting):
    """Shapes of a normalisation tangent operator's outputs: the tangents, and two sums per statistic."""
    sums = d.new_empty((d.shape[0], *mean.shape), dtype=mean.dtype)
    return torch.empty_like(d), sums, torch.empty_like(sums)


def keeping_inputs(settings: int, sums: bool) -> Callable:
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


_gn_backward = torch.ops.aten.native_group_norm_backward.default


def _gn_dims(a: torch.Tensor, groups: int):
    n, c = a.shape[0], a.shape[1]
    return n, c, a.numel() // (n * c) if n * c else 0


@custom_operator("group_norm_tangent")
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
    return stacked(ts), stacked(sdx), stacked(sd)


@group_norm_tangent.register_fake
def _(d, a, weight, mean, rstd, groups, eps):
    return fake_tangent_and_sums(d, a, weight, mean, rstd, groups)


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
    return stacked(grad_d), grad_a.reshape(a.shape).to(a.dtype), grad_w


register_autograd(group_norm_tangent, _gn_tangent_backward, keeping_inputs(2, sums=True))


_ln_backward = torch.ops.aten.native_layer_norm_backward.default


@custom_operator("layer_norm_tangent")
def layer_norm_tangent(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                       rstd: torch.Tensor, normalized_shape: List[int], eps: float) -> torch.Tensor:
    """LayerNorm's tangents ``t_j = gamma * r * (d_j - mean(d_j) - xhat * mean(d_j * xhat))`` (means over each row's
    trailing ``normalized_shape`` entries; ``mean``, ``rstd = r`` from ``native_layer_norm`` of the primal block
    ``a``): the LayerNorm backward kernel (no weight) applied to each ``d_j``, times ``gamma``. The product is
    part of the operator, so nothing but ``d`` and ``a`` is kept for backward (the plain step keeps the 2B input)."""
    ts = [_ln_backward(dj, a, normalized_shape, mean, rstd, None, None, [True, False, False])[0] for dj in d]
    return stacked(ts if weight is None else [t.mul_(weight) for t in ts])


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
    the rows per tangent: faster than the form expanded in ``d``, ``g``, ``xhat``, and fewer kernels on a GPU). Under
    ``create_graph``: autograd of the tangent's primitive-op form with statistics recomputed from ``a`` (exact at
    every order; torch's double backward of ``native_layer_norm_backward`` holds the statistics fixed in its own
    derivative)."""
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
    return stacked(grad_d), grad_a, grad_w, None, None, None, None


def layer_norm_tangent_composite(d: torch.Tensor, a: torch.Tensor, weight: Optional[torch.Tensor], dims: int,
                                 eps: float) -> torch.Tensor:
    """:func:`layer_norm_tangent`'s ``t`` from differentiable primitive ops over the trailing ``dims`` dims."""
    red = tuple(range(-dims, 0))
    var, mu = torch.var_mean(a, dim=red, correction=0, keepdim=True)
    r = torch.rsqrt(var + eps)
    xhat = (a - mu) * r
    t = r * (d - d.mean(red, keepdim=True) - xhat * (d * xhat).mean(red, keepdim=True))
    return t if weight is None else t * weight


register_autograd(layer_norm_tangent, _ln_tangent_backward, keeping_inputs(2, sums=False))


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
        # (with few keys the two concatenations cost more than they save)
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
        rest = stacked(rest) if dpv is None else stacked(rest) + dpv
        return assemble(first, blocks=rest)
    out_a = pd @ v
    return assemble(out_a, k=kk) if dpv is None else assemble(out_a, dpv)


# Entries of one block's P from which the rule runs the recomputing operator: 0, every attention under autograd, so
# that the rule keeps what fused attention keeps (its inputs), not three L x S tensors: faster where P is large, about
# as fast at moderate lengths, a little slower where sequences are short and P is small beside the L x E activations
# (experiments/results/bench_train_cpu_attention_recomputed.md, rules_measurements.md). Raise it
# (``float("inf")``: never) to trade that memory for the time where sequences are short.
ATTENTION_RECOMPUTE_NUMEL = 0
# The same in programs for ``engine="compiled"``, where Inductor fuses the composite (and its partitioner chooses what
# to keep): 2^24. There the operator costs time at every size, for a lower
# live-tensor peak (experiments/results/rules_measurements.md): lower it to trade the time for that memory.
COMPILED_ATTENTION_RECOMPUTE_NUMEL = 1 << 24


def attention_recomputed(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the rule runs :func:`attention_blocks`: where :func:`applies` on the clone ``x``, for floating-point
    scores ``P`` of :data:`ATTENTION_RECOMPUTE_NUMEL` entries or more (by default every one: no ``L x S`` tensor kept
    for backward; :data:`COMPILED_ATTENTION_RECOMPUTE_NUMEL` in a program to be compiled)."""

    if not q.is_floating_point():
        return False
    n = q.shape[-2] * k.shape[-2]
    for a, b in itertools.zip_longest(reversed(q.shape[:-2]), reversed(k.shape[:-2]), fillvalue=1):
        n *= max(a, b)  # the broadcast batch dims (torch.broadcast_shapes is slow for a check per call)
    return n >= (COMPILED_ATTENTION_RECOMPUTE_NUMEL if compiling() else ATTENTION_RECOMPUTE_NUMEL) and applies(x)


@custom_operator("attention_blocks")
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
# block, and their gradients) live for one chunk at a time: a lower live-tensor peak, and smaller temporaries make the
# step faster too (experiments/results/bench_train_cpu_attention_chunked.md). ``float("inf")``: the whole batch at
# once.
ATTENTION_BACKWARD_CHUNK_NUMEL = 1 << 20
# The same on accelerators, where each chunk launches the backward's kernels again: 2^24 (a ViT-B/16 at batch 32 runs
# in one chunk, at batch 128 in four).
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
    written out (no graph): fewer kernels than autograd of the recomputed attention launches, and a faster step
    (experiments/results/bench_train_cpu_attention_written_out.md).
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


register_autograd(attention_blocks, _attention_backward, _keep_attention_inputs)
