"""Parameter and buffer slots that hold clone batches: parameter directions.

A direction ``U`` for a parameter ``W`` rides in the clone forward as the clone ``[W; W + s U]`` put into every slot
(``module._parameters[name]``, a buffer's) that holds ``W``, for the duration of a call (:func:`swapped_tensors`,
:func:`swap_in` and :func:`restore`). The slots holding clones now are listed, per context (:func:`swapped`): the
captured engine reads every slot's tensor only when that list is not empty, and a checkpointed region's
recomputation, which runs after the forward, puts the same clones back (:mod:`jvpreg.clone.eager.checkpointing`).
A swap outlives a clone forward (``jvp_params`` swaps, then calls the engine, which may replay a program without
opening a session), so the list is its own context variable, not part of the forward's session.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, List, Mapping, Tuple

import torch
from torch import nn

from jvpreg.clone.core.tensor import CloneTensor

__all__ = ["swap_in", "put_in", "restore", "swapped_tensors", "swapped"]

Slot = Tuple[dict, str, torch.Tensor]  # (store: a module's _parameters or _buffers, name, tensor)
_SWAPPED: contextvars.ContextVar = contextvars.ContextVar("jvpreg_swapped_slots", default=())


def swapped() -> Tuple[Slot, ...]:
    """The ``(store, name, clone)`` slots that hold a clone now (put there by :func:`put_in`), oldest first."""
    return _SWAPPED.get()


def swap_in(module: nn.Module, replace: Mapping[torch.Tensor, torch.Tensor], *, buffers: bool = True) -> List[Slot]:
    """Put ``replace[p]`` wherever parameter (or buffer) ``p`` is registered in ``module``, tied uses
    included; returns the ``(store, name, original)`` slots for :func:`restore`. One walk over the
    submodules' own dicts (``torch.func.functional_call`` would rebuild every tensor)."""
    slots = []
    by_id = {id(p): t for p, t in replace.items()}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers) if buffers else (sub._parameters,):
            for attr, value in store.items():
                if value is not None and id(value) in by_id:
                    slots.append((store, attr, value))
    return put_in([(store, attr, by_id[id(value)]) for store, attr, value in slots])


def put_in(slots: List[Slot]) -> List[Slot]:
    """Put ``new`` into each ``(store, name, new)`` slot; returns the ``(store, name, original)`` slots for
    :func:`restore`. Slots that now hold a clone are listed by :func:`swapped` until restored."""
    saved, clones = [], []
    for store, attr, new in slots:
        saved.append((store, attr, store[attr]))
        store[attr] = new
        if type(new) is CloneTensor:
            clones.append((store, attr, new))
    if clones:
        _SWAPPED.set(_SWAPPED.get() + tuple(clones))
    return saved


def restore(slots: List[Slot]) -> None:
    """Undo :func:`swap_in` or :func:`put_in` (last swapped first)."""
    listed = list(_SWAPPED.get())
    while slots:
        store, attr, value = slots.pop()
        if type(store.get(attr)) is CloneTensor:
            i = next((i for i in range(len(listed) - 1, -1, -1) if listed[i][0] is store and listed[i][1] == attr),
                     None)
            if i is not None:
                del listed[i]
        store[attr] = value
    _SWAPPED.set(tuple(listed))


@contextlib.contextmanager
def swapped_tensors(module: nn.Module, replace: Mapping[torch.Tensor, torch.Tensor]) -> Iterator[None]:
    """Context form of :func:`swap_in`: inside, every slot of ``module`` that holds a key of ``replace`` holds its
    value; the originals are back on exit.

    Example::

        >>> W = model.fc.weight
        >>> with jvpreg.clone.swapped_tensors(model, {W: jvpreg.clone.clone_of(W, U[None], s)}):
        ...     out = jvpreg.clone.call(model, (x,))  # the blocks of out: model(x) at W, then at W + s U
    """
    slots = swap_in(module, replace)
    try:
        yield
    finally:
        restore(slots)
