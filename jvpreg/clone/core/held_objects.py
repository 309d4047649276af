"""Objects with Python fields of their own that a model holds besides tensors and submodules (a config, a small
settings object, a cache passed in or returned): the clone batches stored among their fields are searched
(:mod:`jvpreg.clone.eager.stored_clones`), and a capture records and re-checks their fields like a module's
attributes (:mod:`jvpreg.clone.program.side_effects`).
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

__all__ = ["is_held_object"]

_NOT_HELD = (nn.Module, torch.Tensor, torch.Generator, type, types.FunctionType, types.MethodType,
             types.BuiltinFunctionType, types.ModuleType, functools.partial)


def is_held_object(value: Any) -> bool:
    """An object with Python fields of its own (a config, a small settings object) that a module holds as an
    attribute: its fields steer the forward like the module's own attributes."""
    return hasattr(value, "__dict__") and isinstance(vars(value), dict) and not isinstance(value, _NOT_HELD)
