"""The one rule registry of the clone engine.

A *handler* is ``handler(func, args, kwargs) -> output`` and is called with the subclass'
torch-function disabled, so every :class:`~jvpreg.clone.core.tensor.CloneTensor` argument
behaves as its physical ``(K, *L)`` tensor (block 0 = primal, blocks 1.. = tangents).
Handlers return *physical* tensors, which the dispatcher wraps back into clones.

The table maps each torch function (and ATen overload) to its handler; :func:`register_handler` and
:func:`register_op` fill it, :func:`bind_arguments` binds a call's arguments by the op's own signature, and
:func:`rule_for` reads it. Rules by kind (a rule written on blocks, a state op) register through
:mod:`jvpreg.clone.rules.kinds`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Dict, Iterable

import torch


Handler = Callable[[Callable, tuple, dict], Any]

class Handlers(dict):
    """The registry's table, op -> handler, with a ``version`` that every change bumps: a captured program is
    recorded under the version of the rules it ran (:func:`jvpreg.clone.program.capture.call`), so a rule registered,
    replaced or removed later records the program again."""

    version = 0

    def _bump(self):
        Handlers.version += 1

    def __setitem__(self, key, value):
        self._bump()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._bump()
        super().__delitem__(key)

    def pop(self, *args):
        self._bump()
        return super().pop(*args)

    def update(self, *args, **kwargs):
        self._bump()
        super().update(*args, **kwargs)

    def clear(self):
        self._bump()
        super().clear()

    def setdefault(self, key, default=None):
        self._bump()
        return super().setdefault(key, default)


HANDLERS: Dict[Any, Handler] = Handlers()
REENTRANT: set = set()  # handlers that run with torch-function enabled (decompositions)
#: ops whose handler is exact on complex clones whatever their number (linear in every argument: add, cat...) or
#: written for them (abs); other handlers see complex tangents only where :func:`dispatch.complex_exact` allows
COMPLEX_EXACT: set = set()
#: ops whose handler is affine in a single varying argument, complex or real (``mul``: ``c * z``)
COMPLEX_AFFINE: set = set()
#: modules whose handlers are affine in a single varying argument (shape ops, indexing, sums, fills): exact on one
#: complex clone argument (the ops registered by :func:`jvpreg.clone.rules.kinds.linear` are in :data:`COMPLEX_AFFINE`)
COMPLEX_AFFINE_MODULES = frozenset({"jvpreg.clone.rules.shape", "jvpreg.clone.rules.linear"})


def op_name(func: Any) -> str:
    """A valid Python name for a torch function, e.g. ``torch.nn.functional.relu``, ``torch.atan``,
    ``torch.Tensor.relu_``, ``torch.ops.mylib.op.default``."""
    import torch.nn.functional as F

    if isinstance(func, torch._ops.OpOverload):
        ns, rest = str(func).split(".", 1)
        return f"torch.ops.{ns}.{rest}"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return f"torch.ops.{func._qualified_op_name.replace('::', '.')}"
    self_obj = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and type(self_obj).__name__ == "getset_descriptor":
        return f"torch.Tensor.{self_obj.__name__} (attribute)"
    if getattr(func, "function_cls", None) is not None:
        cls = func.function_cls
        return f"{cls.__module__}.{cls.__qualname__}.apply"
    name = getattr(func, "__name__", None)
    if name:
        for prefix, ns in (("torch", torch), ("torch.nn.functional", F), ("torch.Tensor", torch.Tensor),
                           ("torch._C._nn", torch._C._nn), ("torch.special", torch.special),
                           ("torch.linalg", torch.linalg), ("torch.fft", torch.fft)):
            if getattr(ns, name, None) is func:
                return f"{prefix}.{name}"
    qual = getattr(func, "__qualname__", None) or name or repr(func)
    return f"{getattr(func, '__module__', None) or 'torch'}.{qual}"


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NO_DEFAULT = inspect.Parameter.empty
#: numpy-style spellings torch's argument parser accepts for its own names (``x.sum(axis=1, keepdims=True)``)
_PARSER_ALIASES = {"axis": "dim", "keepdims": "keepdim"}
#: parameters that stay keywords: torch's argument parser takes the tensor options by keyword only where the schema
#: lists them among the positional ones, and ``inplace`` is read by name (:func:`register_rule`)
_KEPT_KEYWORDS = frozenset({"memory_format", "layout", "pin_memory", "generator", "out", "inplace"})


@dataclasses.dataclass(frozen=True)
class Overload:
    """One signature of an op: its positional parameters ``(name, default)`` in order (``default`` is
    :data:`inspect.Parameter.empty` where there is none) and the names it takes by keyword only."""
    positional: tuple
    keyword_only: frozenset


_OVERLOADS: Dict[Any, tuple] = {}
_PLANS: Dict[Any, Any] = {}


def _from_signature(fn: Any) -> Overload | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None  # ``x.repeat(*sizes)``: a Python varargs lambda says nothing of the keyword form
    return Overload(tuple((p.name, p.default) for p in params if p.kind in _POSITIONAL),
                    frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY))


def _from_schemas(name: str) -> list:
    """The overloads of ``aten::name`` as torch's argument parser takes them: the schema's names, ``self``
    spelled ``input`` (torch functions) or taken as the receiver (Tensor methods), its defaults."""
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except RuntimeError:
        return []
    out = []
    for schema in schemas:
        if schema.overload_name.startswith("prim_"):  # TorchScript's own overloads, not the argument parser's
            continue
        args = [a for a in schema.arguments if a.name != "out"]
        pos = tuple(("input" if a.name == "self" else a.name,
                     a.default_value if a.has_default_value() else _NO_DEFAULT) for a in args if not a.kwarg_only)
        out.append(Overload(pos, frozenset(a.name for a in args if a.kwarg_only)))
    return out


def overloads(func: Any) -> tuple:
    """The signatures ``func`` can be called with, as :class:`Overload` s: a Python function's own signature;
    for torch's C functions and Tensor methods the ATen schemas of the same name (the names and defaults
    torch's argument parser binds keywords by). Not ``torch.overrides.get_testing_overrides``: its lambdas make
    keyword-only parameters positional (``nonzero(input, as_tuple)``) and misname others (``permute(dim)``)."""
    try:
        return _OVERLOADS[func]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return ()
    found: list = []
    if inspect.isfunction(inspect.unwrap(func)):
        sig = _from_signature(func)
        found = [sig] if sig is not None else []
    else:
        name = getattr(func, "__name__", "")
        if name and not name.startswith("__"):
            found = _from_schemas(name)
    _OVERLOADS[func] = tuple(found)
    return _OVERLOADS[func]


def _plan(func: Any, n_args: int, keys: frozenset) -> tuple | None:
    """How to bind a call with ``n_args`` positional arguments and keywords ``keys``: the first overload that
    takes every keyword gives ``(sources, moved)``, ``sources`` one entry per position filled (a keyword's name,
    or ``(default,)``), ``moved`` the keywords that became positional; ``None``: nothing to move."""
    for ov in overloads(func):
        names = [n for n, _ in ov.positional]
        if n_args > len(names) or not all(k in names[n_args:] or k in ov.keyword_only for k in keys):
            continue
        last = max((names.index(k) for k in keys if k in names[n_args:]), default=-1)
        if last < n_args:
            return None
        sources = []
        for name, default in ov.positional[n_args:last + 1]:
            if name in _KEPT_KEYWORDS:  # the keywords from here on stay keywords
                break
            if name in keys:
                sources.append(name)
            elif default is not _NO_DEFAULT:
                sources.append((default,))
            else:  # a required parameter skipped: torch itself refuses the call; leave it as it was
                return None
        while sources and not isinstance(sources[-1], str):  # defaults with no keyword after them
            sources.pop()
        return (tuple(sources), frozenset(s for s in sources if isinstance(s, str))) if sources else None
    return None


def bind_arguments(func: Any, args: tuple, kwargs: dict) -> tuple:
    """``(args, kwargs)`` with every keyword that names a positional parameter of ``func`` moved to its position,
    and the defaults of the parameters between filled in: ``x.reshape(shape=(2, 3))`` reaches its handler as
    ``x.reshape((2, 3))``, ``F.conv2d(x, w, padding=1)`` as ``F.conv2d(x, w, None, [1, 1], 1)``.

    The one place where call forms meet the rules: every handler is called with its arguments bound by the
    op's signature (:func:`overloads`), so rules read them by position. Keyword-only parameters (``alpha``,
    ``dtype``) stay keywords. A call torch itself would refuse is passed on as it was."""
    if not kwargs:
        return args, kwargs
    if any(k in _PARSER_ALIASES for k in kwargs):
        kwargs = {_PARSER_ALIASES.get(k, k): v for k, v in kwargs.items()}
    if "self" in kwargs and "input" not in kwargs:
        kwargs = {("input" if k == "self" else k): v for k, v in kwargs.items()}
    key = (func, len(args), frozenset(kwargs))
    try:
        plan = _PLANS[key]
    except KeyError:
        plan = _PLANS[key] = _plan(func, len(args), key[2])
    except TypeError:  # unhashable func
        plan = _plan(func, len(args), key[2])
    if plan is None:
        return args, kwargs
    sources, moved = plan
    bound = tuple(kwargs[s] if isinstance(s, str) else s[0] for s in sources)
    return tuple(args) + bound, {k: v for k, v in kwargs.items() if k not in moved}


def existing(funcs: Iterable[Any]) -> list:
    return [f for f in funcs if f is not None]


def register_handler(*funcs: Any, reentrant: bool = False) -> Callable[[Handler], Handler]:
    """Register ``handler(func, args, kwargs)`` for each torch function in ``funcs``."""

    def deco(handler: Handler) -> Handler:
        for f in existing(funcs):
            HANDLERS[f] = handler
            if reentrant:
                REENTRANT.add(f)
        return handler

    return deco


_ALIASES = {"self": "input"}  # Tensor methods name their first argument `self`, torch functions `input`


def register_op(*funcs: Any, aliases: Dict[str, str] | None = None, reentrant: bool = False):
    """Register ``handler(func, <the op's parameters>)`` with its arguments bound by signature.

    The handler declares the op's parameters under torch's own names (``input`` for the tensor,
    whichever of ``self``/``input`` the caller used) and Python binds positional and keyword calls
    alike: ``x.narrow(dim=1, start=0, length=2)`` and ``torch.narrow(x, 1, 0, 2)`` reach the handler
    the same way. ``aliases`` maps other keyword spellings of an overload (``axis0``) to the
    handler's names. Binding costs one dict comprehension, and only when keywords were passed.
    """
    names = dict(_ALIASES, **(aliases or {}))

    def deco(h: Callable) -> Callable:
        @functools.wraps(h)
        def handler(func, args, kwargs):
            if kwargs:
                kwargs = {names.get(k, k): v for k, v in kwargs.items()}
            return h(func, *args, **kwargs)

        register_handler(*funcs, reentrant=reentrant)(handler)
        return h

    return deco


def position(func: Any, name: str) -> int | None:
    """The position of parameter ``name`` in ``func``'s first signature that has it, or ``None``."""
    for ov in overloads(func):
        names = [n for n, _ in ov.positional]
        if name in names:
            return names.index(name)
    return None


def rule_for(func: Any) -> Callable | None:
    """The rule or handler function registered for a torch function (unwrapped from the registry's
    binding and in-place wrappers, ``__wrapped__``), or ``None``: then the op takes the generic path
    (state evaluation, or the exact fallback)."""
    h = HANDLERS.get(func)
    return None if h is None else inspect.unwrap(h)


def maybe(obj: Any, name: str) -> Any:
    """``getattr(obj, name)`` or None (ops that exist only in some torch versions)."""
    return getattr(obj, name, None)

