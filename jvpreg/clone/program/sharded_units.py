"""FSDP2 in captured clone mode: each ``fully_shard``-ed module's forward body is captured, FSDP's hooks stay eager.

A ``fully_shard``-ed module (an FSDP *unit*) all-gathers its parameters in a forward pre-hook and frees them in a
post-hook; those collectives are Python side effects that a replayed program cannot hold. Between the two hooks the
unit's ``forward`` body sees its parameters as ordinary unsharded tensors (the same ``nn.Parameter`` objects on
every step), so that body can be captured like any module. While a clone forward of a module that contains units
runs (in eager clone mode, :func:`jvpreg.clone.program.capture.call`), :func:`routed` points each unit's ``forward`` at
:func:`_body`, which records and replays the unit's original forward with the caller's engine: the hooks run
eagerly around it, and so do the few ops of the root that no unit holds. A unit that contains other units runs its
own body eagerly and routes theirs. Gradients reach the unsharded parameters through ordinary autograd, which FSDP
reduce-scatters as for any forward.

FSDP's pre-forward passes a unit's inputs that need gradients through ``RegisterPostBackwardFunction`` (identity
forward; its backward starts the unit's reduce-scatter). On clone inputs it runs on their physical batches
(:func:`_post_backward_rule`): the backward fires once the unit's whole clone batch has its gradient.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List

import torch
from torch import nn

from jvpreg.clone.core.tensor import CloneTensor, wrap
from jvpreg.clone.eager.functions import original_apply, register_function_rule

__all__ = ["is_unit", "has_fsdp2_units", "routed"]


def is_unit(module: nn.Module) -> bool:
    """A module sharded by FSDP (``fully_shard``, or the wrapper of FSDP1)."""
    return type(module).__name__.startswith("FSDP") or hasattr(module, "_get_fsdp_state")


try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    _FSDPModule = ()


def _fsdp2(module: nn.Module) -> bool:
    """A ``fully_shard``-ed module (FSDP2), whose hooks wrap a body of ordinary forward code; FSDP1's wrapper has
    its collectives in its own ``forward``."""
    return isinstance(module, _FSDPModule)


def has_fsdp2_units(module: nn.Module) -> bool:
    """``module`` or a submodule is ``fully_shard``-ed: :func:`routed` has a body to capture."""
    return any(_fsdp2(m) for m in module.modules())


@contextlib.contextmanager
def routed(module: nn.Module, engine: str, call: Callable) -> Iterator[None]:
    """While it is open, every FSDP2 unit in ``module`` (itself included) runs its forward body through
    :func:`_body` with ``engine`` and the capture's ``call`` (:func:`jvpreg.clone.program.capture.call`); a unit
    routed already (a nested call) keeps its route."""
    units: List[nn.Module] = []
    for m in module.modules():
        if _fsdp2(m) and "forward" not in m.__dict__:
            m.__dict__["forward"] = functools.partial(_body, m, m.forward, engine, call)
            units.append(m)
    try:
        yield
    finally:
        for m in units:
            m.__dict__.pop("forward", None)


def _body(unit: nn.Module, forward: Any, engine: str, call: Callable, *args: Any, **kwargs: Any) -> Any:
    """``unit.forward(*args, **kwargs)``, captured: called between FSDP's hooks, with the unit's parameters
    unsharded."""
    return call(unit, args, kwargs, engine=engine, fn=forward, hooks_outside=True)


def _post_backward_rule(args: tuple, kwargs: dict) -> tuple:
    """``RegisterPostBackwardFunction.apply(param_group, *inputs)`` (identity): applied to the physical batches."""
    param_group, *inputs = args
    phys = [t.as_subclass(torch.Tensor) if type(t) is CloneTensor else t for t in inputs]
    outs = original_apply(_RegisterPostBackward, param_group, *phys, **kwargs)
    return tuple(wrap(o, state=bool(t._jvp_state)) if type(t) is CloneTensor else o for o, t in zip(outs, inputs))


try:  # FSDP2's Function on a unit's inputs (torch >= 2.6)
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import \
        RegisterPostBackwardFunction as _RegisterPostBackward
except ImportError:  # pragma: no cover - torch without FSDP2
    _RegisterPostBackward = None
else:
    register_function_rule(_RegisterPostBackward)(_post_backward_rule)
