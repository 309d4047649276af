"""What a traced forward changes besides its tensors, which a captured program would not replay.

A captured program (:mod:`jvpreg.clone.program.capture`) replays the forward's tensor ops. Two kinds of state live
outside them:

* **random number generators**: the default CPU and device generators, and any ``torch.Generator`` the model
  holds as an attribute (``torch.randn(..., generator=self.gen)``). The program replays the random ops, not Python
  that seeds or sets a generator; :class:`Generators` reads, sets and steps them so the capture can check that a
  replay leaves them where the forward did. A program whose random ops name a generator the model does not hold
  (:func:`held_generators`) would keep drawing from the one it saw at capture.
* **Python attributes of the model's modules** that the forward sets (``self.calls += 1``, ``self.last = h``): a
  replay would not set them. :class:`Attributes` takes a snapshot before the trace and names what changed; the
  capture puts the old values back (the call then runs eagerly, once) and runs such a forward in eager clone mode.
  A write of an equal number, string or flag (``self.flag = True`` on every call) changes nothing and is allowed;
  so is a cache that torch's modules rebuild from their parameters (weight and spectral norm's ``module.weight``, an
  RNN's flat weights), which the trace's snapshot puts back. Changes inside a list or dict the modules hold
  (``self.log.append(h)``, ``self.cache[key] = h``) are writes too (their items are compared by identity, or by
  value where equal numbers, strings or flags). Objects that modules hold (a Hugging Face config) are snapshotted
  too: a forward that sets ``self.config.x`` runs eagerly as well.

The attributes a forward *reads* (``self.p`` of a dropout, ``self.eps``, ``self.stride``, a flag, a function) steer
what the trace records, so the program holds for their values only. :class:`AttributeReads` records them during the
trace (each module's class is swapped for a subclass whose ``__getattribute__`` notes instance attributes, and put
back after); the capture re-checks them before every replay and recaptures where one changed: numbers, strings,
flags, dtypes and tuples, lists or dicts of them by value, other objects by identity. A plain constant the forward
reads from the module's class (``scale = 2.0`` in the class body) is re-checked in the class and must not be
shadowed by the instance. An object the forward reaches through a module (``self.trainer``, ``self.config``) is
given a recording class too, when first read, so the whole chain of reads is re-checked (``self.current_epoch`` of
a LightningModule: ``trainer.fit_loop.epoch_progress.current.completed``); values that an object's ``__getattr__``
computes (a Lightning ``self.hparams.lr``, an OmegaConf key) are asked again before every replay; an object that
cannot take a recording class (a Hugging Face config, whose attribute map hides which field a name reads) has every
field re-checked: ``config.output_hidden_states = True`` after a capture recaptures. Lists and dicts of plain
values are compared by value (an item set in place recaptures); other containers by identity only. An object passed
to the forward as an argument (``forward(x, opts)``) that the call signature tells apart by identity is read the
same way (its chain of reads re-checked: ``opts.inner.shift``), and the plain module globals the model's code reads
are re-checked too (:class:`Globals`; a forward that rebinds one runs eagerly).

User objects are never asked to do anything: a snapshot reads and puts back an object's instance ``__dict__`` as a
dict, and the items of *plain* ``list`` and ``dict`` attributes through the built-in types' own methods, only where
they changed; a subclass (diffusers' ``FrozenDict`` config, whose ``update`` raises) is compared by identity, and
values are compared by ``==`` only where both are numbers, strings, flags or dtypes. Why not Dynamo's guards and
side-effect tracking: they would have to trace the clone engine's own Python, and a clone batch reports its
primal's shape, which Dynamo's fake tensors cannot express (:mod:`jvpreg.clone.program.capture`); the price is that a write
into a subclassed container's items, or into an object's ``__slots__``, is not seen (the capture treats them as
unchanged).
"""
from __future__ import annotations

import contextlib
import dis
import enum
import os
import sys
import sysconfig
import types
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from jvpreg.clone.core.held_objects import is_held_object

__all__ = ["Generators", "held_generators", "held_objects", "Attributes", "AttributeReads", "hold",
           "changed", "keyed_by_identity", "argument_objects", "Globals"]


