"""In-place writes of a rule's result into a clone batch, the one place where they happen.

``write_back(func, target, out)`` copies an out-of-place result into ``target`` block by block (a plain target
takes the primal, or refuses batch data); ``detached_target`` gives a rule a copy of its in-place target so that
what it saves for backward is not overwritten; ``finish`` wraps a rule's physical output or writes it back.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.errors import UnsupportedOpError
from jvpreg.clone.core.registry import op_name
from jvpreg.clone.core.tensor import is_clone, wrap, wrap_tree
from jvpreg.clone.eager.made_tensors import blocks_of, fill_or_refuse


def write_back(func: Any, target: Any, out: Any) -> Any:
    """The in-place half of an in-place op: copy the out-of-place result into ``target``.

    The one place where in-place writes into clones happen (rules, the generic path): the target must
    be a clone, a plain tensor cannot hold the blocks.
    """
    if not is_clone(target):
        if not is_clone(out) or out._jvp_state:  # the same in every block: its primal, as a plain forward writes it
            with DisableTorchFunctionSubclass():
                return target.copy_(out.as_subclass(torch.Tensor)[0] if is_clone(out) else out)
        fill_or_refuse(target, blocks_of(out),
                       f"jvpreg clone mode: {op_name(func)} would write batch data into a tensor created outside the "
                       "batch. Create that tensor from the batch (e.g. torch.zeros_like(h) or h.new_zeros(...)) or use "
                       "the out-of-place op (collect pieces with torch.stack/torch.cat).")

    with DisableTorchFunctionSubclass():
        # a plain result (one that does not depend on the batch: addmm with beta = 0) is the same in every block
        src = out.as_subclass(torch.Tensor) if is_clone(out) else out.unsqueeze(0)
        if src.dim() < target.dim():  # a logical broadcast: blocks first
            src = src.reshape(src.shape[0], *([1] * (target.dim() - src.dim())), *src.shape[1:])
        if src.dim() > target.dim() or any(s not in (1, t) for s, t in zip(src.shape[1:], target.shape[1:])):
            raise UnsupportedOpError(
                f"jvpreg clone mode: {op_name(func)} would resize its target from {tuple(target.shape[1:])} to "
                f"{tuple(src.shape[1:])}; a batch tensor cannot be resized in place. Use the out-of-place op.")
        target.copy_(src)
    target._jvp_state = bool(out._jvp_state) if is_clone(out) else True
    return target


def finish(out: Any, args: tuple, kwargs: dict, inplace: bool, func: Any = None) -> Any:
    if not inplace:
        return wrap_tree(out, wrap)
    target = args[0] if args else kwargs.get("input", kwargs.get("self"))
    return write_back(func, target, out if is_clone(out) else wrap(out))  # a rule's physical (K, ...) output


def detached_target(args: tuple, kwargs: dict, needed: bool = True) -> tuple:
    """For an in-place call: run the rule on a copy of the target, so nothing the rule saves for
    backward is a view of the tensor that the in-place write then overwrites."""
    if not needed or not args or not is_clone(args[0]) or not args[0].requires_grad:
        return args
    src = wrap(args[0].clone(), state=args[0]._jvp_state)
    return (src,) + tuple(args[1:])
