"""Ops linearised through a composition of ops that have rules (losses, logsumexp, norms, sort/topk).

:func:`jvpreg.clone.rules.kinds.composite`: the primal block is ``op`` itself on the primal blocks (bit-identical to
a plain call), the tangent blocks are those of ``body`` run on the clone batch, where every op goes through its own
rule: ``out_j = op(a) + (body(z)_j - body(z)_0)``. ``body`` only has to be a correct formula of ``op``; its
exactness comes from the rules it uses. Conventions where the formula is not smooth follow torch's forward
AD: vector 2-norm at 0 has tangent 0; sort/topk values are gathered at the primal's indices (ties: the
kernel's order); losses' reductions are ``none`` / ``mean`` / ``sum`` (0, 1, 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.tensor import wrap
from jvpreg.clone.rules.blocks import assemble, count, primal
from jvpreg.clone.rules.kinds import composite, linear

T = torch.Tensor


def _reduce(loss, reduction):
    return {0: lambda l: l, 1: torch.mean, 2: torch.sum}[reduction](loss)


@composite(torch.logsumexp, T.logsumexp)
def logsumexp(input, dim, keepdim=False):
    """logsumexp(x) = m + log(sum(exp(x - m))), m = max of the primal (a constant)."""
    m = input.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out = (input - m).exp().sum(dim, keepdim=True).log() + m
    return out if keepdim else out.sum(dim)  # summing the size-1 dims squeezes them


@composite(torch._C._nn.mse_loss)
def mse_loss(input, target, reduction=1):
    """mse = reduce((x - y)^2)."""
    return _reduce((input - target).square(), reduction)


@composite(torch._C._nn.l1_loss)
def l1_loss(input, target, reduction=1):
    """l1 = reduce(|x - y|) (slope 0 at x = y)."""
    return _reduce((input - target).abs(), reduction)


@composite(torch._C._nn.smooth_l1_loss)
def smooth_l1_loss(input, target, reduction=1, beta=1.0):
    """smooth_l1 = reduce(0.5 d^2 / beta where |d| < beta, else |d| - beta / 2)."""
    d = input - target
    if beta == 0:
        return _reduce(d.abs(), reduction)
    return _reduce(torch.where(d.abs() < beta, 0.5 * d.square() / beta, d.abs() - 0.5 * beta), reduction)


@composite(torch._C._nn.huber_loss)
def huber_loss(input, target, reduction=1, delta=1.0):
    """huber = reduce(0.5 d^2 where |d| < delta, else delta (|d| - delta / 2))."""
    d = input - target
    return _reduce(torch.where(d.abs() < delta, 0.5 * d.square(), delta * (d.abs() - 0.5 * delta)), reduction)


@composite(torch.binary_cross_entropy_with_logits)
def binary_cross_entropy_with_logits(input, target, weight=None, pos_weight=None, reduction=1):
    """bce_logits = reduce(w ((1 - t) x + (1 + (pw - 1) t) softplus(-x)))."""
    lw = 1 if pos_weight is None else (pos_weight - 1) * target + 1
    sp = -F.logsigmoid(input)  # softplus(-x), derivative -sigmoid(-x) exactly
    loss = (1 - target) * input + lw * sp
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@composite(torch._C._nn.cross_entropy_loss)
def cross_entropy(input, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """cross_entropy = nll_loss(log_softmax(x, 1)) for class indices (no label smoothing); else the fallback."""
    if label_smoothing != 0.0 or (torch.is_tensor(target) and target.is_floating_point()):
        return NotImplemented
    dim = 1 if input.dim() >= 2 else 0
    return torch._C._nn.nll_loss_nd(torch.log_softmax(input, dim), target, weight, reduction, ignore_index)


if hasattr(F, "linear_cross_entropy"):  # torch >= 2.15
    @composite(F.linear_cross_entropy)
    def linear_cross_entropy(input, linear_weight, target, linear_bias=None, weight=None, reduction="mean",
                             ignore_index=None, label_smoothing=0.0, options=None):
        """``cross_entropy(linear(x))``: the fused operator takes its gradient flags from ``requires_grad`` at the
        call (a clone input's is False where a JVP still needs the derivative), so it is linearised by its
        definition; the primal is the fused call."""
        classes, *out_features, in_features = linear_weight.shape  # torch's reference implementation
        logits = F.linear(input, linear_weight.reshape(-1, in_features),
                          None if linear_bias is None else linear_bias.reshape(-1))
        logits = logits.reshape(*input.shape[:-1], classes, *out_features)
        return F.cross_entropy(logits, target, weight=weight, reduction=reduction,
                               ignore_index=-100 if ignore_index is None else ignore_index,
                               label_smoothing=label_smoothing)


def _frozen(x):
    """The primal block of clone ``x`` in every block: a constant (zero tangent) that keeps its gradient, for the
    weights ``w(a)`` of a linearisation ``sum(w(a) d)``: ``detach`` would drop ``dw/da`` from the gradient of a
    penalty on the tangent."""
    with DisableTorchFunctionSubclass():
        return wrap(assemble(primal(x), k=count(x)), state=True)


@composite(torch._C._linalg.linalg_vector_norm, aliases={"ord": "ord"})
def vector_norm(input, ord=2, dim=None, keepdim=False, *, dtype=None):
    """d||x||_p = sum(w d), ``w = sign(x) |x|^(p-1) / ||x||^(p-1)`` for ``p >= 1`` (``x / ||x||`` for 2), the
    mean of ``sign(x)`` over the entries that attain the max (min) for ``p = inf`` (``-inf``); 0 at ``x = 0``
    (torch's convention). Orders below 1 and complex inputs: the fallback."""
    if input.is_complex() or dtype is not None or not (ord >= 1 or ord == float("-inf")):
        return NotImplemented
    a = _frozen(input)
    n = torch.linalg.vector_norm(a, ord, dim, keepdim=True)
    if ord in (float("inf"), float("-inf")):
        hit = (a.abs() == n).to(a.dtype)
        w = a.sign() * hit / hit.sum(dim, keepdim=True)
    else:
        safe = torch.where(n > 0, n, torch.ones_like(n))
        w = a / safe if ord == 2 else a.sign() * (a.abs() / safe).pow(ord - 1)
    return (input * w).sum(dim, keepdim=keepdim)


@composite(T.norm, own_primal=False)
def tensor_norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    """``Tensor.norm`` is ``torch.norm`` (a Python function whose body runs through the rules)."""
    return torch.norm(input, p, dim, keepdim, dtype=dtype)


def _variance(input, dim, unbiased, keepdim, correction):
    """``sum((x - mean x)^2) / max(0, N - correction)`` over ``dim`` for every overload of torch's variance:
    ``(x, unbiased)``, ``(x, dim, unbiased, keepdim)``, ``(x, dim, *, correction, keepdim)``."""
    if isinstance(dim, bool):  # var(x, unbiased)
        dim, unbiased = None, dim
    corr = correction if correction is not None else (0 if unbiased is False else 1)
    dims = tuple(range(input.dim())) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else \
        ((dim,) if isinstance(dim, int) else tuple(dim))
    n = 1
    for d in dims:
        n *= input.shape[d] if input.dim() else 1
    centred = input - input.mean(dims, keepdim=True) if input.dim() else input - input
    return (centred * centred).sum(dims if input.dim() else (), keepdim=keepdim) / max(0, n - corr)


def _mean(input, dim, keepdim):
    if isinstance(dim, bool) or dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return input.mean(tuple(range(input.dim())), keepdim=keepdim) if input.dim() else input * 1
    return input.mean(dim, keepdim=keepdim)


@composite(torch.var, T.var)
def var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """var(x) = sum((x - mean x)^2) / max(0, N - correction): d var = 2 sum((x - mean x) d) / (N - correction)."""
    return _variance(input, dim, unbiased, keepdim, correction)


@composite(torch.std, T.std)
def std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """std(x) = sqrt(var(x)): d std = d var / (2 std)."""
    return torch.sqrt(_variance(input, dim, unbiased, keepdim, correction))


@composite(torch.var_mean)
def var_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """(var(x), mean(x)), each linearised as alone."""
    return _variance(input, dim, unbiased, keepdim, correction), _mean(input, dim, keepdim)


@composite(torch.std_mean)
def std_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """(std(x), mean(x)), each linearised as alone."""
    return torch.sqrt(_variance(input, dim, unbiased, keepdim, correction)), _mean(input, dim, keepdim)


@composite(torch.rms_norm, F.rms_norm)
def rms_norm(input, normalized_shape, weight=None, eps=None):
    """rms_norm(x) = x / sqrt(mean(x^2) + eps) * w over the last ``len(normalized_shape)`` dims (``eps=None``:
    the dtype's machine epsilon, as torch)."""
    dims = tuple(range(-len(normalized_shape), 0))
    e = torch.finfo(input.dtype).eps if eps is None else eps
    y = input * torch.rsqrt((input * input).mean(dims, keepdim=True) + e)
    return y if weight is None else y * weight


@composite(torch._C._nn.glu)
def glu(input, dim=-1):
    """glu(x) = a * sigmoid(b), ``a, b`` the halves of ``x`` along ``dim``."""
    a, b = input.chunk(2, dim)
    return a * torch.sigmoid(b)


@composite(torch.sort, T.sort)
def sort(input, dim=-1, descending=False, stable=False):
    """sort: values gathered at the primal's sorting indices."""
    idx = torch.sort(input.detach(), dim=dim, descending=descending, stable=stable).indices
    return input.gather(dim, idx), idx


@composite(torch.topk, T.topk)
def topk(input, k, dim=-1, largest=True, sorted=True):
    """topk: values gathered at the primal's indices."""
    idx = torch.topk(input.detach(), k, dim=dim, largest=largest, sorted=sorted).indices
    return input.gather(dim, idx), idx


# nll_loss is linear in its input for fixed targets and weights: every block alike
linear(torch._C._nn.nll_loss_nd, torch._C._nn.nll_loss, torch._C._nn.nll_loss2d, fixed=("weight",))
