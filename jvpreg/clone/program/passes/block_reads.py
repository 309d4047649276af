"""Passes over block reads (``z[0]``, ``z[1:]``, ``z[i]``): each reads the fewest blocks, and under autograd a
tensor's blocks are read through one ``split`` or ``unbind``.

The backward is why: a ``select`` or a ``slice`` of a tensor has a backward that fills a zero tensor of its full
size and copies the gradient in; ``split``'s and ``unbind``'s concatenate or stack the gradients once.
"""
from __future__ import annotations

import operator
from typing import Dict

import torch

from jvpreg.clone.program.passes.analysis import last_writes, recorded_shape

__all__ = ["hoist_selects", "select_through_slices", "split_block_reads", "unbind_full_selects",
           "squeeze_single_selects"]

_SELECT, _SLICE = torch.ops.aten.select.int, torch.ops.aten.slice.Tensor
_BINARY = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)
_SPLIT, _SQUEEZE = torch.ops.aten.split_with_sizes.default, torch.ops.aten.squeeze.dim
_UNBIND = torch.ops.aten.unbind.int
_MAX_UNBIND = 64  # selects of more entries than this stay selects (one node per entry)


def hoist_selects(graph: torch.fx.Graph) -> None:
    """``select(op(x, y), 0, i)`` -> ``op(select(x, 0, i), y)`` for add/sub/mul/div when only ``x`` has dim 0 (``y``
    a number or of lower rank) and the select is ``op``'s one use: a rule's ``(z[1:] - a)[0]`` for one tangent
    reads block 1 once instead of differencing every block."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or tuple(node.args[1:2]) != (0,):
            continue
        op = node.args[0]
        if not (isinstance(op, torch.fx.Node) and op.target in _BINARY and not op.kwargs and len(op.args) == 2
                and len(op.users) == 1):
            continue
        x, y = op.args
        full = recorded_shape(op)
        if not (isinstance(x, torch.fx.Node) and full is not None and recorded_shape(x) == full):
            continue
        if isinstance(y, torch.fx.Node):
            ys = recorded_shape(y)
            if ys is None or len(ys) >= len(full):
                continue
        elif not isinstance(y, (int, float)):
            continue
        with graph.inserting_before(op):  # where op read x: an in-place write to x may come before the select
            part = graph.call_function(_SELECT, (x, 0, node.args[2]))
            new = graph.call_function(op.target, (part, y))
        part.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta.update(part.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        graph.erase_node(op)


def select_through_slices(graph: torch.fx.Graph) -> None:
    """``select(slice(x, d, start, end), d, i)`` -> ``select(x, d, start + i)`` (a block of ``x[1:]``: the same
    view of ``x``)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or len(node.args) != 3:
            continue
        src, dim, i = node.args
        if not (isinstance(src, torch.fx.Node) and src.target is _SLICE and not src.kwargs) or src.args[1:2] != (dim,):
            continue
        start = src.args[2] if len(src.args) > 2 else 0
        step = src.args[4] if len(src.args) > 4 else 1
        size = recorded_shape(src)
        if not (isinstance(start, int) and start >= 0 and step == 1 and isinstance(i, int) and size
                and 0 <= i < size[dim]):
            continue
        node.args = (src.args[0], dim, start + i)


