"""Callables as users pass them, taken apart so that the captured engine can record them.

``jvpreg.jvp(partial(model, y=c), (z, t, r), (v, 1, 0))`` and ``jvpreg.jvp(lambda z, t: model(z, t, y=c), ...)`` are
how JVP-training code (mean-flow and consistency models) calls a JVP; the lambda or partial is often made anew at
every step, around new conditioning tensors. :func:`take_apart` splits such a callable into

* its **structure**, hashable: code objects, the names and plain values (numbers, strings, flags, dtypes) it
  closes over or reads from its globals, which modules it reaches, the keywords of a partial. Two callables of
  the same structure record the same program: the structure names the program (the ``key`` of
  :func:`jvpreg.clone.program.capture.call`), so a lambda made anew at every step replays what its first instance recorded;
* its **values**: the tensors, containers and other objects it closes over, binds or reads from its globals.
  They become *inputs* of the program, passed with the primals, so the capture's own guards see them as it sees
  a module's arguments (shape, dtype, device, ``requires_grad``, finiteness; containers by structure; objects by
  identity, with the attributes the forward reads re-checked). A new conditioning tensor of the same shape replays
  the program on its values; a tensor of another shape or dtype records another program;
* the **module** that holds every ``nn.Module`` it reaches (their parameters and buffers are the program's
  parameter slots, guarded as a module's are): the one module, or one that holds the others.

:meth:`Parts.rebuild` makes the callable again from values (inside the capture: from the traced ones).

Taken apart: ``nn.Module`` s, functions and lambdas (closure cells, defaults, and the globals their code reads,
nested functions' too), ``functools.partial`` (function, arguments, keywords), bound methods of modules and of
other objects, torch's own functions. What cannot be taken apart (an object whose ``__call__`` holds modules or
tensors where no guard sees them, an empty closure cell, a callable past :data:`MAX_DEPTH` levels) gives a
reason: :func:`jvpreg.jvp` then runs the call eagerly, exact, with one :class:`JVPCaptureWarning` that names
it and says to pass the model (a module) instead.

Why not Dynamo: its guards and closure handling would cover the Python around the model, but it must trace the
clone engine's own Python too, and a clone batch reports its primal's shape, which fake tensors cannot express
(:mod:`jvpreg.clone.program.capture`). Here only the *callable's* Python is taken apart, once per call; what runs inside
is recorded by the same tracer and guarded by the same guards as a module's forward.
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["Parts", "take_apart", "MAX_DEPTH"]

MAX_DEPTH = 8  # nested functions and partials followed this deep
_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)
_GLOBAL_NAMES: Dict[types.CodeType, Tuple[str, ...]] = {}


def _plain(value: Any) -> bool:
    return type(value) in _PLAIN or (type(value) is tuple and all(_plain(v) for v in value))


@dataclasses.dataclass
class Parts:
    """A callable taken apart: ``structure`` (hashable), ``values`` (the program's extra inputs), ``module`` (holds
    every module reached; ``None`` if none), ``reason`` (why it cannot be taken apart; then the rest is empty)."""

    structure: Any = None
    values: List[Any] = dataclasses.field(default_factory=list)
    module: Optional[nn.Module] = None
    reason: str = ""
    _build: Optional[Callable[[Sequence[Any]], Callable]] = None

    def rebuild(self, values: Sequence[Any]) -> Callable:
        """The callable again, with ``values`` (in the order of :attr:`values`) in place of its own."""
        return self._build(values)


class _Refused(Exception):
    pass


class _Walk:
    """One walk over a callable: collects values and modules, returns (structure, builder) per node."""

    def __init__(self):
        self.values: List[Any] = []
        self.modules: List[nn.Module] = []

    def value(self, v: Any) -> Tuple[Any, Callable]:
        i = len(self.values)
        self.values.append(v)
        return ("value", i), (lambda vals: vals[i])

    def module(self, m: nn.Module) -> Tuple[Any, Callable]:
        for i, known in enumerate(self.modules):
            if known is m:
                break
        else:
            i = len(self.modules)
            self.modules.append(m)
        return ("module", i), (lambda vals: m)

    def item(self, v: Any, depth: int) -> Tuple[Any, Callable]:
        """A value a callable holds: plain values by value, modules and callables taken apart, the rest an input."""
        if _plain(v):
            return ("const", v), (lambda vals: v)
        if isinstance(v, nn.Module):
            return self.module(v)
        if isinstance(v, (types.FunctionType, functools.partial, types.MethodType)):
            return self.callable(v, depth + 1)
        if isinstance(v, (types.BuiltinFunctionType, types.ModuleType, type)) or type(v).__module__ == "torch._ops":
            return ("const", id(v), v), (lambda vals: v)  # torch.sin, a module, a class: what the code names
        if _holds_unseen(v):
            raise _Refused(f"it holds a {type(v).__name__} whose modules or tensors no guard would see")
        return self.value(v)

    def callable(self, fn: Any, depth: int = 0) -> Tuple[Any, Callable]:
        if depth > MAX_DEPTH:
            raise _Refused(f"its callables are nested more than {MAX_DEPTH} levels deep")
        if isinstance(fn, nn.Module):
            return self.module(fn)
        if isinstance(fn, functools.partial):
            f_s, f_b = self.callable(fn.func, depth + 1)
            a = [self.item(v, depth) for v in fn.args]
            names = tuple(fn.keywords)
            k = [self.item(fn.keywords[n], depth) for n in names]

            def build_partial(vals):
                return functools.partial(f_b(vals), *(b(vals) for _, b in a),
                                         **{n: b(vals) for n, (_, b) in zip(names, k)})

            return ("partial", f_s, tuple(s for s, _ in a), names, tuple(s for s, _ in k)), build_partial
        if isinstance(fn, types.MethodType):
            owner = fn.__self__
            s_self, b_self = (self.module(owner) if isinstance(owner, nn.Module) else self.item(owner, depth))
            s_fn, b_fn = self.callable(fn.__func__, depth + 1)
            return ("method", s_self, s_fn), (lambda vals: types.MethodType(b_fn(vals), b_self(vals)))
        if isinstance(fn, types.FunctionType):
            return self.function(fn, depth)
        if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)) or type(fn).__module__ == "torch._ops":
            return ("const", id(fn), fn), (lambda vals: fn)
        call = getattr(type(fn), "__call__", None)
        if isinstance(call, types.FunctionType) and not _holds_unseen(fn):
            s_fn, b_fn = self.callable(call, depth + 1)  # a callable object: its __call__, bound to it
            s_self, b_self = self.item(fn, depth) if not _plain(fn) else (("const", fn), lambda vals: fn)
            return ("object-call", s_self, s_fn), (lambda vals: types.MethodType(b_fn(vals), b_self(vals)))
        raise _Refused(f"it is a {type(fn).__name__} whose state no guard would see")

    def function(self, fn: types.FunctionType, depth: int) -> Tuple[Any, Callable]:
        code = fn.__code__
        cells = []
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:
                raise _Refused(f"its closure cell {name!r} is empty (a function that refers to itself?)") from None
            cells.append(self.item(content, depth))
        defaults = [self.item(v, depth) for v in (fn.__defaults__ or ())]
        kw_names = tuple(fn.__kwdefaults__ or ())
        kwdefaults = [self.item(fn.__kwdefaults__[n], depth) for n in kw_names]
        g = fn.__globals__
        read = [(n, g[n]) for n in _global_names(code) if n in g and not _library_value(g[n])]
        globs = [(n, self.item(v, depth)) for n, v in read]

        def build(vals):
            closure = tuple(types.CellType(b(vals)) for _, b in cells) if cells else fn.__closure__
            new_g = g
            if globs:
                new_g = dict(g)  # a copy: the rebuilt function reads the traced values; the module's stay as they are
                new_g.update((n, b(vals)) for n, (_, b) in globs)
            new = types.FunctionType(code, new_g, fn.__name__, tuple(b(vals) for _, b in defaults) or None, closure)
            if kw_names:
                new.__kwdefaults__ = {n: b(vals) for n, (_, b) in zip(kw_names, kwdefaults)}
            new.__qualname__ = fn.__qualname__
            return new

        return ("function", code, tuple(s for s, _ in cells), tuple(s for s, _ in defaults), kw_names,
                tuple(s for s, _ in kwdefaults), tuple((n, s) for n, (s, _) in globs)), build


def _global_names(code: types.CodeType) -> Tuple[str, ...]:
    """The global names ``code`` (and the code nested in it: comprehensions, inner functions) loads."""
    names = _GLOBAL_NAMES.get(code)
    if names is None:
        found: List[str] = []
        stack = [code]
        while stack:
            c = stack.pop()
            found.extend(i.argval for i in dis.get_instructions(c)
                         if i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and i.argval not in found)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        names = _GLOBAL_NAMES[code] = tuple(found)
    return names


def _library_value(v: Any) -> bool:
    """A global that is part of the code, not of its state: an imported module, a class, a library function."""
    if isinstance(v, (types.ModuleType, type)):
        return True
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType)):
        mod = getattr(v, "__module__", None) or ""
        return mod.split(".")[0] in ("torch", "jvpreg", "functools", "math", "operator", "numpy", "einops",
                                     "builtins", "typing")
    return False


def _holds_unseen(obj: Any) -> bool:
    """Whether an object other than a container holds a module or tensor among its fields (a wrapper around the
    model): passed as an input it would be guarded by identity, and its module's parameters baked into the program."""
    if isinstance(obj, (torch.Tensor, list, tuple, dict)) or _plain(obj):
        return False
    fields = getattr(obj, "__dict__", None)
    if not isinstance(fields, dict):
        return False
    return any(_holds_tensor(v, 2) for v in fields.values())


