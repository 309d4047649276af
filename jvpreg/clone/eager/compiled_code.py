"""``torch.compile``-d code called inside a clone forward runs its original code.

Dynamo cannot trace a clone batch (its tensors report the primal's shape while holding K blocks), so a compiled
function that the model calls on one (Hugging Face's compiled flex attention, a user's compiled helper) would fail
inside the clone forward. While a clone forward runs, Dynamo's stance is ``"force_eager"``
(``torch.compiler.set_stance``): every compiled function and module runs its original code, op by op through the
clone rules, as :func:`jvpreg.clone.program.capture.uncompiled` does for compiled modules; and a capture (``make_fx``) that
meets a compiled function traces its original code (``torch._dynamo.config.error_on_nested_fx_trace`` off while it
records: :func:`traced_through`). The compiled engine's own program
runs with the stance the caller had (:func:`caller_stance`), so it stays compiled.

The other way round, jvpreg called from a compiled function (a whole training step under ``torch.compile``): its
public entry points are :func:`between_graphs`, so Dynamo breaks its graph at the call and the engine runs as plain
Python between the graphs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch._dynamo

from jvpreg.clone.core.session import Session, current, register_route

try:  # torch.compiler.set_stance's own setter (2.6+) and the stance built once (set_stance builds both at every call)
    from torch._dynamo.eval_frame import DynamoStance, _set_stance

    _FORCE_EAGER = DynamoStance("force_eager")
except ImportError:  # pragma: no cover - torch without stances: compiled functions are left as they are
    _set_stance = None


BETWEEN_GRAPHS = ("jvpreg's engine runs between torch.compile graphs (Dynamo cannot trace clone batches); call it "
                  "outside fullgraph=True regions")


def between_graphs(fn):
    """``fn`` made opaque to Dynamo (``torch.compiler.disable``): a compiled caller runs it between its graphs."""
    try:
        return torch.compiler.disable(fn, reason=BETWEEN_GRAPHS)
    except TypeError:  # pragma: no cover - torch before reason= (2.1-2.5)
        return torch.compiler.disable(fn)


def force_eager(session: Session) -> None:
    """Set the ``"force_eager"`` stance (when the outermost clone forward starts); the caller's is kept in the
    session (``None``: left as it was)."""
    prior = None
    if _set_stance is not None:
        try:
            prior = _set_stance(_FORCE_EAGER)
        except RuntimeError:  # inside a torch.compile region: Dynamo is tracing this code, leave it be
            prior = None
    session.saved[__name__] = prior


def restore(session: Session) -> None:
    """Put the caller's stance back (when the outermost clone forward ends)."""
    prior = session.saved.pop(__name__, None)
    if prior is not None:
        _set_stance(prior)


register_route(force_eager, restore)


@contextlib.contextmanager
def traced_through() -> Iterator[None]:
    """Inside: ``make_fx`` (a capture) traces a compiled function's original code instead of raising."""
    config = torch._dynamo.config
    before = config.error_on_nested_fx_trace
    config.error_on_nested_fx_trace = False
    try:
        yield
    finally:
        config.error_on_nested_fx_trace = before


@contextlib.contextmanager
def caller_stance() -> Iterator[None]:
    """The stance the caller had, inside a clone forward (the compiled engine's program is compiled code)."""
    session = current()
    prior = None if session is None else session.saved.get(__name__)
    if prior is None:
        yield
        return
    now = _set_stance(prior)
    try:
        yield
    finally:
        _set_stance(now)
