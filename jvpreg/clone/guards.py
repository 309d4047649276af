"""Value guards of a captured program: tensor values that Python read while the program was recorded.

A clone forward recorded by :mod:`jvpreg.clone.capture` runs its Python once. Where that Python reads a
tensor's *value* (``if mask.all():``, ``n = lengths.max().item()``, ``x.tolist()``, ``x.numpy()``), the value
steers the recorded path or is baked into it as a constant, so the program is exact only for calls that
read the same value. :class:`ValueReads` catches every such read while a capture runs, answers it with the
real value, and remembers the tensor and the value; :func:`split` moves the ops that compute those tensors
into a separate *guard program*, and :class:`Guard` runs it before each replay and compares:

    replay allowed  <=>  guard(inputs)[i].tolist() == value_i  for every read i  (NaN == NaN).

A changed value sends the call to another program recorded for it (:mod:`jvpreg.clone.capture` keeps a few
per call signature) or records a new one. Hugging Face models read their attention mask this way
(``padding_mask.all()`` decides whether SDPA gets a mask); the guard costs the few small ops of that
check, which the eager model runs too.

A guard is sound only if recomputing its tensors before the replay gives the values the read saw: every op
on the way must be pure (no in-place write, no random draw) and nothing the way reads may be written by
the program (a BatchNorm buffer updated in place, an input changed in place). Otherwise the capture fails
with :class:`~jvpreg.clone.capture.CaptureError` and the call runs in eager clone mode, as does a read the
tracer cannot answer here (a value read inside a C++ op: ``torch.full(shape, t)`` with a tensor ``t``).
A read of a tensor the trace does not track (a constant made outside the forward) is not guarded: such
tensors are the program's constants.
"""
from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode

from . import tensor as _tensor
from .passes import _METADATA_ONLY, _drop_dead, _last_writes, _pure

__all__ = ["Guard", "ValueReads", "dynamic_shapes", "split"]

#: Tensor methods that hand a tensor's value to Python (``tolist``, ``numpy``, ``__array__`` and ``__dlpack__`` read
#: memory directly, without an op the tracer would see: before these guards, a ``tolist()`` was silently baked in).
READS = ("item", "tolist", "numpy", "__array__", "__dlpack__", "__bool__", "__int__", "__float__", "__index__",
         "__complex__")


