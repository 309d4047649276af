"""Custom ``torch.autograd.Function``s in clone mode.

``Function.apply`` does not go through ``__torch_function__``: left alone, a custom Function would
run its forward on the raw batch and its backward on tangent blocks as if they were samples. The
engine therefore wraps ``Function.apply`` (once, on first use of clone mode): a call whose arguments
hold a clone batch is routed to a rule registered for that Function class
(:func:`register_function_rule`), else to the exact fallback (``torch.func.jvp``, which needs the
Function to define ``setup_context`` and ``jvp``), else to a clear error. Calls without clone
arguments go straight to the original ``apply``.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch._C import DisableTorchFunctionSubclass

from .dispatch import fallback
from .tensor import _CAPTURING, iter_clones

FUNCTION_RULES: Dict[type, Callable] = {}
_STATE = {"installed": False, "orig": None}


def register_function_rule(function_cls: type) -> Callable:
    """Register ``handler(args, kwargs)`` for a custom ``torch.autograd.Function`` class."""

    def deco(handler: Callable) -> Callable:
        FUNCTION_RULES[function_cls] = handler
        return handler

    return deco


class _FunctionCall:
    """Callable standing for ``cls.apply`` so the fallback can name it in errors."""

    def __init__(self, cls: type, orig: Callable):
        self.cls, self.orig = cls, orig
        self.function_cls = cls
        self.__qualname__ = f"{cls.__qualname__}.apply"
        self.__name__ = "apply"
        self.__module__ = cls.__module__

    def __call__(self, *args, **kwargs):
        return self.orig(self.cls, *args, **kwargs)


def install() -> None:
    """Wrap ``torch.autograd.Function.apply`` (idempotent)."""
    if _STATE["installed"]:
        return
    desc = torch.autograd.Function.__dict__["apply"]  # a classmethod (Python or C descriptor)

    def orig(cls, *args, **kwargs):
        return desc.__get__(None, cls)(*args, **kwargs)

    _STATE["orig"] = desc

    def apply(cls, *args, **kwargs):
        if next(iter_clones((args, kwargs)), None) is None:
            if _CAPTURING[0] is not None and torch.is_grad_enabled():
                from .capture import CaptureError

                raise CaptureError(f"the custom autograd.Function {cls.__qualname__} runs on plain tensors (its "
                                   "backward would not be replayed)")
            return orig(cls, *args, **kwargs)
        rule = FUNCTION_RULES.get(cls)
        with DisableTorchFunctionSubclass():
            if rule is not None:
                return rule(args, kwargs)
            return fallback(_FunctionCall(cls, orig), args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    _STATE["installed"] = True
