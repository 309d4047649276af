"""Value guards of a captured program: tensor values that Python read while the program was recorded.

A clone forward recorded by :mod:`jvpreg.clone.program.capture` runs its Python once. Where that Python reads a
tensor's *value* (``if mask.all():``, ``n = lengths.max().item()``, ``x.tolist()``, ``x.numpy()``), the value
steers the recorded path or is baked into it as a constant, so the program is exact only for calls that
read the same value. :class:`ValueReads` catches every such read while a capture runs, answers it with the
real value, and remembers the tensor and the value; :func:`split` moves the ops that compute those tensors
into a separate *guard program*, and :class:`Guard` runs it before each replay and compares:

    replay allowed  <=>  guard(inputs)[i].tolist() == value_i  for every read i  (NaN == NaN).

A changed value sends the call to another program recorded for it (:mod:`jvpreg.clone.program.capture` keeps a few
per call signature) or records a new one. Hugging Face models read their attention mask this way
(``padding_mask.all()`` decides whether SDPA gets a mask); the guard costs the few small ops of that
check, which the eager model runs too.

A guard is sound only if recomputing its tensors before the replay gives the values the read saw. The guard
program holds the ops that compute them and every in-place write into what those ops read made before they
read it (a Mixture-of-Experts layer's ``out.index_add_(...)``, whose result the next layer routes on; alias
classes, :func:`jvpreg.clone.program.passes.analysis.alias_classes`, follow views). It cannot hold a random draw, a write into
an input (a BatchNorm buffer updated in place: the guard would update it before the replay does), or a write
into the read tensor after the read (which value did Python see?). Those make the capture fail with
:class:`~jvpreg.clone.program.capture.CaptureError` and the call run in eager clone mode, as does a read the tracer
cannot answer here (a value read inside a C++ op: ``torch.full(shape, t)`` with a tensor ``t``).

The guard program checks each read as soon as it computes it and stops at the first that differs
(:class:`GuardMismatch`): the ops after a differing shape hold the recorded sizes and would fail, or
broadcast, on other ones. Which ops make a shape depend on values: those torch tags so, a few it does not
(``nonzero``, ``one_hot(num_classes=-1)``, ...), and a composite op the pre-dispatch tracer keeps whole
(``torch.where(c)``) whose decomposition, run on fake tensors, calls one of them. Checked over PyTorch's op
database: every op whose output shape changed with its inputs' values there is guarded
(:func:`op_sweep.value_shaped`, ``tests/clone/test_opinfo_sweep.py``).
A read of a tensor the trace does not track (a constant made outside the forward) is not guarded: such
tensors are the program's constants.
"""
from __future__ import annotations

import contextlib
import math
import operator
import types
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from jvpreg.clone.core import tensor as _tensor
from jvpreg.clone.program.passes.analysis import METADATA_ONLY, alias_classes, pure, written
from jvpreg.clone.program.passes.cleanup import drop_dead
from jvpreg.clone.core.errors import CaptureError

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


class GuardMismatch(Exception):
    """Raised inside a guard program at the first read whose value or shape differs from the recorded one."""

    def __init__(self, index: int, got: Any):
        super().__init__(index, got)
        self.index, self.got = index, got


_UNREAD = "<not read: an earlier value differed>"


def _checker(expected: Sequence[Tuple[str, Any]]) -> Callable:
    """The check a guard program calls on read ``i`` as soon as it is computed: a differing shape or value stops
    the program there (the ops after it hold the recorded shapes and could fail or broadcast on others)."""
    def guard_check(t: torch.Tensor, i: int) -> None:
        kind, value = expected[i]
        got = tuple(t.shape) if kind == "shape" else t.tolist()
        if not same(got, value):
            raise GuardMismatch(i, got)

    return guard_check


