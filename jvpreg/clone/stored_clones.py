"""Clone batches a forward stores on its modules are their primal once it returns.

A forward may keep a tensor on a module for later (``self.attn_map = attn.detach()`` for a plot, a recurrent memory
``self.mem = h.detach()`` read by the next call, ``self.log.append(h)``). In a clone forward that tensor is a clone
batch; left there, it outlives the forward: the next plain forward that reads it raises (a clone batch outside a
clone forward), and the next clone forward would read the *previous* call's tangent blocks as its own. When the
outermost clone forward ends (also by an error), every module of the trees that an eager clone forward or a trace
ran (:func:`watch`; a replayed program runs no Python, so it stores nothing) is searched: its attributes, its
buffers, and the lists, tuples and dicts they hold (three levels deep); each clone batch found is replaced by its
primal block, the value a plain forward would have stored (a view of block 0: with its autograd history where it
has one). A stored value is then a constant of the next call, as ``torch.func.jvp`` has
it. A tensor the forward made and stored before filling it (``self.buf = torch.zeros(...); self.buf[...] = h``) is
a clone batch by then (:mod:`jvpreg.clone.made_tensors`) and is found as well.

Searched afterwards rather than noted when stored: catching ``nn.Module.__setattr__`` means assigning it on the
class, which re-derives the slot of each of its hundreds of subclasses (0.3-0.6 ms per clone forward, more than a
small model's whole JVP), and would not see ``self.__dict__[name] = h`` or ``self.log.append(h)``.

Not seen: stores on a module outside the called modules' trees (for a function: outside the modules its closure or
bound ``self`` holds), in an object that is not a module, list, tuple or dict, or in a hook's closure.
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from .tensor import CloneTensor

_ROOTS: List[nn.Module] = []  # the modules the eager clone forward under way was called on
_SKIPPED = frozenset({"_parameters", "_modules"})  # parameters (a swapped-in clone is put back by its swap), submodules
_DEPTH = 3  # containers searched inside containers
_NESTED = frozenset({list, tuple, dict})


def watch(fn: Any) -> None:
    """Search the modules ``fn`` runs (a module, a bound method's module, the modules a function's closure holds)
    when the outermost clone forward ends (a replayed program stores nothing: only eager forwards and traces)."""
    for root in _modules_of(fn):
        if not any(r is root for r in _ROOTS):
            _ROOTS.append(root)


def release() -> None:
    """Replace every clone batch stored on the watched modules by its primal (leaving the outermost clone forward)."""
    if not _ROOTS:
        return
    stack, _ROOTS[:] = list(_ROOTS), []
    seen = set()
    while stack:  # nn.Module.modules() costs a generator per module: 0.25 ms on a ResNet-50
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        state = module.__dict__
        for name, value in tuple(state.items()):
            kind = type(value)
            if kind is CloneTensor:
                state[name] = _primal(value)
            elif kind in _NESTED and name not in _SKIPPED:
                new = _released(value, _DEPTH)
                if new is not value:
                    state[name] = new
        stack.extend(child for child in state.get("_modules", {}).values() if child is not None)


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


def _released(container: Any, depth: int) -> Any:
    """``container`` (a list, tuple or dict) with its clone batches replaced by their primals: a list or dict in place,
    a tuple rebuilt where one of its items changed (containers of exactly those types: a named tuple or an
    ``OrderedDict`` is left alone)."""
    pairs = container.items() if type(container) is dict else enumerate(container)
    changed = None
    for key, item in pairs:
        kind = type(item)
        if kind is CloneTensor:
            new = _primal(item)
        elif kind in _NESTED and depth > 1:
            new = _released(item, depth - 1)
            if new is item:
                continue
        else:
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