class Generators:
    """The random number generators a forward on ``device`` may draw from: the default CPU one, the device's, and
    those the model holds as attributes."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.device = device
        seen: Dict[int, torch.Generator] = {}
        for mod in module.modules():
            for value in vars(mod).values():
                if isinstance(value, torch.Generator):
                    seen.setdefault(value._cdata, value)  # one generator may have several Python objects
        self.owned = list(seen.values())

    def states(self) -> Tuple[torch.Tensor, ...]:
        states = (torch.get_rng_state(),)
        if self.device.type == "cuda":
            states += (torch.cuda.get_rng_state(self.device),)
        return states + tuple(g.get_state() for g in self.owned)

    def set(self, states: Tuple[torch.Tensor, ...]) -> None:
        torch.set_rng_state(states[0])
        rest = states[1:]
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(rest[0], self.device)
            rest = rest[1:]
        for g, state in zip(self.owned, rest):
            g.set_state(state)

    def step(self) -> None:
        """Each generator one draw on: a state that no seeding gives (a freshly seeded Mersenne twister has read
        none of its words, a freshly seeded Philox has offset 0), so a forward that seeds one cannot end where a
        replay from here ends."""
        torch.empty(1).random_()
        if self.device.type == "cuda":
            torch.empty(1, device=self.device).random_()
        for g in self.owned:
            torch.empty(1, device=g.device).random_(generator=g)

    def holds(self, generator: torch.Generator) -> bool:
        return any(g._cdata == generator._cdata for g in self.owned)


def held_generators(gm: torch.fx.GraphModule) -> List[torch.Generator]:
    """The generators a recorded program's random ops name (``generator=``): it holds them as constants."""
    return [getattr(gm, n.target) for n in gm.graph.nodes
            if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Generator)]


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
_MISSING = object()


def _same(old: Any, new: Any) -> bool:
    """A replay that does not write ``new`` over ``old`` leaves what the forward would: the same object, or an equal
    number, string or flag (tuples of them too)."""
    if old is new:
        return True
    if isinstance(old, _Items):
        return old == new
    if _plain_tuple(old) and _plain_tuple(new):  # named tuples too: their == is the tuple's
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new))
    return type(old) is type(new) and type(old) in _PLAIN and old == new  # never a user class's __eq__


def _plain_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and type(value).__eq__ is tuple.__eq__


_RNN_CACHES = frozenset({"_flat_weights", "_flat_weight_refs"})


