"""Registration of rules by kind: a rule written on blocks, or a state op evaluated on the primal block.

``register_rule(*funcs)``: the rule takes the op's arguments with clone batches as physical ``(K, *L)`` tensors and
returns the physical output; the in-place variants and ``inplace=True`` calls write it back (:mod:`jvpreg.clone.eager.writes`).
``register_state(*funcs)``: outputs piecewise constant in the batch (comparisons, argmax, random draws), computed on
block 0 and repeated. Users add a rule for their own op the same way::

    from jvpreg.clone import register_rule

    @register_rule(torch.ops.mylib.soft_threshold.default)
    def soft_threshold(x, lam):
        a, b = x[0], x[1:]                        # primal block, tangent blocks
        keep = a.abs() > lam                      # state from the primal block
        out_a = torch.ops.mylib.soft_threshold(a, lam)
        return torch.cat([out_a[None], torch.where(keep, b - lam * a.sign(), out_a)])
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

import torch

from jvpreg.clone.core.registry import HANDLERS, existing, position
from jvpreg.clone.core.tensor import is_clone
from jvpreg.clone.eager.dispatch import state_eval
from jvpreg.clone.eager.writes import detached_target, finish


def register_rule(*funcs: Any, inplace: Iterable[Any] = (), inplace_kwarg: str | None = "inplace",
                  inplace_safe: bool = False, no_grad_inplace: Callable | None = None):
    """Register a rule written on blocks for ``funcs`` (and their in-place variants).

    The rule is called like the op, with clone arguments seen as physical ``(K, *L)``
    tensors, and returns the physical output(s). In-place variants (listed in
    ``inplace``, or called with ``inplace=True``) write the result back into the input; the
    rule then runs on a copy of the input unless ``inplace_safe`` (it saves no view of its
    input for backward, e.g. ``x * mask`` with a constant mask). ``no_grad_inplace(x, *args)``, if
    given, mutates ``x`` directly when no gradient is recorded (no copy back).
    """
    inplace = tuple(existing(inplace))

    def deco(rule: Callable) -> Callable:
        sig = inspect.signature(rule)
        names = list(sig.parameters)
        accepts_inplace = inplace_kwarg is not None and inplace_kwarg in sig.parameters
        pos = names.index(inplace_kwarg) if accepts_inplace else -1
        if accepts_inplace and sig.parameters[inplace_kwarg].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            pos = -1  # keyword-only

        def run_in_place(args, kwargs):
            target = args[0] if args else None
            if no_grad_inplace is not None and is_clone(target) and not (
                    torch.is_grad_enabled() and target.requires_grad):
                no_grad_inplace(target, *args[1:], **kwargs)
                target._jvp_state = False
                return target
            return finish(rule(*detached_target(args, kwargs, not inplace_safe), **kwargs), args, kwargs, True,
                           funcs[0] if funcs else rule)

        def out_of_place(func, args, kwargs):
            at = position(func, inplace_kwarg) if accepts_inplace and pos < 0 else None
            if at is not None and len(args) > at:  # ``F.silu(x, True)``: the flag by position, read by name
                kwargs = dict(kwargs, **{inplace_kwarg: args[at]})
                args = args[:at] + args[at + 1:]
            is_ip = False
            if accepts_inplace:
                if kwargs.get(inplace_kwarg):
                    is_ip = True
                elif 0 <= pos < len(args):
                    is_ip = bool(args[pos])
            if not is_ip:
                return finish(rule(*args, **kwargs), args, kwargs, False)
            return run_in_place(args, {k: v for k, v in kwargs.items() if k != inplace_kwarg} if kwargs else kwargs)

        def in_place(func, args, kwargs):
            return run_in_place(args, {k: v for k, v in kwargs.items() if k != inplace_kwarg})

        functools.wraps(rule)(out_of_place)
        functools.wraps(rule)(in_place)
        for f in existing(funcs):
            HANDLERS[f] = out_of_place
        for f in inplace:
            HANDLERS[f] = in_place
        rule.__jvpreg_funcs__ = tuple(existing(funcs)) + inplace
        return rule

    return deco


def register_state(*funcs: Any) -> None:
    """Declare ops whose outputs carry state only (zero tangent): evaluated on block 0."""
    for f in existing(funcs):
        HANDLERS[f] = state_eval
