"""``torch.compile``-d code called inside a clone forward runs its original code.

Dynamo cannot trace a clone batch (its tensors report the primal's shape, and ``Tensor._is_view`` has no clone rule),
so a compiled function that the model calls on one (Hugging Face's compiled flex attention, a user's compiled helper)
would fail inside the clone forward. While a clone forward runs, Dynamo's stance is ``"force_eager"``
(``torch.compiler.set_stance``): every compiled function and module runs its original code, op by op through the
clone rules, as :func:`jvpreg.clone.capture.uncompiled` does for compiled modules; and a capture (``make_fx``) that
meets a compiled function traces its original code (``torch._dynamo.config.error_on_nested_fx_trace`` off). The compiled engine's own program
runs with the stance the caller had (:func:`caller_stance`), so it stays compiled.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch
import torch._dynamo

_SET_STANCE = getattr(torch.compiler, "set_stance", None)
_PRIOR: List[object] = []  # per outermost clone forward: the object that restores the caller's stance (or None)
_NESTED_FX: List[bool] = []


def force_eager() -> None:
    """Set the ``"force_eager"`` stance (called when the outermost clone forward starts)."""
    config = torch._dynamo.config
    _NESTED_FX.append(config.error_on_nested_fx_trace)
    config.error_on_nested_fx_trace = False
    prior = None
    if _SET_STANCE is not None and not torch.compiler.is_compiling():
        try:
            prior = _SET_STANCE("force_eager")
        except RuntimeError:  # inside a torch.compile region: Dynamo is tracing this code, leave it be
            prior = None
    _PRIOR.append(prior)


def restore() -> None:
    """Put the caller's stance back (called when the outermost clone forward ends)."""
    prior = _PRIOR.pop() if _PRIOR else None
    if prior is not None:
        prior.__exit__(None, None, None)
    if _NESTED_FX:
        torch._dynamo.config.error_on_nested_fx_trace = _NESTED_FX.pop()


@contextlib.contextmanager
def caller_stance() -> Iterator[None]:
    """The stance the caller had, inside a clone forward (the compiled engine's program is compiled code)."""
    prior = _PRIOR[-1] if _PRIOR else None
    if prior is None or not hasattr(prior, "prev"):
        yield
        return
    from torch._dynamo.eval_frame import _set_stance

    now = _set_stance(prior.prev)
    try:
        yield
    finally:
        _set_stance(now)