def _holds_tensor(value: Any, depth: int) -> bool:
    """A module or tensor in ``value`` or in the lists, tuples and dicts it holds (``depth`` levels down)."""
    if isinstance(value, (nn.Module, torch.Tensor)):
        return True
    if depth <= 0 or not isinstance(value, (list, tuple, dict)):
        return False
    items = value.values() if isinstance(value, dict) else value
    return any(_holds_tensor(v, depth - 1) for v in list(items)[:256])


_HOLDERS: Dict[Tuple[int, ...], "Holder"] = {}
_MAX_HOLDERS = 8
_FREE: Dict[Any, "Holder"] = {}  # module-free callables: a holder per code object (or torch function)


class Holder(nn.Module):
    """The module the capture guards for a callable that reaches several modules (or none): it holds them as its
    children, so their parameters and buffers are the program's slots."""

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        self.reached = nn.ModuleList(modules)


def _root(modules: List[nn.Module], structure: Any) -> nn.Module:
    """One module that holds every module of ``modules``: the one that contains the others, else a :class:`Holder`
    (kept for the last :data:`_MAX_HOLDERS` sets of modules; with no module, one per code object)."""
    if len(modules) == 1:
        return modules[0]
    for m in modules:
        inside = {id(s) for s in m.modules()}
        if all(id(o) in inside for o in modules):
            return m
    if not modules:
        code = _first_code(structure)
        holder = _FREE.get(code)
        if holder is None:
            holder = _FREE[code] = Holder([])
        return holder
    key = tuple(map(id, modules))
    holder = _HOLDERS.get(key)
    if holder is None or any(a is not b for a, b in zip(holder.reached, modules)):
        if len(_HOLDERS) >= _MAX_HOLDERS:
            _HOLDERS.pop(next(iter(_HOLDERS)))
        holder = _HOLDERS[key] = Holder(modules)
    return holder


def _first_code(structure: Any) -> Any:
    """What names a module-free callable's holder: its first code object, else its first torch function."""
    stack = [structure]
    while stack:
        s = stack.pop()
        if isinstance(s, types.CodeType) or (callable(s) and not isinstance(s, type)):
            return s
        if isinstance(s, tuple):
            stack.extend(reversed(s))
    return None


def take_apart(fn: Callable) -> Parts:
    """``fn`` as :class:`Parts` (see the module docstring); ``Parts.reason`` says why it cannot be taken apart."""
    walk = _Walk()
    try:
        structure, build = walk.callable(fn)
        hash(structure)
    except _Refused as why:
        return Parts(reason=str(why))
    except TypeError:  # an unhashable constant: cannot name a program
        return Parts(reason="a value it closes over cannot name a program (unhashable constant)")
    return Parts(structure, walk.values, _root(walk.modules, structure), "", build)