class Guard:
    """The guard program of a captured program and what it must reproduce (module docstring): per output, a
    value (``("value", nested list)``) or, for an op whose output shape depends on its input's values, a shape
    (``("shape", tuple)``). The program checks each one as soon as it computes it (:func:`split`)."""

    def __init__(self, fn: Callable, expected: Sequence[Tuple[str, Any]], names: Sequence[str]):
        self.fn, self.expected, self.names = fn, tuple(expected), tuple(names)

    def read(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """What the guard program gives for ``inputs``: per output its value (nested list) or its shape; past
        the first one that differs from the recorded one, a marker that it was not read."""
        try:
            with torch.no_grad():
                self.fn(*inputs)
        except GuardMismatch as miss:  # the reads before it held their recorded values
            return tuple(v for _, v in self.expected[:miss.index]) + (miss.got,) + \
                (_UNREAD,) * (len(self.expected) - miss.index - 1)
        return tuple(v for _, v in self.expected)  # every check passed: each read saw its recorded value

    def matches(self, got: tuple) -> bool:
        """``got`` (from :meth:`read`) is what the program was recorded for."""
        return all(same(g, v) for g, (_, v) in zip(got, self.expected))

    def holds(self, inputs: Sequence[torch.Tensor]) -> bool:
        return self.matches(self.read(inputs))


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


def _why_not_replayable(node: torch.fx.Node, classes: dict, inputs: set) -> Optional[str]:
    """Why a guard program cannot run ``node`` again and get its recorded result, or ``None`` when it can: a pure
    op, or a deterministic write into a tensor the program made (not into an input: the guard would change it
    before the replay)."""
    if node.op != "call_function" or node.target in METADATA_ONLY or pure(node.target):
        return None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return f"computed by {getattr(target, '__name__', target)}, which a guard program cannot run again"
    if torch.Tag.nondeterministic_seeded in target.tags:
        return f"computed from what the forward draws at random ({target})"
    targets = list(written(node))
    if not targets and not target._schema.is_mutable:  # a batch norm in eval mode
        return None
    if targets and all(classes[w] not in inputs for w in targets):
        return None
    return f"computed from an input or buffer that the forward changes in place ({target})"


def split(gm: torch.fx.GraphModule, expected: Sequence[Tuple[str, Any]], names: Sequence[str]) -> torch.fx.GraphModule:
    """Move the last ``len(expected)`` outputs of ``gm`` (the tensors Python read) into a new program of their
    own ops, in place; return it. The new program checks each read against ``expected`` as soon as it computes
    it and raises :class:`GuardMismatch` at the first that differs. Raises
    :class:`~jvpreg.clone.program.capture.CaptureError` if recomputing them first would not give the values the reads
    saw (module docstring)."""

    n = len(expected)

    graph = gm.graph
    out = next(node for node in reversed(graph.nodes) if node.op == "output")
    results = list(out.args[0])
    reads, kept = results[len(results) - n:], results[:len(results) - n]
    order = {node: i for i, node in enumerate(graph.nodes)}
    classes = alias_classes(graph)
    writes: dict = {}  # alias class -> the ops that write into it
    for node in graph.nodes:
        if node.op == "call_function":
            for w in written(node):
                writes.setdefault(classes[w], []).append(node)
    needed, todo = set(), [r for r in reads if isinstance(r, torch.fx.Node)]
    while todo:  # the reads' ops, and every write into what they read made before they read it
        node = todo.pop()
        if node in needed:
            continue
        needed.add(node)
        for a in node.all_input_nodes:
            todo.append(a)
            todo.extend(w for w in writes.get(classes[a], ()) if order[w] < order[node])
    inputs = {classes[node] for node in graph.nodes if node.op in ("placeholder", "get_attr")}
    what = ", ".join(sorted(set(names)))
    for r in reads:
        if isinstance(r, torch.fx.Node) and any(order[w] > order[r] for w in writes.get(classes[r], ())):
            raise CaptureError(f"its Python code reads tensor values ({what}) of a tensor that the forward changes "
                               "in place after it is made, so a guard cannot tell which value the read saw")
    for node in (n for n in graph.nodes if n in needed):
        why = _why_not_replayable(node, classes, inputs)
        if why:
            raise CaptureError(f"its Python code reads tensor values ({what}) {why}, so they cannot be re-checked "
                               "before a replay")
    sub = torch.fx.Graph()
    env = {}
    check, checks = _checker(expected), {}
    for i, r in enumerate(reads):
        checks.setdefault(r, []).append(i)
    pending = []  # reads of the inputs themselves: checked once every input is declared
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = sub.placeholder(node.name)
            pending.append(node)
            continue
        for p in pending:
            for i in checks.get(p, ()):
                sub.call_function(check, (env[p], i))
        pending = []
        if node in needed:
            env[node] = sub.node_copy(node, env.__getitem__)
            for i in checks.get(node, ()):
                sub.call_function(check, (env[node], i))
    sub.output(tuple(env[r] for r in reads))
    guard = torch.fx.GraphModule(gm, sub)
    out.args = (type(out.args[0])(kept),)
    drop_dead(graph)
    gm.recompile()
    return guard
