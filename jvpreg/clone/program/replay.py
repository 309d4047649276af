"""The replay function of a captured program: its aten ops called through their cheapest exact entry point.

A captured program (:mod:`jvpreg.clone.program.capture`) is a ``torch.fx.GraphModule`` whose nodes call
``OpOverload`` s (``torch.ops.aten.sub.Tensor``). Calling one costs a Python frame (``OpOverload.__call__``)
and a boxed call that parses the arguments against the schema; on the small ops of a small model that is
most of the op's time. :func:`replay_function` writes ``gm.forward`` again with, per node, the cheapest
callable that runs the same operator:

* the op's generated Python binding (``torch.sub``, ``torch._C._nn.linear``, ``Tensor.view``): unboxed, cheaper
  per op than the handle (``docs/engine.md``);
* else the C++ operator handle ``op._op`` (what ``OpOverload.__call__`` calls when no Python
  dispatcher is attached): one Python frame less than the overload;
* jvpreg's own operators (:mod:`jvpreg.clone.rules.kernels`): the same forward, setup and backward as a plain
  ``autograd.Function`` (:data:`jvpreg.clone.rules.kernels.DIRECT`), without the custom-operator dispatch.

A binding picks its overload from the argument types at run time, so it is used for a node only when it
is *checked* to run the same thing. The program is walked once on ``meta`` tensors shaped like its inputs
(no data, no kernels); at each node the node's own arguments (tensors with their shapes, strides, dtypes,
and the node's constants) are sent once through the overload and once through the binding under a
dispatch mode that records every operator call below autograd, and the binding is kept only if both
record the same calls with the same arguments: the same overload, or for an op that decomposes above
autograd the same decomposition. Anything else (no binding, a failed or mismatched check, a node the
meta walk cannot run) keeps the handle. The program's inputs have fixed shapes and dtypes (the capture
guards them), so a node's check holds for every replay; verdicts are remembered per operator and
described arguments. ``gm`` itself keeps the ``OpOverload`` targets (``torch.compile`` reads them).

The check costs a meta walk once per captured program (meta kernels are Python; longest for programs of many
concatenations, such as DenseNet's).
"""
from __future__ import annotations

import operator
import re
import types
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from jvpreg.clone.rules import kernels

__all__ = ["replay_function"]

_OP_CALL = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_BINDING_HOMES = (torch._C._VariableFunctions, torch._C._nn)
_CHECKED: Dict[Any, Tuple[Optional[str], Any]] = {}  # (op, described arguments) -> the check's verdict


class _Recorder(TorchDispatchMode):
    """Records ``(operator, arguments)`` of every computing call that reaches the Python dispatch key."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim":  # metadata queries (prim.device): no computation
            self.calls.append((func, tree_map(_describe, (args, kwargs))))
        return func(*args, **kwargs)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
                value.requires_grad)
    return value


def _fresh(value: Any) -> Any:
    """A new meta tensor with ``value``'s shape, strides, offset and dtype (what the binding's run gets: an in-place
    op of the overload's run must not change what it sees)."""
    if not isinstance(value, torch.Tensor):
        return value
    size = value.storage_offset() + sum((n - 1) * st for n, st in zip(value.shape, value.stride())) + 1 \
        if value.numel() else value.storage_offset()
    return torch.empty(size, dtype=value.dtype, device="meta").as_strided(value.shape, value.stride(),
                                                                         value.storage_offset())


def _recorded(fn: Callable, args: tuple, kwargs: dict) -> Tuple[Optional[list], Any]:
    """The operator calls ``fn(*args, **kwargs)`` makes and its result, or ``(None, None)`` if it raises."""
    rec = _Recorder()
    try:
        with rec:
            out = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any failure just keeps the operator handle
        return None, None
    return rec.calls, out


def _binding(op: torch._ops.OpOverload) -> Tuple[Optional[str], Any]:
    """``("function", f)`` or ``("method", name)``: the generated Python binding named like ``op`` (aten ops only:
    ``torch.add`` is no binding of a library's ``mylib::add``)."""
    if op.namespace != "aten":
        return None, None
    name = op._schema.name.split("::")[-1]
    for home in _BINDING_HOMES:
        f = getattr(home, name, None)
        if f is not None:
            return "function", f
    args = op._schema.arguments
    if args and args[0].name == "self" and hasattr(torch._C.TensorBase, name):
        return "method", name
    return None, None


