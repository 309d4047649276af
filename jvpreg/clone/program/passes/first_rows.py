"""Block 0 of a clone tensor followed on its own: where a program's ops keep dim 0 apart, the primal block is
computed from primal blocks only, so it can be finite where the tangent blocks of the same tensor may not be."""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional

import torch

from jvpreg.clone.program.passes.analysis import recorded_shape

__all__ = ["block_read", "stacked_part", "first_row"]

_SELECT, _SQUEEZE = torch.ops.aten.select.int, torch.ops.aten.squeeze.dim
_SPLIT = torch.ops.aten.split_with_sizes.default
_STACK, _CAT, _UNSQUEEZE = torch.ops.aten.stack.default, torch.ops.aten.cat.default, torch.ops.aten.unsqueeze.default
_UNBIND, _TRANSPOSE, _PERMUTE = torch.ops.aten.unbind.int, torch.ops.aten.transpose.int, torch.ops.aten.permute.default
_UNFLATTEN, _EXPAND = torch.ops.aten.unflatten.int, torch.ops.aten.expand.default
_LINEAR = torch.ops.aten.linear.default
_BMM, _MM = torch.ops.aten.bmm.default, torch.ops.aten.mm.default
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_KEEP_ROWS = (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
              torch.ops.aten.detach.default)


def _leading(node: torch.fx.Node) -> Optional[int]:
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


def block_read(node: torch.fx.Node) -> Optional[tuple]:
    """``(t, i)`` if ``node`` reads block ``i`` of ``t`` along dim 0: ``select(t, 0, i)``, or a one-block chunk of
    ``split_with_sizes(t, sizes, 0)`` (``squeeze``-d or not: how :func:`jvpreg.clone.api.unpack` reads the primal
    block), else ``None``."""
    if node.target is torch.ops.aten.select.int:
        return (node.args[0], node.args[2]) if node.args[1] == 0 else None
    if node.target is _SQUEEZE and node.args[1] == 0 and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
        return None
    split, j = node.args
    if split.target is not _SPLIT or (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) != 0:
        return None
    sizes = list(split.args[1])
    return (split.args[0], sum(sizes[:j])) if 0 <= j < len(sizes) and sizes[j] == 1 else None


def stacked_part(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``b_i`` if ``node`` reads block ``i`` of ``stack([b_0, b_1, ...], 0)`` (a rule's output block:
    :func:`block_read`), else ``None``."""
    read = block_read(node)
    if read is None:
        return None
    src, i = read
    if not (isinstance(src, torch.fx.Node) and src.target in (_STACK, _CAT)):
        return None
    if (src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)) != 0:
        return None
    parts = list(src.args[0])
    if src.target is _CAT:  # cat of one-block parts (unsqueeze(b, 0), a + unsqueeze(d, 0)): a rule's output
        if not all(isinstance(p, torch.fx.Node) and _leading(p) == 1 for p in parts):
            return None
        parts = [p.args[0] if p.target is _UNSQUEEZE and p.args[1] == 0 else p for p in parts]
    return parts[i] if -len(parts) <= i < len(parts) and isinstance(parts[i], torch.fx.Node) else None


def _apart(d: Any, rank: Optional[int]) -> bool:
    """``d`` is a known dim of a rank-``rank`` tensor other than dim 0."""
    return isinstance(d, int) and not isinstance(d, bool) and bool(rank) and d % rank != 0


def first_row(node: torch.fx.Node, inf: Dict[torch.fx.Node, bool], rows: Dict[torch.fx.Node, bool]) -> Optional[bool]:
    """Can index 0 along dim 0 of ``node``'s value hold an infinity, from the first rows of its arguments, for ops
    that keep dim 0 apart (views that leave it in place, pointwise ops, ``linear``, batched products); ``None``
    for any other op (then: whatever its whole value may hold)."""
    target, args = node.target, node.args
    shape = recorded_shape(node)
    rank = None if shape is None else len(shape)
    row = lambda a: isinstance(a, torch.fx.Node) and rows.get(a, True)  # noqa: E731
    whole = lambda a: isinstance(a, torch.fx.Node) and inf.get(a, True)  # noqa: E731
    src = args[0] if args and isinstance(args[0], torch.fx.Node) else None
    src_rank = None if src is None or recorded_shape(src) is None else len(recorded_shape(src))
    if target is operator.getitem and src is not None:
        first = block_read(node)
        if first is not None:
            return row(first[0]) if first[1] == 0 else None
        op = src.target
        if node.args[1] == 0 and _schema_name(op) == "jvpreg::batch_norm_blocks":  # block 0: BN(a), batch statistics
            return whole(src.args[1]) or whole(src.args[2]) if len(src.args) > 2 else None
        dim = (src.args[2] if op is _SPLIT and len(src.args) > 2
               else src.args[1] if op is _UNBIND and len(src.args) > 1 else 0)
        return row(src.args[0]) if op in (_SPLIT, _UNBIND) and _apart(dim, _rank(src.args[0])) else None
    if target in (_STACK, _CAT) and rank and not node.kwargs:
        parts, d = list(args[0]), args[1] if len(args) > 1 else 0
        if _apart(d, rank):
            return any(row(p) or not isinstance(p, torch.fx.Node) for p in parts)
        first = recorded_shape(parts[0]) if parts else None
        return (whole(parts[0]) if target is _STACK else row(parts[0])) if first and first[0] else None
    if src is None or rank is None or src_rank is None:
        return None
    if target in _KEEP_ROWS:
        return row(src)
    if node.kwargs or (target in (_SELECT, _SQUEEZE, _UNSQUEEZE, _UNFLATTEN, _PERMUTE) and len(args) < 2):
        return None
    if target in (_SELECT, _SQUEEZE):
        return row(src) if _apart(args[1], src_rank) or (target is _SELECT and args[1:] == (0, 0)) else None
    if target is _UNSQUEEZE:
        return row(src) if _apart(args[1], rank) else whole(src)
    if target is _TRANSPOSE:
        return row(src) if len(args) == 3 and _apart(args[1], src_rank) and _apart(args[2], src_rank) else None
    if target is _PERMUTE:
        return row(src) if list(args[1])[:1] == [0] else None
    if target is _UNFLATTEN:
        return row(src) if _apart(args[1], src_rank) else None
    if target in _RESHAPES:  # row-major: the same first dim keeps the first numel / shape[0] entries in row 0
        return row(src) if src_rank and rank and recorded_shape(src)[0] == shape[0] else None
    if target is _EXPAND:
        return row(src) if src_rank == rank else whole(src)
    if target is _LINEAR:
        return row(src) or any(whole(a) for a in args[1:]) if src_rank >= 2 else None
    if target is _BMM:
        return row(src) or row(args[1])
    if target is _MM:
        return row(src) or whole(args[1])
    pointwise = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    if pointwise and not target._schema.is_mutable:
        return any(row(a) if _rank(a) == rank else whole(a) for a in node.all_input_nodes)
    return None


def _schema_name(target: Any) -> str:
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else ""


def _rank(node: Any) -> Optional[int]:
    shape = recorded_shape(node)
    return None if shape is None else len(shape)
