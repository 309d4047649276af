"""Clone batches a forward stores on its modules are their primal once it returns.

A forward may keep a tensor on a module for later (``self.attn_map = attn.detach()`` for a plot, a recurrent memory
``self.mem = h.detach()`` read by the next call). In a clone forward that tensor is a clone batch; left there, it
outlives the forward: the next plain forward that reads it raises (a clone batch outside a clone forward), and the
next clone forward would read the *previous* call's tangent blocks as its own. While a clone forward runs,
``nn.Module.__setattr__`` notes the tensors it stores (a tensor the forward made and stores before filling it,
``self.buf = torch.zeros(...); self.buf[...] = h``, becomes a clone batch only at the write:
:mod:`jvpreg.clone.made_tensors`); when the outermost clone forward ends (also by an
error), each one still there is replaced by its primal block, the value a plain forward would have stored (a view
of block 0: with its autograd history where it has one). A stored value is then a constant of the next call, as
``torch.func.jvp`` has it.

Not seen: stores that bypass ``nn.Module.__setattr__`` (``self.__dict__[name] = h``, an item of a container on the
module: ``self.log.append(h)``, an attribute of an object that is not a module).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from .tensor import CloneTensor

_PLAIN_SETATTR = nn.Module.__setattr__
_STORED: List[Tuple[nn.Module, str]] = []  # (module, name) given a tensor during the clone forward under way


def _noting_setattr(self: nn.Module, name: str, value) -> None:
    _PLAIN_SETATTR(self, name, value)
    if isinstance(value, torch.Tensor):  # a plain one may become a clone batch later in the forward
        _STORED.append((self, name))


def install() -> None:
    """``nn.Module.__setattr__`` notes stored tensors (entering the outermost clone forward)."""
    nn.Module.__setattr__ = _noting_setattr


def uninstall() -> None:
    """The plain ``__setattr__`` again, and every noted tensor that is a clone batch now replaced by its primal (leaving
    the outermost clone forward)."""
    nn.Module.__setattr__ = _PLAIN_SETATTR
    stored, _STORED[:] = list(_STORED), []
    for module, name in stored:
        value = _stored_value(module, name)
        if type(value) is CloneTensor:
            with DisableTorchFunctionSubclass():
                primal = value.as_subclass(torch.Tensor)[0]
            _PLAIN_SETATTR(module, name, primal)


def _stored_value(module: nn.Module, name: str):
    for store in (module.__dict__.get("_buffers", {}), module.__dict__.get("_parameters", {}), module.__dict__):
        if name in store:
            return store[name]
    return None