def _recomputed(mod: nn.Module) -> set:
    """Caches that torch's own modules rebuild from their parameters inside a forward: weight and spectral norm's
    ``weight`` (their pre-hooks, on every call), an RNN's flat weight list (when its parameters were swapped, as
    ``jvp_params`` does). The program reads the parameters themselves; the trace's rebuilt caches are put back."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    names = {h.name for h in mod._forward_pre_hooks.values() if isinstance(h, (SpectralNorm, WeightNorm))}
    return names | _RNN_CACHES if isinstance(mod, nn.RNNBase) else names


def held_objects(module: nn.Module) -> List[Tuple[str, Any]]:
    """``(Type of the module . attribute, object)`` for each object (:func:`is_held_object`) that a module of
    ``module`` holds, each once."""
    seen: Dict[int, Tuple[str, Any]] = {}
    for mod in module.modules():
        for name, value in vars(mod).items():
            if id(value) not in seen and is_held_object(value):
                seen[id(value)] = (f"{type(mod).__name__}.{name}", value)
    return list(seen.values())


class Attributes:
    """A snapshot of the Python attributes (``vars``) of every module of ``module``, parameters and buffers
    included (rebinding one is a write too), of the objects the modules hold (:func:`held_objects`), and of
    ``objects`` (those the call passes in: :func:`argument_objects`)."""

    def __init__(self, module: nn.Module, objects: Sequence[Any] = ()):
        held = held_objects(module)
        known = {id(o) for _, o in held}
        self.mods = (list(module.named_modules(remove_duplicate=True)) + held
                     + [(f"argument {type(o).__name__}", o) for o in objects if id(o) not in known])
        self.before = [self._attributes(mod) for _, mod in self.mods]

    @staticmethod
    def _attributes(mod: Any) -> Dict[Tuple[str, str], Any]:
        if not isinstance(mod, nn.Module):
            out = {("", k): v for k, v in vars(mod).items()}
        else:
            out = {("", k): v for k, v in vars(mod).items() if k not in ("_parameters", "_buffers", "_modules")}
            out.update((("_parameters", k), v) for k, v in mod._parameters.items())
            out.update((("_buffers", k), v) for k, v in mod._buffers.items())
            out.update((("_modules", k), v) for k, v in mod._modules.items())
        for (where, k), v in list(out.items()):  # the items of the lists and dicts held: an append is a write too
            if where == "" and type(v) in (list, dict):  # not a subclass: its methods are the user's (FrozenDict)
                out[(_ITEMS, k)] = _Items(v)
        return out

    def changed(self) -> List[str]:
        """``module.attribute`` names the forward set since the snapshot (to a different value), or whose list or dict
        it changed (``module.attribute[...]``)."""
        names = []
        for (prefix, mod), before in zip(self.mods, self.before):
            after = self._attributes(mod)
            skip = _recomputed(mod) if isinstance(mod, nn.Module) else ()
            for key in before.keys() | after.keys():
                if key[1] in skip or _same(before.get(key, _MISSING), after.get(key, _MISSING)):
                    continue
                if key[0] == _ITEMS and (key not in before or key not in after
                                         or before[key].held is not after[key].held):
                    continue  # a list or dict bound, rebound or unbound: named by the attribute itself
                names.append(f"{prefix or type(mod).__name__}.{key[1]}{'[...]' if key[0] == _ITEMS else ''}")
        return sorted(names)

    def restore(self) -> None:
        """Put every attribute back as it was at the snapshot (new ones removed), and the items of the lists and dicts
        held: after every trace, so that neither the trace's writes nor its rebuilt caches (tensors of the trace)
        stay on the model."""
        for (_, mod), before in zip(self.mods, self.before):
            after = self._attributes(mod)
            for (where, name) in after.keys() - before.keys():
                if where != _ITEMS:
                    del (vars(mod) if where == "" else getattr(mod, where))[name]
            for (where, name), value in before.items():
                if where == _ITEMS:
                    value.put_back()
                else:
                    (vars(mod) if where == "" else getattr(mod, where))[name] = value


_ITEMS = "[items]"  # the key prefix of a held list's or dict's items in a snapshot


class _Items:
    """The items of a plain ``list`` or ``dict`` at a snapshot (the objects themselves, not copies). Put back through
    the built-in type's own methods, and only where they changed: the capture calls no method a user class
    defines (a subclass, such as diffusers' ``FrozenDict`` config that refuses ``update``, is compared by
    identity)."""

    def __init__(self, held: Any):
        self.held = held
        self.items = tuple(held.items()) if isinstance(held, dict) else tuple(held)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Items) and other.held is self.held and _same(self.items, other.items)

    __hash__ = None

    def put_back(self) -> None:
        if self == _Items(self.held):
            return
        if type(self.held) is dict:
            dict.clear(self.held)
            dict.update(self.held, self.items)
        else:
            list.__setitem__(self.held, slice(None), self.items)


_MACHINERY = frozenset(vars(nn.Module())) | {"__dict__", "__class__"}  # nn.Module's own state (``training``: guarded)
_MODULE_CLASS = frozenset(name for cls in nn.Module.__mro__ for name in vars(cls))  # _compiled_call_impl, ...
_RECORDING: Dict[type, type] = {}


_MAX_ITEMS = 256  # a longer container (a lookup table) is compared by identity: a re-check per call stays cheap


def _plain(value: Any) -> bool:
    """Compared by value: numbers, strings, flags, dtypes, and tuples, lists and dicts of them (up to
    :data:`_MAX_ITEMS` items)."""
    if isinstance(value, _PLAIN):
        return True
    if type(value) is dict:
        return len(value) <= _MAX_ITEMS and all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, (tuple, list)) and len(value) <= _MAX_ITEMS and all(_plain(v) for v in value)


def _recording_class(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` that reports the instance attributes read to the active recorder (a
    module's own state, :data:`_MACHINERY`, left out)."""
    sub = _RECORDING.get(cls)
    if sub is None:
        module = issubclass(cls, nn.Module)
        skip = _MACHINERY if module else frozenset({"__dict__", "__class__"})
        class_skip = _MODULE_CLASS if module else frozenset(vars(object))

        def __getattribute__(self, name):
            value = super(sub, self).__getattribute__(name)
            if name not in skip and AttributeReads.active_recorder is not None:
                own = object.__getattribute__(self, "__dict__")
                if name in own:
                    if own[name] is value:
                        AttributeReads.active_recorder.note(self, name, value)
                elif name not in class_skip and _plain(value):
                    AttributeReads.active_recorder.note_class_constant(self, name, value)
            return value

        namespace = {"__getattribute__": __getattribute__, "__module__": cls.__module__,
                     "__qualname__": cls.__qualname__}
        if not module and hasattr(cls, "__getattr__"):  # values computed by the class (an AttributeDict's items)
            def __getattr__(self, name):
                recorder = AttributeReads.active_recorder
                try:
                    value = super(sub, self).__getattr__(name)
                except AttributeError:
                    if recorder is not None:
                        recorder.note_computed(self, name, _MISSING)  # absent: a key added later must recapture
                    raise
                if recorder is not None:
                    recorder.note_computed(self, name, value)
                return value

            namespace["__getattr__"] = __getattr__
        sub = type(cls.__name__, (cls,), namespace)
        _RECORDING[cls] = sub
    return sub


