"""Ops whose output shape depends on their inputs' values (``nonzero``, ``x[mask]``, ``torch.where(c)``, ``unique``).

A program holds the shapes such an op gave when it was recorded (in the sizes of later ops), so it is exact only for
calls that reproduce them: :func:`dynamic_shapes` finds those tensors, whose shapes the value guard re-checks
(:mod:`jvpreg.clone.program.value_guard`). Which ops: those torch tags so, a few it does not (``nonzero``,
``one_hot(num_classes=-1)``, ...), and a composite op the pre-dispatch tracer keeps whole (``torch.where(c)``) whose
decomposition, run on fake tensors, calls one of them. Checked over PyTorch's op database: every op whose output
shape changed with its inputs' values there is found (:func:`op_sweep.value_shaped`,
``tests/clone/test_opinfo_sweep.py``).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["dynamic_shapes"]


_ALWAYS_DYNAMIC = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten._unique.default,
                   torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
                   torch.ops.aten.unique_dim.default, torch.ops.aten.bincount.default}


def _dynamic_call(target: Any, args: Sequence, kwargs: dict, dtype: Callable[[Any], Any]) -> bool:
    """``target(*args, **kwargs)``'s output shape depends on its inputs' values (``nonzero``, ``x[mask]``,
    ``unique``, ...); ``dtype(a)``: the dtype of argument ``a``."""
    if target in _ALWAYS_DYNAMIC:
        return True
    if target is torch.ops.aten.index.Tensor:  # a boolean mask among the indices
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(dtype(i) in (torch.bool, torch.uint8) for i in indices if i is not None)
    if target is torch.ops.aten.one_hot.default:  # num_classes=-1: from the largest value
        return (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1
    if target is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return torch.Tag.dynamic_output_shape in target.tags  # an op added later: assume so


class _Dynamic(Exception):
    pass


_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class _WatchDynamic(TorchDispatchMode):
    """Raises :class:`_Dynamic` at the first op whose output shape depends on values, or that reads a value into
    C++ (``tensor_split`` by a tensor of indices)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READS or _dynamic_call(func, args, kwargs, lambda a: getattr(a, "dtype", None)):
            raise _Dynamic
        return func(*args, **kwargs)


_DECOMPOSES_TO_DYNAMIC: dict = {}  # (op, argument kinds) -> verdict of _decomposes_to_dynamic


def _argument_kinds(value: Any) -> Any:
    """What can change which ops a composite op decomposes into: tensors' dtypes and ranks, the types of numbers
    and sizes, the values of flags, strings, dtypes and ``None``."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim())
    if isinstance(value, (list, tuple)):
        return tuple(_argument_kinds(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _argument_kinds(v)) for k, v in sorted(value.items()))
    if value is None or isinstance(value, (bool, str, torch.dtype, torch.layout, torch.memory_format)):
        return value
    return type(value)


def _decomposes_to_dynamic(node: torch.fx.Node, fake: Any) -> bool:
    """``node`` is a composite op (kept whole by the pre-dispatch tracer) whose decomposition runs one whose output
    shape depends on values (``torch.where(c)`` is ``nonzero``): found by running it on fake tensors shaped like
    its recorded inputs (``fake``: a ``FakeTensorMode``), once per op and :func:`_argument_kinds`. An op that
    cannot run there counts as dynamic (a shape guard is exact whatever the op does)."""
    key = (node.target, _argument_kinds(node.args), _argument_kinds(node.kwargs))
    verdict = _DECOMPOSES_TO_DYNAMIC.get(key)
    if verdict is None:
        verdict = _DECOMPOSES_TO_DYNAMIC[key] = _runs_a_dynamic_op(node, fake)
    return verdict


#: Composite ops whose C++ reads an input's data itself, so that fake tensors cannot run them, and whose output
#: shapes follow their inputs' shapes: the packed recurrent ops (``batch_sizes`` steer the loop; the output has the
#: packed input's rows).
_READ_DATA_STATIC_SHAPE = {op for op in (getattr(getattr(torch.ops.aten, name), "data", None)
                                         for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")) if op is not None}


def _runs_a_dynamic_op(node: torch.fx.Node, fake: Any) -> bool:
    def as_fake(value):
        if isinstance(value, torch.Tensor):
            return fake.from_tensor(value)
        if isinstance(value, (list, tuple)):
            return type(value)(as_fake(v) for v in value)
        return value

    try:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: as_fake(a.meta.get("val")))
        with fake, _WatchDynamic():
            node.target(*args, **kwargs)
    except _Dynamic:
        return True
    except Exception:  # an op fake tensors cannot run
        return node.target not in _READ_DATA_STATIC_SHAPE
    return False


def _dynamic_shape(node: torch.fx.Node, fake: Any) -> bool:
    """``node``'s output shape depends on its inputs' values, directly or through the ops it decomposes into."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if _dynamic_call(target, node.args, node.kwargs, lambda a: getattr(getattr(a, "meta", {}).get("val"), "dtype", None)):
        return True
    return (torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")
            and _decomposes_to_dynamic(node, fake))


def dynamic_shapes(graph: torch.fx.Graph) -> List[Tuple[torch.fx.Node, tuple, Any]]:
    """The tensors of ``graph`` whose shape depends on values, with the shape each had when recorded and the op
    that made it: the program holds those shapes (in the sizes of later ops) and is exact only for calls that
    reproduce them. A multi-result op (``torch.where(c)``) counts by the results the program reads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    found, fake = [], FakeTensorMode()
    for node in graph.nodes:
        if not _dynamic_shape(node, fake):
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            found.append((node, tuple(val.shape), node.target))
        elif isinstance(val, (list, tuple)):
            found.extend((u, tuple(u.meta["val"].shape), node.target) for u in node.users
                         if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor))
    return found
