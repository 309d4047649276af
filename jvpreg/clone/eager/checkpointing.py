"""Activation checkpointing (``torch.utils.checkpoint``) in clone mode.

A checkpointed region drops the activations it would save for backward and, in the backward pass, calls its function
again on its inputs to recompute them. In clone mode the inputs are clone batches and the recomputation runs after
the clone forward has ended, where a clone batch has no rules to run. While a clone forward runs, the engine therefore
hands torch's checkpoint a function whose recomputation is a clone forward again: the same rules on the same clone
inputs, with the parameter slots that held clones during the forward (weight directions) holding them again. It
recomputes the same ops, so it saves the same tensors (torch's determinism check compares them), and the memory is
that of a checkpointed forward of the clone batch.

* ``use_reentrant=False`` (timm's and Hugging Face's default): the recomputed function is swapped in where torch
  builds the checkpoint (``_checkpoint_without_reentrant_generator[_impl]``, which takes the function first), for
  every checkpoint in the clone forward (a region may see clones only through perturbed weights);
* ``use_reentrant=True``: ``CheckpointFunction`` is routed to the non-reentrant form (the same gradients, also
  where the reentrant form drops those of a region whose inputs need none), whether or not its arguments hold clones
  (a region may see clones only through perturbed weights);
* torch's checkpoint keeps the region's inputs and reads their metadata outside the clone forward: it is handed
  them as plain physical batches, and the recomputed function gets them back as clone batches.

While a capture records the clone forward with gradients enabled, a checkpoint runs what the capture put in the
forward's session instead (``record_checkpoint``: :mod:`jvpreg.clone.program.checkpointed_regions` records the region
inline, and the program calls it through torch's checkpoint); without gradients nothing is saved, and the region is
recorded inline.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict, List, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._C import _EnableTorchFunction
from torch.utils._pytree import tree_flatten, tree_unflatten

from jvpreg.clone.core.session import Session, current, register_route
from jvpreg.clone.core.tensor import CloneTensor, wrap
from jvpreg.clone.eager import functions, parameter_slots
from jvpreg.clone.eager.forward import active

_NAMES = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
_ORIGINALS = {name: getattr(torch_checkpoint, name) for name in _NAMES if hasattr(torch_checkpoint, name)}


def install(session: Session) -> None:
    """Route every checkpoint (called when the outermost clone forward starts)."""
    for name, routed in _ROUTED.items():
        setattr(torch_checkpoint, name, routed)


def uninstall(session: Session) -> None:
    for name, original in _ORIGINALS.items():
        setattr(torch_checkpoint, name, original)


def _routed(original: Callable) -> Callable:
    signature = inspect.signature(original)  # torch 2.11: (fn, preserve_rng_state, ..., *args, **kwargs);
    # later: (fn, args, kwargs, *, preserve_rng_state, ...): the region's own arguments are `args` and `kwargs`

    @functools.wraps(original)
    def generator(fn, *args, **kwargs):
        bound = signature.bind(fn, *args, **kwargs)
        session = current()
        record = None if session is None else session.record_checkpoint
        if record is not None and torch.is_grad_enabled():  # a capture records it (a checkpointed sub-program)
            return record({k: v for k, v in bound.arguments.items() if k not in ("fn", "args", "kwargs")})
        leaves, spec = tree_flatten((tuple(bound.arguments.get("args", ())), dict(bound.arguments.get("kwargs", {}))))
        marks = {}  # leaf position -> (physical shape, the clone's state flag)
        for i, leaf in enumerate(leaves):
            if type(leaf) is CloneTensor:
                leaves[i] = leaf.as_subclass(torch.Tensor)
                marks[i] = (tuple(leaves[i].shape), bool(leaf._jvp_state))
        if marks:
            region_args, region_kwargs = tree_unflatten(leaves, spec)
            bound.arguments["args"], bound.arguments["kwargs"] = region_args, region_kwargs
        bound.arguments["fn"] = recomputed_in_clone_mode(fn, marks)
        return original(*bound.args, **bound.kwargs)

    return generator


def recomputed_in_clone_mode(fn: Callable, marks: Optional[Dict[int, tuple]] = None) -> Callable:
    """``fn`` for torch's checkpoint, which keeps the region's inputs and calls ``fn(*args, **kwargs)`` on them in
    the backward pass.

    The checkpoint is handed the clone inputs as their plain physical batches (its bookkeeping reads their shapes
    outside the clone forward); ``marks`` maps each one's position among the flattened ``(args, kwargs)`` to its
    physical shape and state flag, and ``fn`` gets them back there as clone batches (a position that holds no tensor
    of that shape is an error, never a recomputation on the wrong rows). The clones that parameter slots hold now are
    put back for it, and it runs in clone mode."""
    slots: List[tuple] = list(parameter_slots.swapped())
    marks = dict(marks or {})

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if marks:
            leaves, spec = tree_flatten((args, kwargs))
            for i, (shape, state) in marks.items():
                leaf = leaves[i] if i < len(leaves) else None
                plain = isinstance(leaf, torch.Tensor) and type(leaf) is not CloneTensor
                if not (plain and tuple(leaf.shape) == shape):
                    raise RuntimeError(
                        f"jvpreg clone mode: torch.utils.checkpoint recomputed a region without the clone batch it "
                        f"kept as input {i} (of shape {shape}); the recomputation would run on the wrong rows. Call "
                        f"this region without checkpointing, or report your torch version ({torch.__version__}).")
                leaves[i] = wrap(leaf, state=state)
            args, kwargs = tree_unflatten(leaves, spec)
        saved = parameter_slots.put_in([s for s in slots if s[0].get(s[1]) is not s[2]])
        try:
            with active(), _EnableTorchFunction():
                return fn(*args, **kwargs)
        finally:
            parameter_slots.restore(saved)

    return run


_ROUTED = {name: _routed(original) for name, original in _ORIGINALS.items()}  # built once: install is two setattrs


def reentrant_rule(args, kwargs):
    """``CheckpointFunction.apply(run_function, preserve_rng_state, *inputs)``: the non-reentrant checkpoint."""
    run_function, preserve_rng_state, *inputs = args
    with _EnableTorchFunction():  # the rule is called with subclass dispatch off; the region's ops need it
        return torch_checkpoint.checkpoint(run_function, *inputs, use_reentrant=False,
                                           preserve_rng_state=preserve_rng_state)


functions.register_function_rule(torch_checkpoint.CheckpointFunction, always=True)(reentrant_rule)
register_route(install, uninstall)