class _Computed:
    """Where a value computed by an object's ``__getattr__`` is re-checked: ``get`` asks the object again."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def get(self, name: str, default: Any) -> Any:
        return getattr(self.obj, name, default)


def _swap_in_recording_class(obj: Any) -> bool:
    """Give a held object its recording class (False where it cannot take one: an enum member, a class with its
    own ``__getattribute__`` such as a Hugging Face config's attribute map, a C type's layout, a class whose
    ``__init_subclass__`` refuses a subclass)."""
    cls = type(obj)
    if isinstance(obj, enum.Enum) or any(isinstance(vars(k).get("__getattribute__"), types.FunctionType)
                                         for k in cls.__mro__):
        return False
    try:
        object.__setattr__(obj, "__class__", _recording_class(cls))
    except Exception:  # noqa: BLE001  (its fields are all re-checked instead)
        return False
    return True


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.split(".")[0]]))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_PACKAGES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")})  # may lie inside _STDLIB


def _library(code: types.CodeType) -> bool:
    """torch's, jvpreg's or the standard library's code: not the model's."""
    f = code.co_filename
    return f.startswith(_LIBRARY_DIRS) or (f.startswith(_STDLIB) and not f.startswith(_PACKAGES))


_LOADED: Dict[Tuple[types.CodeType, Tuple[str, ...]], Tuple[str, ...]] = {}  # per code object and opcodes


def _names_loaded(code: types.CodeType, opnames: Tuple[str, ...]) -> Tuple[str, ...]:
    """The names ``code`` (and the comprehensions and functions nested in it) loads by ``opnames``:
    ``("LOAD_GLOBAL",)`` its module globals, ``("LOAD_ATTR", "LOAD_METHOD")`` the attributes it reads
    (``self.helper(...)``: ``helper``)."""
    names = _LOADED.get((code, opnames))
    if names is None:
        found = [i.argval for i in dis.get_instructions(code) if i.opname in opnames]
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found += _names_loaded(const, opnames)
        names = _LOADED[(code, opnames)] = tuple(dict.fromkeys(found))
    return names


_GLOBAL_LOADS, _ATTRIBUTE_LOADS = ("LOAD_GLOBAL",), ("LOAD_ATTR", "LOAD_METHOD")


def _method(cls: type, name: str) -> Any:
    """The plain function behind ``cls.name`` (a method, static or class method, or property getter), or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            attr = vars(klass)[name]
            attr = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            return attr if isinstance(attr, types.FunctionType) else None
    return None


_MAX_HOPS = 2  # functions reached by global name from a forward, and those they call so: deeper is library code


