"""What the nodes of a captured program read, write and alias: the facts the passes and the value guards build on.

A program (:mod:`jvpreg.clone.program.capture`) is a ``torch.fx`` graph of aten ops in execution order. An op is
*pure* when its result depends on its arguments only; it *writes* the arguments its schema marks ``Tensor(a!)``
(and a training batch norm its running statistics, which the schema does not mark); it makes a *view* when its
schema marks a result as an alias. Views of one tensor form its *alias class*: a write into one is a write into all.
"""
from __future__ import annotations

import operator
from typing import Any, Dict

import torch

__all__ = ["aten_op", "METADATA_ONLY", "pure", "written", "may_write", "is_view", "alias_classes", "last_writes",
           "recorded_shape"]


def aten_op(name: str, overload: str = "default") -> Any:
    """``torch.ops.aten.<name>.<overload>``, or ``None`` where this torch has no such op."""
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


#: Ops whose schema does not mark the running statistics they update in training mode as written
#: (``native_batch_norm(..., Tensor? running_mean, Tensor? running_var, bool training, ...)``): op -> the
#: positions of ``running_mean``, ``running_var`` and of the flag that says whether they are updated.
_HIDDEN_WRITES = {op: (3, 4, 5) for op in (aten_op("native_batch_norm"), aten_op("batch_norm"),
                                            aten_op("_batch_norm_impl_index"), aten_op("cudnn_batch_norm"),
                                            aten_op("miopen_batch_norm"), aten_op("instance_norm")) if op is not None}


#: In-place ops that change a tensor's autograd metadata, not its values (``torch.tensor(...)`` in a forward records
#: ``detach_`` of the lifted constant): no write for the passes and guards that follow values.
METADATA_ONLY = frozenset(op for op in (aten_op("detach_"),) if op is not None)


def pure(target: Any) -> bool:
    """An op whose result depends only on its arguments (no mutation, no randomness)."""
    if not isinstance(target, torch._ops.OpOverload):
        return target is operator.getitem
    schema = target._schema
    return (not schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
            and target not in _HIDDEN_WRITES)


def written(node: torch.fx.Node):
    """The argument nodes an aten op writes into (its schema's ``Tensor(a!)`` arguments, and the running
    statistics of a batch norm in training mode: :data:`_HIDDEN_WRITES`)."""
    target = node.target
    hidden = _HIDDEN_WRITES.get(target)
    if hidden is not None:
        *stats, flag = hidden
        if len(node.args) <= flag or node.args[flag] is not False:
            yield from (node.args[i] for i in stats if i < len(node.args) and isinstance(node.args[i], torch.fx.Node))
        return
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable or target in METADATA_ONLY:
        return
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                yield value


def may_write(node: torch.fx.Node) -> bool:
    """An aten op that may write into its arguments (the graph's other calls are getitem and grad-mode switches)."""
    return isinstance(node.target, torch._ops.OpOverload) and (node.target._schema.is_mutable
                                                               or node.target in _HIDDEN_WRITES)


def is_view(node: Any) -> bool:
    """``node`` may share memory with its first argument: an aten op whose schema marks a result as an alias
    (``view``, ``split``, ``add_``), or ``getitem`` of a list or of such a result. ``getitem(topk(x), 1)`` is not:
    a multi-result op's results are separate tensors unless its schema says otherwise."""
    t = getattr(node, "target", None)
    if t is operator.getitem:
        returns = _schema_returns(node.args[0])
        index = node.args[1] if len(node.args) > 1 else None
        if returns is not None and len(returns) > 1 and isinstance(index, int) and -len(returns) <= index < len(returns):
            return returns[index].alias_info is not None
        return True
    return isinstance(t, torch._ops.OpOverload) and any(r.alias_info is not None for r in t._schema.returns)


def _schema_returns(node: Any):
    """The schema's results of the aten op that made ``node``, else ``None``."""
    t = getattr(node, "target", None)
    return t._schema.returns if isinstance(t, torch._ops.OpOverload) else None


def alias_classes(graph: torch.fx.Graph) -> Dict[torch.fx.Node, Any]:
    """Each node's alias class, as a key: a node, its views, their views, ... and back to the base share one
    (:func:`is_view`); two reads of one result of a multi-result op share one too."""
    parent: Dict[Any, Any] = {}

    def root(n):
        while n in parent:
            n = parent[n]
        return n

    for node in graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        if is_view(node):
            source = node.args[0]
        elif node.target is operator.getitem:
            source = (node.args[0], node.args[1] % len(_schema_returns(node.args[0])))  # one result, however read
        else:
            continue
        a, b = root(node), root(source)
        if a is not b:
            parent[a] = b
    return {n: root(n) for n in graph.nodes}


def last_writes(graph: torch.fx.Graph) -> Dict[torch.fx.Node, int]:
    """For each node whose tensor an op writes into, with every view of it and every tensor it is a view of:
    the graph position of the last such write."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes = [(w, order[node]) for node in graph.nodes if node.op == "call_function" for w in written(node)]
    if not writes:
        return {}
    classes = alias_classes(graph)
    last: Dict[Any, int] = {}
    for w, i in writes:
        last[classes[w]] = max(last.get(classes[w], -1), i)
    return {n: last[c] for n, c in classes.items() if c in last}


def recorded_shape(node: Any):
    """The shape of the value ``node`` recorded, or ``None`` where it recorded no tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
