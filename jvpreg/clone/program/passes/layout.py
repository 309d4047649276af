"""Passes over views and layouts: broadcasts instead of ``expand``, chains of reshapes and permutes folded, casts
to a tensor's own dtype dropped, and the contiguous operand of a sum or product put first."""
from __future__ import annotations

from typing import Any

import torch

from jvpreg.clone.program.passes.analysis import recorded_shape

__all__ = ["contiguous_first", "drop_broadcast_expands", "fold_reshapes", "fold_permutes", "drop_noop_casts"]


_COMMUTING = (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)


def contiguous_first(graph: torch.fx.Graph) -> None:
    """``add(h, c)`` -> ``add(c, h)`` (and ``mul``) when ``h`` is a strided view and ``c`` a contiguous tensor of
    the same shape and dtype: the result takes its first operand's memory layout, so it is contiguous and the
    next kernels (LayerNorm, linear) need no copy. Same values: both ops commute exactly.

    (A transposed attention output plus the residual: the layout a plain forward's fused attention avoids.)"""
    for node in graph.nodes:
        if node.target not in _COMMUTING or len(node.args) != 2 or node.kwargs:
            continue
        h, c = node.args
        hv, cv = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (h, c))
        if not (isinstance(hv, torch.Tensor) and isinstance(cv, torch.Tensor)):
            continue
        # only a view with its last dim innermost (batch/sequence dims swapped): a channels-last tensor keeps
        # its layout, which the plain forward's kernels (BatchNorm's statistics included) follow
        if hv.shape == cv.shape and hv.dtype == cv.dtype and not hv.is_contiguous() and cv.is_contiguous() \
                and hv.dim() > 0 and hv.stride(-1) == 1:
            node.args = (c, h)


_EXPANDS = (torch.ops.aten.expand.default, torch.ops.aten.expand_as.default)


def drop_broadcast_expands(graph: torch.fx.Graph) -> None:
    """``op(h, expand(a, h.shape))`` -> ``op(h, a)`` for pointwise ops: broadcasting does the expansion
    (same values, same gradients) without a call; rules expand block 0 to reuse fused kernels."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _EXPANDS:
            continue
        full = recorded_shape(node)
        for user in list(node.users):
            t = user.target
            if (user.op != "call_function" or not isinstance(t, torch._ops.OpOverload)
                    or torch.Tag.pointwise not in t.tags or t._schema.is_mutable or recorded_shape(user) != full):
                continue
            others = [a for a in user.args if isinstance(a, torch.fx.Node) and a is not node]
            if any(recorded_shape(a) == full for a in others):
                user.replace_input_with(node, node.args[0])


_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _contiguous(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def fold_reshapes(graph: torch.fx.Graph) -> None:
    """``reshape(reshape(x, s1), s2)`` -> ``reshape(x, s2)``, and -> ``x`` when ``s2`` is ``x``'s shape.

    Rules flatten the block dim into the batch for a kernel and split it back (``(K, B, ...)`` ->
    ``(K*B, ...)`` -> ``(K, B, ...)``); consecutive layers then reshape back and forth. Only for
    contiguous sources, where every reshape is a view: the same values, gradients and aliasing.
    """
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        src = node.args[0]
        while isinstance(src, torch.fx.Node) and src.target in _RESHAPES and _contiguous(src.args[0]):
            src = src.args[0]
        if not _contiguous(src):
            continue
        if recorded_shape(src) == recorded_shape(node) and src.op != "placeholder":
            node.replace_all_uses_with(src)
            graph.erase_node(node)
        elif src is not node.args[0]:
            node.args = (src, *node.args[1:])


_PERMUTE = torch.ops.aten.permute.default


def fold_permutes(graph: torch.fx.Graph) -> None:
    """``permute(permute(x, p), q)`` -> ``permute(x, [p[i] for i in q])``, and -> ``x`` for the identity
    (rules move the block dim and back around attention and normalisations): one view instead of two."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _PERMUTE or node.kwargs:
            continue
        src, q = node.args
        if not (isinstance(src, torch.fx.Node) and src.target is _PERMUTE and not src.kwargs):
            continue
        n = len(q)
        p = [d % n for d in src.args[1]]
        dims = [p[d % n] for d in q]
        if dims == list(range(n)) and src.args[0].op != "placeholder":
            node.replace_all_uses_with(src.args[0])
            graph.erase_node(node)
        else:
            node.args = (src.args[0], dims)


_TO_DTYPE = torch.ops.aten.to.dtype


def drop_noop_casts(graph: torch.fx.Graph) -> None:
    """``to(x, dtype)`` -> ``x`` when ``x`` has that dtype: ``to`` returns ``x`` itself then (same aliasing);
    rules cast tangents to the primal's dtype for the autocast case."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _TO_DTYPE or node.kwargs or len(node.args) != 2:
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == node.args[1]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