def _check(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Tuple[Tuple[Optional[str], Any], Any]:
    """``((kind, binding) or (None, None), the op's meta result)`` for one node's meta arguments. The arguments are
    described, and copied for the binding, before the op runs (it may change them in place)."""
    kind, binding = _binding(op)
    if kind is None:
        return (None, None), _recorded(op, args, kwargs)[1]
    try:
        key = (op, repr(tree_map(_describe, (args, kwargs))))
    except Exception:  # noqa: BLE001 - not describable: checked, not remembered
        key = None
    fresh = tree_map(_fresh, (args, kwargs))
    expected, out = _recorded(op, args, kwargs)
    if not expected:
        return (None, None), out
    if key is not None and key in _CHECKED:
        return _CHECKED[key], out
    fn = binding if kind == "function" else (lambda self, *a, **k: getattr(self, binding)(*a, **k))
    got, _ = _recorded(fn, *fresh)
    verdict = (kind, binding) if got == expected else (None, None)
    if key is not None:
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        _CHECKED[key] = verdict
    return verdict, out


def _checked_bindings(graph: torch.fx.Graph) -> Dict[Node, Tuple[str, Any]]:
    """Walk ``graph`` on meta tensors; the nodes whose binding passes the check (module docstring)."""
    env: Dict[Node, Any] = {}
    found: Dict[Node, Tuple[str, Any]] = {}

    def value(a):
        if isinstance(a, Node):
            v = env.get(a)
            if v is None:
                raise LookupError
            return v
        return a

    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = _meta_like(node)
                continue
            if node.op != "call_function":
                continue
            try:
                _walk(node, value, env, found)
            finally:
                if env.get(node) is None:  # an op meta tensors cannot run (one that reads its inputs' values):
                    env[node] = _meta_like(node)  # its recorded shapes, so the nodes after it are checked too
    return found


def _walk(node: Node, value: Callable, env: Dict[Node, Any], found: Dict[Node, Tuple[str, Any]]) -> None:
    """Run one node on meta tensors, recording its binding in ``found`` if the check passes."""
    try:
        args, kwargs = map_aggregate((node.args, node.kwargs), value)
    except LookupError:  # an input the walk could not make
        return
    if node.target is operator.getitem:
        env[node] = args[0][args[1]] if isinstance(args[0], (tuple, list)) else None
        return
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or getattr(op, "_pyobj_dispatcher", None) is not None:
        return
    if not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
        return  # a factory op: a device context would change what the binding makes
    (kind, binding), env[node] = _check(op, tuple(args), dict(kwargs))
    if kind is not None:
        found[node] = (kind, binding)


def _meta_like(node: Node) -> Any:
    """Meta tensors shaped like the value ``node`` recorded (``None`` where it recorded none)."""
    def meta(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v

    v = node.meta.get("val")
    return None if v is None else tree_map(meta, v)


def _stand_in(binding: Callable, stubs: Dict[Callable, Any]) -> Callable:
    """A named Python function that FX can write into the code (it cannot name every binding: ``torch.__and__``);
    the binding replaces it in the code's globals."""
    for stub, b in stubs.items():
        if b is binding:
            return stub

    def stub(*args, **kwargs):  # pragma: no cover - replaced by the binding before the code runs
        raise AssertionError("jvpreg replay: a stand-in was called")

    stub.__name__ = stub.__qualname__ = binding.__name__.strip("_") or "op"
    stubs[stub] = binding
    return stub


def replay_function(gm: GraphModule) -> Callable:
    """``gm.forward`` with each node's op called through its cheapest checked entry point (module docstring)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    stubs: Dict[Callable, Any] = {}
    for node, (kind, binding) in _checked_bindings(graph).items():
        if kind == "function":
            node.target = _stand_in(binding, stubs)
        else:
            node.op, node.target = "call_method", binding
    code = graph.python_code(root_module="self")
    env = {k: stubs.get(v, v) for k, v in code.globals.items()}

    def handle(match):
        ns, name, overload = match.groups()
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        if op in kernels.DIRECT:  # jvpreg's operators: their autograd.Function, no custom-operator dispatch
            key = f"_direct_{name}"
            env[key] = kernels.DIRECT[op]
            return key + "("
        if not isinstance(op, torch._ops.OpOverload) or getattr(op, "_pyobj_dispatcher", None) is not None:
            return match.group(0)
        key = f"_op_{ns}_{name}_{overload}"
        env[key] = op._op
        return key + "("

    src = _OP_CALL.sub(handle, code.src)
    exec(compile(src, f"<jvpreg replay {id(gm):x}>", "exec"), env)  # noqa: S102 - our own generated code
    return types.MethodType(env["forward"], gm)
