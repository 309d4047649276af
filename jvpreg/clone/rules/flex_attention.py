"""FlexAttention (``torch.nn.attention.flex_attention``) linearised through its dense formula.

``flex_attention(q, k, v, score_mod, block_mask)`` is, as torch's own eager implementation computes it
(``torch._higher_order_ops.flex_attention.math_attention``)::

    S = q k^T * scale,   S' = where(mask_mod(b, h, i, j), score_mod(S, b, h, i, j), -inf),
    out = safe_softmax(S') v,   lse = logsumexp(S'),   max = max(S')   (lse and max in log2 units)

The primal block is the op itself; the tangent blocks come from that formula run on the clone batch, every op
through its own rule (:func:`jvpreg.clone.rules.kinds.composite`). torch evaluates ``score_mod`` and
``mask_mod`` under ``vmap`` over ``(b, h, i, j)``; here they run once on broadcast index tensors ``b (B,1,1,1)``,
``h (1,H,1,1)``, ``i (1,1,L,1)``, ``j (1,1,1,S)``, which is the same for elementwise functions. Where it is not
(an error, an output of another shape, or a primal block that differs from the operator's output: checked on every
eager call and once at capture) the call is refused with an error. ``torch.func.jvp`` has no rule for flex.

In eager mode ``flex_attention`` calls its operator through ``torch.compile``, which cannot trace a clone batch:
while a clone forward runs, :func:`install` makes it call the operator directly (its debug switch), where the
operator's ``__torch_function__`` reaches this rule.
"""
from __future__ import annotations

import math

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from jvpreg.clone.core.session import Session, register_route
from jvpreg.clone.rules.blocks import primal
from jvpreg.clone.rules.kinds import composite

try:
    import torch.nn.attention.flex_attention as _front
    from torch._higher_order_ops.flex_attention import flex_attention as _hop
except ImportError:  # pragma: no cover - torch without FlexAttention
    _front = _hop = None

_SWITCH = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"


def install(session: Session) -> None:
    """Make ``flex_attention`` call its operator directly (when the outermost clone forward starts); the caller's
    setting is kept in the session."""
    if _front is not None and hasattr(_front, _SWITCH):
        session.saved[__name__] = getattr(_front, _SWITCH)
        setattr(_front, _SWITCH, True)


def uninstall(session: Session) -> None:
    if __name__ in session.saved:
        setattr(_front, _SWITCH, session.saved.pop(__name__))


register_route(install, uninstall)


def _indices(shape, device):
    b, h, m, n = shape
    return (torch.arange(b, device=device).view(b, 1, 1, 1), torch.arange(h, device=device).view(1, h, 1, 1),
            torch.arange(m, device=device).view(1, 1, m, 1), torch.arange(n, device=device).view(1, 1, 1, n))


def _broadcast(name: str, fn, args, shape):
    """``fn(*args)`` on broadcast indices, checked to broadcast to the scores' ``shape``."""
    what = None
    try:
        got = fn(*args)
    except Exception as err:  # noqa: BLE001  (re-raised with what to do)
        what, cause = f"raised {type(err).__name__}: {err}", err
    else:
        cause = None
        if not isinstance(got, torch.Tensor):
            what = f"returned {type(got).__name__}"
        else:
            try:
                ok = torch.broadcast_shapes(got.shape, shape) == torch.Size(shape)
            except RuntimeError:
                ok = False
            if not ok:
                what = f"returned shape {tuple(got.shape)}"
    if what is None:
        return got
    raise NotImplementedError(
        f"jvpreg clone mode: flex_attention's {name}, called once on broadcast indices b, h, q_idx, kv_idx (shapes "
        f"(B,1,1,1), (1,H,1,1), (1,1,L,1), (1,1,1,S)) instead of under vmap, {what}, not a tensor that broadcasts to "
        f"the scores' {tuple(shape)}. Write {name} with elementwise tensor ops of its arguments, or use "
        "F.scaled_dot_product_attention.") from cause


def flex_attention_formula(query, key, value, score_mod, block_mask, scale, kernel_options,
                           score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """The dense formula above on (clone) tensors: ``(out, lse / ln 2, max / ln 2)``."""
    g = query.size(1) // key.size(1)  # grouped-query attention: each key/value head serves g query heads
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    key = key.expand((query.size(0), *key.shape[1:]))
    value = value.expand((query.size(0), *value.shape[1:]))
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = ((query.to(work) @ key.to(work).transpose(-2, -1)) * scale).to(work)
    shape = tuple(scores.shape)
    idx = _indices(shape, scores.device)
    mask = _broadcast("mask_mod", block_mask[-1], (*idx, *mask_mod_other_buffers), shape)
    modded = _broadcast("score_mod", score_mod, (scores, *idx, *score_mod_other_buffers), shape)
    post = torch.where(mask, modded, torch.tensor(-math.inf, dtype=work, device=scores.device))
    post = post.expand(shape)
    lse = post.logsumexp(dim=-1)
    lse = torch.where(torch.all(post == -math.inf, dim=-1), -math.inf, lse)  # a fully masked row: -inf, as torch
    max_scores = torch.max(post, dim=-1)[0]
    probs = torch.ops.aten._safe_softmax(post, -1)  # a fully masked row gives 0, not NaN
    out = probs.to(query.dtype) @ value.to(query.dtype)
    return out, lse / math.log(2), max_scores / math.log(2)


def same_output(out_a, out) -> None:
    """The formula's primal block must be the operator's output: a ``score_mod``/``mask_mod`` that means something
    else on broadcast indices than under vmap (a reduction over its argument, say) is refused, never linearised.
    A value read, so made where it is free or paid once: eager calls (a capture reads untraced, once)."""
    want = out_a[0]
    with DisableTorchFunctionSubclass(), disable_proxy_modes_tracing():
        got = primal(out[0])
        tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(want.dtype, 2e-2)
        ok = got.shape == want.shape and bool(torch.isclose(got, want, rtol=tol, atol=tol, equal_nan=True).all())
    if not ok:
        raise NotImplementedError(
            "jvpreg clone mode: flex_attention's score_mod or mask_mod, called once on broadcast indices (shapes "
            "(B,1,1,1), (1,H,1,1), (1,1,L,1), (1,1,1,S)) instead of under vmap, gives another attention than flex "
            "computes (a reduction or an index chain in it?). Write it with elementwise tensor ops of its "
            "arguments, or use F.scaled_dot_product_attention.")


if _hop is not None:
    composite(_hop, check=same_output)(flex_attention_formula)