class Globals:
    """The plain module globals (``USE_AUX = True``, ``SCALE = 0.5``) that the model's own Python code loads.

    Found without running it: each module class's ``forward``, the methods of the class it names
    (``self.helper(...)``), the code it wraps or closes over (a decorator's), and the functions it loads by global
    name, up to :data:`_MAX_HOPS` calls deep; torch's, jvpreg's and the standard library's code is left out. A
    program holds for their values: they are re-checked before every replay like the attributes read (a superset of
    what one call reads: an unrelated global changed recaptures needlessly, never wrongly), and a forward that
    rebinds one (``global CALLS; CALLS += 1``) runs eagerly.
    Globals read only by code reached otherwise (a function held in a dict, a method of another module's object)
    are not seen."""

    def __init__(self, module: nn.Module):
        seen: set = set()
        found: Dict[Tuple[int, str], Tuple[dict, str, Any]] = {}
        # (function, the module class whose methods it may call, global-name hops from a forward)
        stack: List[Tuple[Any, Any, int]] = [(_method(cls, "forward"), cls, 0)
                                             for cls in {type(m) for m in module.modules()}]
        while stack:
            fn, cls, hops = stack.pop()
            if not isinstance(fn, types.FunctionType) or (id(fn), cls) in seen or _library(fn.__code__):
                continue
            seen.add((id(fn), cls))
            g = fn.__globals__
            for name in _names_loaded(fn.__code__, _GLOBAL_LOADS):
                value = g.get(name, _MISSING)
                if isinstance(value, types.FunctionType):
                    if hops < _MAX_HOPS:
                        stack.append((value, None, hops + 1))
                elif value is not _MISSING and _plain(value):
                    found.setdefault((id(g), name), (g, name, value))
            if cls is not None:  # self.helper(...): the class's own methods
                stack += [(_method(cls, name), cls, hops) for name in _names_loaded(fn.__code__, _ATTRIBUTE_LOADS)]
            inner = (getattr(fn, "__wrapped__", None), *(c.cell_contents for c in fn.__closure__ or () if _filled(c)))
            stack += [(f, cls, hops) for f in inner if isinstance(f, types.FunctionType)]  # decorators' wrapped code
        self.read = list(found.values())

    @staticmethod
    def _label(g: dict, name: str) -> str:
        return f"{g.get('__name__', '?')}.{name}"

    def changed(self) -> List[str]:
        """The globals rebound since :meth:`__init__` (to another value)."""
        return sorted(self._label(g, n) for g, n, v in self.read if not _same(v, g.get(n, _MISSING)))

    def restore(self) -> None:
        for g, name, value in self.read:
            g[name] = value

    def checks(self) -> Tuple[Tuple[Any, str, Any, bool, str], ...]:
        return tuple(_check(g, name, value, self._label(g, name)) for g, name, value in self.read)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