class ValueReads:
    """While active (one capture): every read of a traced tensor's value through :data:`READS` is answered with
    the real value and remembered as ``(tensor, value)``, the tensor being the plain traced one (the primal block,
    for a clone, which is what eager clone mode reads)."""

    def __init__(self, tracer: Any):
        self.tracer = tracer
        self.tensors: List[torch.Tensor] = []
        self.values: List[Any] = []
        self.names: List[str] = []
        self._ids: dict = {}

    @contextlib.contextmanager
    def active(self) -> Iterator["ValueReads"]:
        saved = {name: torch.Tensor.__dict__.get(name) for name in READS}
        originals = {name: getattr(torch.Tensor, name) for name in READS}
        try:
            for name in READS:
                setattr(torch.Tensor, name, self._reader(name, originals[name], originals["tolist"]))
            with _ScalarArguments(self):
                yield self
        finally:
            for name, value in saved.items():
                if value is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, value)

    def _traced(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The plain traced tensor whose value a read of ``t`` gives, or ``None`` if ``t`` is not traced."""
        from torch.fx.experimental.proxy_tensor import get_proxy_slot

        if type(t) is _tensor.CloneTensor:
            with DisableTorchFunctionSubclass():
                t = _tensor._tracked_phys(t).select(0, 0)
        elif type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return None  # another subclass answers its own reads
        return t if get_proxy_slot(t, self.tracer, None) is not None else None

    def _reader(self, name: str, original: Callable, tolist: Callable) -> Callable:
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        def read(t, *args, **kwargs):
            plain = self._traced(t) if isinstance(t, torch.Tensor) else None
            if plain is None:
                return original(t, *args, **kwargs)
            with disable_proxy_modes_tracing():
                value = original(plain, *args, **kwargs)
                if id(plain) not in self._ids:
                    self._ids[id(plain)] = len(self.tensors)
                    self.tensors.append(plain)
                    self.values.append(tolist(plain.detach()))
                    self.names.append(f"Tensor.{name}")
            return value

        read.__name__ = name
        return read


_C_FUNCTIONS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                types.MethodWrapperType)


class _ScalarArguments(TorchFunctionMode):
    """A one-element tensor passed where a number is expected (``torch.zeros(n, batch_sizes[0], h)`` in
    ``nn.LSTM`` on a packed sequence) is read inside the C++ call, where :class:`ValueReads` cannot answer: the
    tracer refuses it before the op runs. Such a call is made again with those tensors read first (and guarded):
    only a C function's (its arguments are parsed before it does anything); a Python function may have written
    something before the refused read, and runs once."""

    def __init__(self, reads: ValueReads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if "tracing tensor" not in str(err) or not isinstance(func, _C_FUNCTIONS):
                raise
            first = err
        for skip_first in (True, False):  # a size argument, else also the first one (``torch.arange(n)``)
            converted = self._numbers(args[1:] if skip_first else args, kwargs)
            if converted is None:
                continue
            new_args, new_kwargs = converted
            try:
                return func(*((args[0],) if skip_first and args else ()), *new_args, **new_kwargs)
            except RuntimeError as err:
                if "tracing tensor" not in str(err):
                    raise
        raise first

    def _numbers(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        """``(args, kwargs)`` with every one-element traced tensor in them read as a Python number; ``None`` if
        there is none."""
        found = [False]

        def convert(v):
            if isinstance(v, (list, tuple)):
                return type(v)(convert(e) for e in v)
            if isinstance(v, torch.Tensor) and v.numel() == 1 and self.reads._traced(v) is not None:
                found[0] = True
                return v.item() if v.is_floating_point() or v.is_complex() else int(v)
            return v

        out = (tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()})
        return out if found[0] else None


def same(a: Any, b: Any) -> bool:
    """``a == b`` for nested lists of numbers, with NaN equal to NaN."""
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if a == b:
        return True
    return isinstance(a, (float, complex)) and isinstance(b, (float, complex)) and _nan(a) and _nan(b)


def _nan(v: Any) -> bool:
    return math.isnan(v.real) or math.isnan(v.imag) if isinstance(v, complex) else math.isnan(v)


class Guard:
    """The guard program of a captured program and what it must reproduce (module docstring): per output, a
    value (``("value", nested list)``) or, for an op whose output shape depends on its input's values, a shape
    (``("shape", tuple)``)."""

    def __init__(self, fn: Callable, expected: Sequence[Tuple[str, Any]], names: Sequence[str]):
        self.fn, self.expected, self.names = fn, tuple(expected), tuple(names)

    def read(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """What the guard program gives for ``inputs``: per output its value (nested list) or its shape."""
        with torch.no_grad():
            outs = self.fn(*inputs)
        return tuple(tuple(o.shape) if kind == "shape" else o.tolist() for o, (kind, _) in zip(outs, self.expected))

    def matches(self, got: tuple) -> bool:
        """``got`` (from :meth:`read`) is what the program was recorded for."""
        return all(same(g, v) for g, (_, v) in zip(got, self.expected))

    def holds(self, inputs: Sequence[torch.Tensor]) -> bool:
        return self.matches(self.read(inputs))


_ALWAYS_DYNAMIC = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default, torch.ops.aten._unique.default,
                   torch.ops.aten._unique2.default, torch.ops.aten.unique_consecutive.default,
                   torch.ops.aten.unique_dim.default, torch.ops.aten.bincount.default}


def _dynamic_shape(node: torch.fx.Node) -> bool:
    """``node``'s output shape depends on its inputs' values (``nonzero``, ``x[mask]``, ``unique``, ...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in _ALWAYS_DYNAMIC:
        return True
    if target is torch.ops.aten.index.Tensor:  # a boolean mask among the indices
        indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
        return any(isinstance(i, torch.fx.Node) and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
                   for i in indices)
    if target is torch.ops.aten.one_hot.default:  # num_classes=-1: from the largest value
        return (node.args[1] if len(node.args) > 1 else node.kwargs.get("num_classes", -1)) == -1
    if target is torch.ops.aten.repeat_interleave.Tensor:
        return node.kwargs.get("output_size") is None
    return torch.Tag.dynamic_output_shape in target.tags  # an op added later: assume so


def dynamic_shapes(graph: torch.fx.Graph) -> List[torch.fx.Node]:
    """The nodes of ``graph`` whose output shape depends on values, with the shape each had when recorded: the
    program holds those shapes (in the sizes of later ops) and is exact only for calls that reproduce them."""
    return [(node, tuple(node.meta["val"].shape)) for node in graph.nodes
            if _dynamic_shape(node) and isinstance(node.meta.get("val"), torch.Tensor)]


def split(gm: torch.fx.GraphModule, n: int, names: Sequence[str]) -> torch.fx.GraphModule:
    """Move the last ``n`` outputs of ``gm`` (the tensors Python read) into a new program of their own ops, in
    place; return it. Raises :class:`~jvpreg.clone.capture.CaptureError` if recomputing them first would not
    give the values the reads saw (module docstring)."""
    from .capture import CaptureError

    graph = gm.graph
    out = next(node for node in reversed(graph.nodes) if node.op == "output")
    results = list(out.args[0])
    reads, kept = results[len(results) - n:], results[:len(results) - n]
    needed, todo = set(), [r for r in reads if isinstance(r, torch.fx.Node)]
    while todo:
        node = todo.pop()
        if node in needed:
            continue
        needed.add(node)
        todo.extend(node.all_input_nodes)
    written = _last_writes(graph)
    for node in needed:
        if node.op == "call_function" and not (_pure(node.target) or node.target in _METADATA_ONLY) or node in written:
            what = ", ".join(sorted(set(names)))
            raise CaptureError(f"its Python code reads tensor values ({what}) computed from a tensor that the forward "
                               "changes in place or draws at random, so they cannot be re-checked before a replay")
    sub = torch.fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = sub.placeholder(node.name)
        elif node in needed:
            env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[r] for r in reads))
    guard = torch.fx.GraphModule(gm, sub)
    out.args = (type(out.args[0])(kept),)
    _drop_dead(graph)
    gm.recompile()
    return guard
