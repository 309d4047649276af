"""Clone batches a forward stores on its modules are their primal once it returns.

A forward may keep a tensor on a module for later (``self.attn_map = attn.detach()`` for a plot, a recurrent memory
``self.mem = h.detach()`` read by the next call, ``self.log.append(h)``) or put it into what it was passed
(``forward(x, aux_losses)`` appending to ``aux_losses``). In a clone forward that tensor is a clone batch; left
there, it outlives the forward: the next plain forward that reads it raises (a clone batch outside a clone forward),
and the next clone forward would read the *previous* call's tangent blocks as its own.

When the outermost clone forward ends (also by an error), what an eager clone forward or a trace ran (:func:`watch`;
a replayed program runs no Python, so it stores nothing) is searched: every module of the called modules' trees (its
attributes, its buffers, and the lists, tuples and dicts they hold, three levels deep), and the lists and dicts the
call was passed and the fields of the objects it was passed (the clone batches they held when passed in stay); an
object the forward returns that is no pytree node (a Hugging Face ``DynamicCache``) is searched when its output is
unpacked (:func:`release_object`). Each
clone batch found is replaced by its primal block, the value a plain forward would have stored (a view of block 0:
with its autograd history where it has one). A stored value is then a constant of the next call, as
``torch.func.jvp`` has it. A tensor the forward made and stored before filling it (``self.buf = torch.zeros(...);
self.buf[...] = h``) is a clone batch by then (:mod:`jvpreg.clone.eager.made_tensors`) and is found as well.

Searched afterwards rather than noted when stored: catching ``nn.Module.__setattr__`` means assigning it on the
class, which re-derives the slot of each of its hundreds of subclasses at every clone forward (more than a small
model's whole JVP: experiments/results/stored_clones_cpu.md), and would not see ``self.__dict__[name] = h`` or
``self.log.append(h)``.

Not seen: stores on a module outside the called modules' trees (for a function: outside the modules its closure or
bound ``self`` holds), in an object that is neither passed in, nor a module, list, tuple or dict, or in a hook's
closure.
"""
from __future__ import annotations

import collections
from typing import Any, List, Optional, Set

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.held_objects import is_held_object
from jvpreg.clone.core.session import Session
from jvpreg.clone.core.tensor import CloneTensor

_SKIPPED = frozenset({"_parameters", "_modules"})  # parameters (a swapped-in clone is put back by its swap), submodules
_DEPTH = 3  # containers searched inside containers
_NESTED = frozenset({list, tuple, dict})
_LEAVES = frozenset({bool, int, float, str, type(None), torch.Tensor, nn.Parameter, torch.dtype, torch.device,
                     collections.OrderedDict, set})  # searched no further: most of a module's state


def watch(session: Session, fn: Any, arguments: Any = ()) -> None:
    """Search the modules ``fn`` runs (a module, a bound method's module, the modules a function's closure holds),
    and the lists and dicts among ``arguments`` (the call's ``(args, kwargs)``), when ``session``'s outermost clone
    forward ends (a replayed program stores nothing: only eager forwards and traces)."""
    roots = session.watched_modules
    for root in _modules_of(fn):
        if not any(r is root for r in roots):
            roots.append(root)
    containers = _mutable(arguments, _DEPTH + 2)  # (args, kwargs) and args: two levels of the call's own
    if containers:
        passed = set()  # the clone batches passed in stay where they are (the call's inputs), as deep as searched
        _clone_ids(arguments, 2 * _DEPTH + 2, passed)
        watched = session.watched_arguments
        watched.extend((c, passed) for c in containers if not any(c is d for d, _ in watched))


def release(session: Session) -> None:
    """Replace every clone batch stored on the modules and containers ``session`` watched by its primal (when its
    outermost clone forward has ended)."""
    arguments, session.watched_arguments = session.watched_arguments, []
    for container, passed in arguments:
        _released(container, _DEPTH + 1, keep=passed)
    stack, session.watched_modules = session.watched_modules, []
    seen = set()
    while stack:  # by hand: nn.Module.modules() would cost a generator per module
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        _released(module.__dict__, _DEPTH + 1, skip=_SKIPPED, seen=seen)
        stack.extend(child for child in module.__dict__.get("_modules", {}).values() if child is not None)


def release_object(obj: Any) -> None:
    """Replace the clone batches among the fields of ``obj`` (an object a clone forward returns that is no pytree
    node: a Hugging Face ``DynamicCache``) and the lists, tuples and dicts they hold by their primals."""
    if is_held_object(obj):
        _released(vars(obj), _DEPTH + 2)


def _modules_of(fn: Any) -> List[nn.Module]:
    if isinstance(fn, nn.Module):
        return [fn]
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return [owner]
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            found.append(value)
    return found


def _primal(value: CloneTensor) -> torch.Tensor:
    with DisableTorchFunctionSubclass():
        return value.as_subclass(torch.Tensor)[0]


def _mutable(value: Any, depth: int) -> List[Any]:
    """The lists and dicts in ``value`` (inside lists, tuples and dicts, ``depth`` levels deep), and the attribute
    dicts of the objects with fields there (an options object the forward sets ``opts.last = h`` on)."""
    kind = type(value)
    if depth == 0:
        return []
    if kind not in _NESTED:
        return [vars(value)] if is_held_object(value) else []
    found = [value] if kind is not tuple else []
    for item in _items(value):
        found += _mutable(item, depth - 1)
    return found


def _clone_ids(value: Any, depth: int, into: Set[int]) -> None:
    kind = type(value)
    if kind is CloneTensor:
        into.add(id(value))
    elif kind in _NESTED and depth > 0:
        for item in _items(value):
            _clone_ids(item, depth - 1, into)
    elif depth > 0 and is_held_object(value):
        _clone_ids(vars(value), depth, into)


def _items(container: Any) -> Any:
    return container.values() if type(container) is dict else container


def _released(container: Any, depth: int, keep: frozenset = frozenset(), skip: frozenset = frozenset(),
              seen: Optional[Set[int]] = None) -> Any:
    """``container`` (a list, tuple or dict) with its clone batches replaced by their primals, ``depth`` levels deep
    through lists, tuples, dicts and the fields of objects: a list, dict or object in place, a tuple rebuilt where
    one of its items changed (a named tuple or an ``OrderedDict`` is left alone); those whose ``id`` is in ``keep``
    stay, and so do the items of a dict under a key in ``skip``. An object whose ``id`` is in ``seen`` was searched
    already (a config every module of a Hugging Face model holds: once)."""
    pairs = container.items() if type(container) is dict else enumerate(container)
    changed = None
    for key, item in pairs:
        kind = type(item)
        if kind is CloneTensor:
            if id(item) in keep:
                continue
            new = _primal(item)
        elif depth <= 1 or kind in _LEAVES or key in skip:
            continue
        elif kind in _NESTED:
            new = _released(item, depth - 1, keep, seen=seen)
            if new is item:
                continue
        else:
            if (seen is None or id(item) not in seen) and is_held_object(item):  # an object's fields, in place
                if seen is not None:
                    seen.add(id(item))
                _released(vars(item), depth - 1, keep, seen=seen)
            continue
        if changed is None:
            changed = {}
        changed[key] = new
    if changed is None:
        return container
    if type(container) is tuple:
        return tuple(changed.get(i, item) for i, item in enumerate(container))
    for key, new in changed.items():
        container[key] = new
    return container