class AttributeReads:
    """The instance attributes that a forward reads while :meth:`recording`: of the model's modules, and of the
    objects it reaches through them (``self.trainer.fit_loop.epoch_progress.current.completed``, read by a
    LightningModule's ``current_epoch``): an object is given a recording class when it is first read, and the
    chain of reads to each value is re-checked (the objects by identity, the value read at its end by value).
    An object that cannot take a recording class has every field re-checked instead."""

    active_recorder: "AttributeReads | None" = None

    def __init__(self, module: nn.Module, arguments: List[Any] = ()):
        self.mods = list(module.modules())
        self.arguments = list(arguments)     # objects passed to the forward (argument_objects): read like held ones
        self.read: Dict[Tuple[int, str], Tuple[Any, str, Any]] = {}
        self.constants: Dict[Tuple[int, str], Tuple[Any, str, Any, Any]] = {}
        self.labels: Dict[int, str] = {}     # a held object read: the chain of names that reached it
        self.whole: Dict[int, Any] = {}      # held objects that could not take a recording class: every field
        self.computed: Dict[Tuple[int, str], Tuple[Any, str, Any]] = {}  # values of objects' __getattr__
        self._swapped: List[Tuple[Any, type]] = []

    def _label(self, owner: Any, name: str) -> str:
        parent = self.labels.get(id(owner))
        return name if parent is None else f"{parent}.{name}"

    def note(self, owner: Any, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):  # tensors: inputs of the program, or its constants (checked apart)
            return
        if self.read.setdefault((id(owner), name), (owner, name, value))[2] is value and is_held_object(value):
            self._watch(value, self._label(owner, name))

    def _watch(self, obj: Any, label: str) -> None:
        """Record the reads of ``obj`` from now on (its recording class), or re-check all its fields."""
        if id(obj) not in self.labels:
            self.labels[id(obj)] = label
            cls = type(obj)
            if _swap_in_recording_class(obj):
                self._swapped.append((obj, cls))
            else:
                self.whole[id(obj)] = obj

    def note_computed(self, owner: Any, name: str, value: Any) -> None:
        """A value an object's ``__getattr__`` gave (``hparams.lr`` of a Lightning AttributeDict, a key of an
        OmegaConf config), or its absence."""
        if isinstance(value, torch.Tensor):
            return
        if self.computed.setdefault((id(owner), name), (owner, name, value))[2] is value and is_held_object(value):
            self._watch(value, self._label(owner, name))

    def note_class_constant(self, owner: Any, name: str, value: Any) -> None:
        """A plain value read from the class body (not a property's result, not an attribute map's)."""
        if (id(owner), name) not in self.constants:
            owner_cls = next((c for c in type(owner).__mro__ if name in vars(c)), None)
            if owner_cls is not None and vars(owner_cls)[name] is value:
                self.constants[(id(owner), name)] = (owner, name, value, vars(owner_cls))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        outer, AttributeReads.active_recorder = AttributeReads.active_recorder, self
        try:
            for mod in self.mods:
                cls = type(mod)
                try:
                    mod.__class__ = _recording_class(cls)
                except Exception:  # noqa: BLE001  (a class whose __init_subclass__ refuses: all fields re-checked)
                    self.labels[id(mod)] = cls.__name__
                    self.whole[id(mod)] = mod
                    continue
                self._swapped.append((mod, cls))
            for obj in self.arguments:
                self._watch(obj, type(obj).__name__)
            yield
        finally:
            AttributeReads.active_recorder = outer
            for obj, cls in reversed(self._swapped):
                object.__setattr__(obj, "__class__", cls)
            self._swapped.clear()

    def checks(self, root: nn.Module) -> Tuple[Tuple[Any, str, Any, bool, str], ...]:
        """``(where: a module's or held object's __dict__, a class's namespace, or None for the root's, name, value,
        by value, label)`` per attribute read: what :func:`hold` re-checks (a list by a copy of its value)."""
        out: List[Tuple[Any, str, Any, bool, str]] = []
        for owner, name, value in self.read.values():
            if isinstance(owner, nn.Module) and name in _recomputed(owner):  # put back after the trace: the
                continue  # program reads the parameters themselves
            out.append(_check(None if owner is root else vars(owner), name, value, self._label(owner, name)))
        for obj in self.whole.values():  # its fields steer the forward too
            out += _field_checks(obj, self.labels[id(obj)])
        for owner, name, value in self.computed.values():  # asked again: getattr
            out.append(_check(_Computed(owner), name, value, self._label(owner, name)))
        for owner, name, value, namespace in self.constants.values():
            label = self._label(owner, name)
            out.append(_check(None if owner is root else vars(owner), name, _MISSING, label))  # not shadowed
            out.append(_check(namespace, name, value, label))
        return tuple(out)


def _check(where: Any, name: str, value: Any, label: str) -> Tuple[Any, str, Any, bool, str]:
    by_value = _plain(value)
    kept = type(value)(value) if by_value and type(value) in (list, dict) else value  # its values now
    return where, name, kept, by_value, label


def _field_checks(obj: Any, label: str) -> List[Tuple[Any, str, Any, bool, str]]:
    return [_check(vars(obj), field, v, f"{label}.{field}") for field, v in vars(obj).items()]


def keyed_by_identity(value: Any) -> bool:
    """A call argument that a signature tells apart from others by identity only (unhashable, or equal only to
    itself): its fields may change between calls with the same signature."""
    try:
        hash(value)
    except TypeError:
        return True
    return type(value).__eq__ is object.__eq__


def argument_objects(leaves: List[Any]) -> List[Any]:
    """The call's arguments that are objects with fields (:func:`is_held_object`) told apart by identity."""
    return [leaf for leaf in leaves if is_held_object(leaf) and keyed_by_identity(leaf)]




def hold(root: nn.Module, checks: Tuple[Tuple[Any, str, Any, bool, str], ...]) -> bool:
    """Every attribute in ``checks`` still has its value (by value) or object (by identity)."""
    own = root.__dict__
    for d, name, value, by_value, _ in checks:
        now = (own if d is None else d).get(name, _MISSING)
        if now is not value and not (by_value and type(now) is type(value) and now == value):
            return False
    return True


def changed(root: nn.Module, checks: Tuple[Tuple[Any, str, Any, bool, str], ...]) -> List[str]:
    """The names of the attributes in ``checks`` that no longer :func:`hold` (``config.field`` for a held
    object's)."""
    return sorted({check[4] for check in checks if not hold(root, (check,))})
