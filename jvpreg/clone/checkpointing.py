"""Activation checkpointing (``torch.utils.checkpoint``) in clone mode.

A checkpointed region drops the activations it would save for backward and, in the backward pass, calls its function
again on its inputs to recompute them. In clone mode the inputs are clone batches and the recomputation runs after
the clone forward has ended, where a clone batch has no rules to run. While a clone forward runs, the engine therefore
hands torch's checkpoint a function whose recomputation is a clone forward again: the same rules on the same clone
inputs, with the parameter slots that held clones during the forward (weight directions) holding them again. It
recomputes the same ops, so it saves the same tensors (torch's determinism check compares them), and the memory is
that of a checkpointed forward of the clone batch.

* ``use_reentrant=False`` (timm's and Hugging Face's default): the recomputed function is swapped in where torch
  builds the checkpoint (``_checkpoint_without_reentrant_generator[_impl]``, which takes the function first);
* ``use_reentrant=True``: ``CheckpointFunction`` is routed to the non-reentrant form (the same gradients, also
  where the reentrant form drops those of a region whose inputs need none);
* older torch (2.11) keeps the region's inputs with a ``_NoopSaveInputs`` autograd.Function: it runs as it is.

A captured program replays the ops without the recomputation, so it would keep every activation a checkpoint drops:
with gradients enabled, a checkpointed region is not captured and the call runs in eager clone mode
(:class:`jvpreg.JVPCaptureWarning` says so once); without gradients nothing is saved, and it is captured.
"""
from __future__ import annotations

import functools
from typing import Callable, List

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch._C import _EnableTorchFunction

from . import api, functions
from .tensor import _SWAPPED_CLONES, capturing, iter_clones

_NAMES = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")
_ORIGINALS = {name: getattr(torch_checkpoint, name) for name in _NAMES if hasattr(torch_checkpoint, name)}

NOT_CAPTURED = ("activation checkpointing (torch.utils.checkpoint): a captured program would keep every activation "
                "the checkpoint drops")


def install() -> None:
    """Route checkpoints whose inputs hold clone batches (called when the outermost clone forward starts)."""
    for name, original in _ORIGINALS.items():
        setattr(torch_checkpoint, name, _routed(original))


def uninstall() -> None:
    for name, original in _ORIGINALS.items():
        setattr(torch_checkpoint, name, original)


def _routed(original: Callable) -> Callable:
    @functools.wraps(original)
    def generator(fn, *args, **kwargs):
        if next(iter_clones((args, kwargs)), None) is not None:
            if capturing() and torch.is_grad_enabled():
                from .capture import CaptureError

                raise CaptureError(NOT_CAPTURED)
            fn = recomputed_in_clone_mode(fn)
        return original(fn, *args, **kwargs)

    return generator


def recomputed_in_clone_mode(fn: Callable) -> Callable:
    """``fn`` as a clone forward wherever it is called: inside the clone forward it is ``fn``; in the backward pass
    (the recomputation) it puts back the clones that parameter slots hold now, and runs ``fn`` in clone mode."""
    slots: List[tuple] = list(_SWAPPED_CLONES)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        saved = api.put_in([s for s in slots if s[0].get(s[1]) is not s[2]])
        try:
            with functions.active(), _EnableTorchFunction():
                return fn(*args, **kwargs)
        finally:
            api.restore(saved)

    return run


def reentrant_rule(args, kwargs):
    """``CheckpointFunction.apply(run_function, preserve_rng_state, *inputs)``: the non-reentrant checkpoint."""
    run_function, preserve_rng_state, *inputs = args
    with _EnableTorchFunction():  # the rule is called with subclass dispatch off; the region's ops need it
        return torch_checkpoint.checkpoint(run_function, *inputs, use_reentrant=False,
                                           preserve_rng_state=preserve_rng_state)


def _save_inputs_rule(args, kwargs):
    """``_NoopSaveInputs`` (older torch keeps a checkpoint's inputs with it): it saves them as they are."""
    return functions._orig(torch_checkpoint._NoopSaveInputs, *args, **kwargs)


functions.register_function_rule(torch_checkpoint.CheckpointFunction)(reentrant_rule)
if hasattr(torch_checkpoint, "_NoopSaveInputs"):
    functions.register_function_rule(torch_checkpoint._NoopSaveInputs)(_save_inputs_rule)
