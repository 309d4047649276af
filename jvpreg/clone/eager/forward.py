"""The scope of a clone forward: :func:`active`, entered by every entry point that runs one eagerly or records one.

Inside, the forward's session (:mod:`jvpreg.clone.core.session`) runs with this floor's dispatcher
(:func:`jvpreg.clone.eager.dispatch.dispatch`) and every route installed; the modules the forward runs and the
containers it is passed are watched for the clone batches it stores there, which are released when the outermost
forward has ended, last of all (:mod:`jvpreg.clone.eager.stored_clones`). A replayed program runs no Python, so it
enters none.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from jvpreg.clone.core.session import Session, enter, leave
from jvpreg.clone.eager import stored_clones
from jvpreg.clone.eager.dispatch import dispatch


@contextlib.contextmanager
def active(called: Any = None, arguments: Any = ()) -> Iterator[Session]:
    """Scope of a clone forward (reentrant: a forward inside another joins its session). The clone batches the
    forward stores on the modules of ``called`` (the module or function it runs) and into the lists and dicts among
    ``arguments`` (its ``(args, kwargs)``) are replaced by their primals when the outermost forward ends.

    Example::

        >>> with active(model, ((xc,), {})):
        ...     out = model(xc)  # xc a clone batch (jvpreg.clone.pack); out one too
    """
    session = enter(dispatch)
    try:
        if called is not None or arguments:
            stored_clones.watch(session, called, arguments)
        yield session
    finally:
        leave(session)
        if session.depth == 0:  # the outermost forward ended: its routes are uninstalled, what it stored is released
            stored_clones.release(session)
