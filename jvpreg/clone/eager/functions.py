"""Custom ``torch.autograd.Function``s in clone mode.

``Function.apply`` does not go through ``__torch_function__``: left alone, a custom Function would
run its forward on the raw batch and its backward on tangent blocks as if they were samples. The
engine therefore wraps ``Function.apply`` while a clone forward runs (a route of the forward's session,
:mod:`jvpreg.clone.core.session`; the original is put back when the outermost forward ends, so nothing of
torch's global state is changed outside a clone forward): a call whose arguments hold a clone batch is
routed to a rule registered for that Function class (:func:`register_function_rule`), else to the exact
fallback (``torch.func.jvp``, which needs the Function to define ``setup_context`` and ``jvp``), else to a
clear error. Calls without clone arguments go straight to the original ``apply``.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.errors import CaptureError
from jvpreg.clone.core.session import Session, register_route
from jvpreg.clone.core.tensor import capturing, iter_clones
from jvpreg.clone.eager.dispatch import fallback

FUNCTION_RULES: Dict[type, Callable] = {}
ALWAYS_ROUTED: set = set()  # Function classes whose rule runs inside a clone forward even without clone arguments


def register_function_rule(function_cls: type, *, always: bool = False) -> Callable:
    """Register ``handler(args, kwargs)`` for a custom ``torch.autograd.Function`` class; ``always``: also for calls
    without clone arguments inside a clone forward (a Function whose body may reach clones another way: the
    reentrant checkpoint's region reads perturbed weights)."""

    def deco(handler: Callable) -> Callable:
        FUNCTION_RULES[function_cls] = handler
        if always:
            ALWAYS_ROUTED.add(function_cls)
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


_ORIG_APPLY = torch.autograd.Function.__dict__["apply"]  # a classmethod (Python or C descriptor)


def original_apply(cls: type, *args, **kwargs):
    """``cls.apply(*args, **kwargs)`` as torch runs it, outside the route (a rule that applies the Function itself
    to physical batches)."""
    return _ORIG_APPLY.__get__(None, cls)(*args, **kwargs)


def _apply(cls, *args, **kwargs):
    if next(iter_clones((args, kwargs)), None) is None and cls not in ALWAYS_ROUTED:
        if capturing() and torch.is_grad_enabled() and not _operator_autograd(cls):
            raise CaptureError(f"the custom autograd.Function {cls.__qualname__} runs on plain tensors (its "
                               "backward would not be replayed)")
        return original_apply(cls, *args, **kwargs)
    rule = FUNCTION_RULES.get(cls)
    with DisableTorchFunctionSubclass():
        out = rule(args, kwargs) if rule is not None else fallback(_FunctionCall(cls, original_apply), args, kwargs)
    for leaf in iter_clones(out):
        leaf._jvp_routed = True
    return out


def _operator_autograd(cls: type) -> bool:
    """``cls`` is the Function that ``torch.library.register_autograd`` made for an operator: the tracer records
    the operator as one node (:mod:`jvpreg.clone.rules.kernels`), whose replay runs this backward again."""
    return cls.__module__ == "torch._library.autograd"


def install(session: Session) -> None:
    """Route ``Function.apply`` (when the outermost clone forward starts)."""
    torch.autograd.Function.apply = classmethod(_apply)


def uninstall(session: Session) -> None:
    torch.autograd.Function.apply = _ORIG_APPLY


register_route(install, uninstall)
