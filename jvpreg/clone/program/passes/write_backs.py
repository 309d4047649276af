"""An in-place rule's write-back ``copy_(x, f(x))`` replaced by ``f(x)`` where nothing else sees ``x``."""
from __future__ import annotations

import operator
from typing import Any

import torch

from jvpreg.clone.program.passes.analysis import is_view

__all__ = ["drop_copies_back"]


_COPY = torch.ops.aten.copy_.default


def _fresh(node: Any) -> bool:
    """``node`` is a new tensor made by an op of the program: no input, no view, no alias of an argument."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return (isinstance(src, torch.fx.Node) and isinstance(src.target, torch._ops.OpOverload)
                and not src.target._schema.is_mutable
                and all(r.alias_info is None for r in src.target._schema.returns))
    return (isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.is_mutable
            and all(r.alias_info is None for r in node.target._schema.returns))


def _same_layout(a: Any, b: Any) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device and va.stride() == vb.stride())


def drop_copies_back(graph: torch.fx.Graph) -> None:
    """``copy_(x, y)`` -> ``y`` for an in-place rule's write-back (an in-place relu: ``y = relu_blocks(x)``), when
    ``x`` is a tensor the program made (no input, no view of it made before the copy read after it), ``y`` a new
    tensor made from ``x`` and read only by the copy, both of one layout: every later read of ``x`` (or of a view
    of it) reads ``y``. The same values; the forward saves a full copy, and the backward the zero gradient that
    ``copy_`` gives ``x``'s old value and its sum with the real one (three full passes per relu)."""
    for node in [n for n in graph.nodes if n.target is _COPY]:
        if node.kwargs or len(node.args) != 2:
            continue
        x, y = node.args
        if not (isinstance(x, torch.fx.Node) and _fresh(y) and set(y.users) == {node} and _same_layout(x, y)):
            continue
        base = x
        while _written_by_self(base):
            base = base.args[0]
        if not _fresh(base):
            continue  # an input, or a view: other reads see another shape of the same memory
        cls = _aliases(base)
        same = {base}  # base and its in-place results: the tensor x itself, under other names
        for m in base.graph.nodes:
            if m in cls and _written_by_self(m) and m.args[0] in same:
                same.add(m)
        order = {n: i for i, n in enumerate(graph.nodes)}
        at = order[node]
        if any(order[m] < at and m not in same and any(order.get(u, at + 1) > at for u in m.users) for m in cls):
            continue  # a view of x made before the copy and read after it (it would read the old tensor)
        producer = y.args[0] if y.target is operator.getitem else y
        if not any(a in cls for a in producer.args if isinstance(a, torch.fx.Node)):
            continue
        for m in [m for m in same if order[m] < at]:  # x as it stood (views made later follow it)
            for u in list(m.users):
                if u is not node and order.get(u, -1) > at:
                    u.replace_input_with(m, y)
        node.replace_all_uses_with(y)
        graph.erase_node(node)


def _written_by_self(node: torch.fx.Node) -> bool:
    """An in-place op whose result is its own first argument, written (``add_``, ``copy_``)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable or not t._schema.returns:
        return False
    first, ret = t._schema.arguments[0], t._schema.returns[0]
    return (first.alias_info is not None and first.alias_info.is_write and ret.alias_info is not None
            and ret.alias_info.before_set == first.alias_info.before_set)


def _aliases(base: torch.fx.Node) -> set:
    """``base``, its views and in-place results, theirs, and so on."""
    cls, todo = {base}, [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in cls and u.op == "call_function" and is_view(u) and u.args and u.args[0] is n:
                cls.add(u)
                todo.append(u)
    return cls
