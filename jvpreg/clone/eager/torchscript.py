"""TorchScript inside a clone forward: its ops run in C++, out of ``__torch_function__``'s sight, so routed here.

A scripted function or module called on a clone batch would run its ops on the physical ``(K, *shape)`` tensor as
if the blocks were samples: every nonlinearity would take its state from each block (``tanh(x) * sigmoid(x)``),
a silently wrong JVP. While a clone forward runs (a route of its session:
:func:`~jvpreg.clone.core.session.register_patches`) calls of ``torch.jit.ScriptFunction`` and
``torch.ScriptMethod`` (a scripted or traced module's ``forward``) with a clone argument are routed:

* a scripted *function* runs its Python original (``torch.jit.script`` keeps it for Dynamo as
  ``_torchdynamo_inline``), op by op through the rules, as :mod:`jvpreg.clone.eager.compiled_code` runs compiled code;
* a scripted or traced *module* (no Python original is kept) and a function without its original take the exact
  per-op fallback (:func:`jvpreg.clone.eager.dispatch.fallback`) in reverse mode (two backward passes at the primal
  block): TorchScript's forward AD is right on a call's first run only (its profiling executor then runs a graph
  without it), its reverse mode is what training scripted models uses. The fallback runs eagerly only: a captured
  model that calls one runs in eager clone mode.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.session import register_patches
from jvpreg.clone.core.tensor import iter_clones
from jvpreg.clone.eager.dispatch import fallback

_ORIGINALS = {cls: cls.__call__ for cls in (torch.jit.ScriptFunction, torch.ScriptMethod)}
HINT = ("TorchScript runs its ops in C++, where clone rules cannot see them: call the Python original (the function "
        "or module before torch.jit.script / torch.jit.trace) for rules and capture.")


class _ScriptCall:
    """Stands for a TorchScript callable in the fallback, named in its errors and warnings."""

    def __init__(self, script: Any, original: Callable):
        self.script, self.original = script, original
        name = getattr(script, "qualified_name", None) or getattr(script, "name", "forward")
        self.__qualname__ = f"{name} (TorchScript)"
        self.__name__ = getattr(script, "name", "forward")
        self.__module__ = "torch.jit"
        self.hint = HINT
        self.reverse_mode = True  # TorchScript's forward AD: right on the first call only (then a profiled graph
        # without it: a wrong tangent, or none at all through dual tensors); its reverse mode is what training uses

    def __call__(self, *args, **kwargs):
        return self.original(self.script, *args, **kwargs)


def _routed(cls: type) -> Callable:
    original = _ORIGINALS[cls]

    def call(script, *args, **kwargs):
        if next(iter_clones((args, kwargs)), None) is None:
            return original(script, *args, **kwargs)
        python = getattr(script, "_torchdynamo_inline", None) if cls is torch.jit.ScriptFunction else None
        if python is not None:
            return python(*args, **kwargs)
        with DisableTorchFunctionSubclass():
            return fallback(_ScriptCall(script, original), args, kwargs)

    return call


_ROUTED = {cls: _routed(cls) for cls in _ORIGINALS}


register_patches({(cls, "__call__"): routed for cls, routed in _ROUTED.items()})  # while a clone forward runs


