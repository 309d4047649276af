"""Passes over the rules' outputs ``[a; a + t]``: each built as one ``stack``, and a single tangent's block
squeezed where it meets an ``S``-shaped primal, so that no gradient is reduced over a leading 1."""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

from jvpreg.clone.program.passes.analysis import recorded_shape

__all__ = ["sink_unsqueezes", "squeeze_single_blocks", "stack_unsqueezed_cats"]


_BINARY = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)
_CAT, _STACK, _UNSQUEEZE = torch.ops.aten.cat.default, torch.ops.aten.stack.default, torch.ops.aten.unsqueeze.default
_SQUEEZE = torch.ops.aten.squeeze.dim


def sink_unsqueezes(graph: torch.fx.Graph) -> None:
    """``op(b, unsqueeze(c, 0))`` -> ``unsqueeze(op(b, c), 0)`` for add/sub/mul/div when ``b`` broadcasts to ``c``'s
    shape: the same values (the leading 1 only broadcasts), one call moved, and chains of such ops end in
    one unsqueeze that :func:`stack_unsqueezed_cats` folds into the rule's output stack."""
    shapes: Dict[torch.fx.Node, Any] = {}

    def shape(n):
        return shapes[n] if n in shapes else recorded_shape(n)

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _BINARY or node.kwargs or len(node.args) != 2:
            continue
        pos = [i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.target is _UNSQUEEZE
               and tuple(a.args[1:]) == (0,) and len(a.users) == 1]
        if len(pos) == 2:  # op(unsqueeze(c1, 0), unsqueeze(c2, 0)) -> unsqueeze(op(c1, c2), 0): broadcasting adds
            _sink_both(graph, node, shape, shapes)  # the same leading 1
            continue
        if len(pos) != 1:
            continue
        unsq = node.args[pos[0]]
        c, other = unsq.args[0], node.args[1 - pos[0]]
        inner = shape(c)
        if inner is None or shape(node) != (1, *inner):
            continue
        if isinstance(other, torch.fx.Node):
            o = shape(other)
            if o is None or len(o) > len(inner):
                continue
        elif not isinstance(other, (int, float)):
            continue
        args = list(node.args)
        args[pos[0]] = c
        _unsqueezed_op(graph, node, tuple(args), inner, shapes)
        graph.erase_node(unsq)


def _unsqueezed_op(graph: torch.fx.Graph, node: torch.fx.Node, args: tuple, inner: tuple,
                   shapes: Dict[torch.fx.Node, Any]) -> None:
    """Replace ``node`` by ``unsqueeze(node.target(*args), 0)``, whose inner result has shape ``inner``."""
    with graph.inserting_before(node):
        new = graph.call_function(node.target, args)
        out = graph.call_function(_UNSQUEEZE, (new, 0))
    for n in (new, out):
        n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    shapes[new], shapes[out] = inner, (1, *inner)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _sink_both(graph: torch.fx.Graph, node: torch.fx.Node, shape: Callable, shapes: Dict[torch.fx.Node, Any]) -> None:
    """``op(unsqueeze(c1, 0), unsqueeze(c2, 0))`` -> ``unsqueeze(op(c1, c2), 0)`` (see :func:`sink_unsqueezes`)."""
    a, b = node.args
    s1, s2 = shape(a), shape(b)  # (1, *c.shape): known where the inner node's is not (made by an earlier pass)
    if s1 is None or s2 is None:
        return
    s1, s2 = s1[1:], s2[1:]
    try:
        inner = tuple(torch.broadcast_shapes(s1, s2))
    except RuntimeError:
        return
    if shape(node) != (1, *inner):
        return
    _unsqueezed_op(graph, node, (a.args[0], b.args[0]), inner, shapes)
    for u in (a, b):
        if not u.users:
            graph.erase_node(u)


def _fake_val(target: Any, args: tuple) -> Any:
    """The fake value ``target(*args)`` would record (``None`` where an argument has none or the op fails)."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
    modes = [v.fake_mode for v in vals if hasattr(v, "fake_mode")]
    if not modes or any(isinstance(a, torch.fx.Node) and v is None for a, v in zip(args, vals)):
        return None
    try:
        with modes[0]:
            return target(*vals)
    except Exception:  # a value only changes what later passes know, never what runs
        return None


def squeeze_single_blocks(graph: torch.fx.Graph) -> None:
    """``op(t, b)`` with ``t`` of shape ``(1, *S)`` and ``b`` of shape ``S`` -> ``unsqueeze(op(squeeze(t, 0), b), 0)``
    for add/sub/mul/div: the same values, and the backward hands ``b`` its gradient as it is, where broadcasting
    made autograd reduce the leading 1 away (one full copy per op). One tangent's block against the primal: the
    difference form's ``z_1 - a`` and a rule's ``a + t``, two per normalisation. :func:`sink_unsqueezes` then
    carries the unsqueeze to the rule's output stack."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _BINARY or node.kwargs or len(node.args) != 2:
            continue
        if node.meta.get("jvpreg_grad") is False:  # recorded without autograd: no backward to spare, two ops more
            continue
        out = recorded_shape(node)
        if out is None or len(out) < 1 or out[0] != 1:
            continue
        pos = [i for i, a in enumerate(node.args) if recorded_shape(a) == out]
        other = node.args[1 - pos[0]] if len(pos) == 1 else None
        if other is None or recorded_shape(other) != out[1:]:
            continue
        t = node.args[pos[0]]
        with graph.inserting_before(node):
            if t.target is _UNSQUEEZE and tuple(t.args[1:]) == (0,):
                sq = t.args[0]  # unsqueeze(c, 0): read c
            else:
                sq = graph.call_function(_SQUEEZE, (t, 0))
                sq.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                sq.meta["val"] = _fake_val(_SQUEEZE, (t, 0))
            args = list(node.args)
            args[pos[0]] = sq
            new = graph.call_function(node.target, tuple(args))
            unsq = graph.call_function(_UNSQUEEZE, (new, 0))
        for n in (new, unsq):
            n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["val"] = _fake_val(node.target, tuple(args))
        unsq.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(unsq)
        graph.erase_node(node)


def stack_unsqueezed_cats(graph: torch.fx.Graph) -> None:
    """``cat([unsqueeze(a, 0), unsqueeze(b, 0)], 0)`` -> ``stack([a, b], 0)``: the clone rules' output
    ``[primal; primal + tangent]`` in one call (``stack`` is that cat, in C++)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CAT or node.kwargs:
            continue
        parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
        if dim != 0 or not all(isinstance(p, torch.fx.Node) and p.target is _UNSQUEEZE and tuple(p.args[1:]) == (0,)
                               and len(p.users) == 1 for p in parts):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(_STACK, ([p.args[0] for p in parts], 0))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