def split_block_reads(graph: torch.fx.Graph) -> None:
    """``z[0]``, ``z[1:]``, ``z[i]`` read under autograd -> ``squeeze``/``select`` of ``split(z, [1, K-1])``.

    Same views, one backward node: split's backward concatenates the two gradients, where a ``select`` and a
    ``slice`` each fill a zero tensor of ``z``'s full size, copy their part in, and the two are summed (three
    full-size passes more per rule). Only for tensors no op writes into once
    they are read (a multi-view split does not allow its base to be modified in place; an in-place ReLU's result
    read by the next layer is written before) and reads recorded in grad mode (the
    values recorded carry no ``requires_grad``; a tensor that needs none pays one view op more).
    """
    last_write = None
    for z in list(graph.nodes):
        val = z.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[0] >= 2):
            continue
        k = val.shape[0]
        head, rest, others = [], [], []
        for u in z.users:
            if u.op != "call_function" or u.kwargs or not u.meta.get("jvpreg_grad", False):
                continue
            if u.target is _SELECT and u.args[1] == 0 and isinstance(u.args[2], int):
                i = u.args[2] % k
                (head if i == 0 else others).append((u, i))
            elif (u.target is _SLICE and tuple(u.args[1:3]) == (0, 1) and len(u.args) == 4
                  and isinstance(u.args[3], int) and u.args[3] >= k):
                rest.append(u)
        if not head or not (rest or others):
            continue
        reads = {u for u, _ in head} | set(rest) | {u for u, _ in others}
        first_read = next(n for n in graph.nodes if n in reads)  # recorded under autograd, as is the split then
        if last_write is None:
            last_write = last_writes(graph)
            order = {n: i for i, n in enumerate(graph.nodes)}
        if z in last_write and last_write[z] >= order[first_read]:
            continue
        with graph.inserting_before(first_read):
            parts = graph.call_function(_SPLIT, (z, [1, k - 1], 0))
        with graph.inserting_after(parts):
            tail = graph.call_function(operator.getitem, (parts, 1))
        with graph.inserting_after(parts):
            first = graph.call_function(operator.getitem, (parts, 0))
        with graph.inserting_after(tail):
            a = graph.call_function(_SQUEEZE, (first, 0))
        for n in (parts, first, tail, a):
            n.meta["jvpreg_grad"] = True
        for u, _ in head:
            u.replace_all_uses_with(a)
            graph.erase_node(u)
        for u in rest:
            u.replace_all_uses_with(tail)
            graph.erase_node(u)
        for u, i in others:
            with graph.inserting_before(u):
                b = graph.call_function(_SQUEEZE, (tail, 0)) if k == 2 else graph.call_function(_SELECT, (tail, 0, i - 1))
            b.meta.update(u.meta)
            u.replace_all_uses_with(b)
            graph.erase_node(u)


def unbind_full_selects(graph: torch.fx.Graph) -> None:
    """``z.select(d, 0)``, ..., ``z.select(d, n-1)`` read under autograd -> ``unbind(z, d)``: the same views, and one
    backward node that stacks the gradients, where each ``select`` fills a zero tensor of ``z``'s full size and
    copies its part in, and the ``n`` results are summed (``3n - 1`` full passes). Attention's ``q, k, v`` read out
    of one packed projection (``proj[0], proj[1], proj[2]``), or blocks read one by one. Same conditions as
    :func:`split_block_reads` (no write into ``z`` once it is read)."""
    last_write = order = None
    for z in list(graph.nodes):
        val = z.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        by_dim: Dict[int, Dict[int, list]] = {}
        for u in z.users:
            if (u.op == "call_function" and u.target is _SELECT and not u.kwargs and len(u.args) == 3
                    and isinstance(u.args[1], int) and isinstance(u.args[2], int) and u.meta.get("jvpreg_grad", False)):
                d = u.args[1] % val.dim()
                by_dim.setdefault(d, {}).setdefault(u.args[2] % max(val.shape[d], 1), []).append(u)
        for d, reads in by_dim.items():
            n = val.shape[d]
            if not isinstance(n, int) or n < 2 or n > _MAX_UNBIND or set(reads) != set(range(n)):
                continue
            nodes = {u for us in reads.values() for u in us}
            first_read = next(x for x in graph.nodes if x in nodes)
            if last_write is None:
                last_write = last_writes(graph)
                order = {x: i for i, x in enumerate(graph.nodes)}
            if z in last_write and last_write[z] >= order.get(first_read, -1):
                continue
            with graph.inserting_before(first_read):
                parts = graph.call_function(_UNBIND, (z, d))
            parts.meta["jvpreg_grad"] = True
            for i, us in sorted(reads.items()):
                with graph.inserting_after(parts):
                    part = graph.call_function(operator.getitem, (parts, i))
                part.meta.update(us[0].meta)
                for u in us:
                    u.replace_all_uses_with(part)
                    graph.erase_node(u)
            break  # one unbind per tensor


def squeeze_single_selects(graph: torch.fx.Graph) -> None:
    """``select(z, d, 0)`` with ``z.shape[d] == 1`` -> ``squeeze(z, d)``: the same view, whose backward is a view
    too (a select's fills a zero tensor and copies the gradient in). One tangent's block read out of ``(1, ...)``."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or node.kwargs or len(node.args) != 3:
            continue
        z, d, i = node.args
        val = z.meta.get("val") if isinstance(z, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and isinstance(d, int) and -val.dim() <= d < val.dim()
                and val.shape[d] == 1 and i in (0, -1)):
            continue
        node.target, node.args = _SQUEEZE, (z, d)
