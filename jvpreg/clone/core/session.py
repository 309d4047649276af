"""The state of a running clone forward, in one object: its :class:`Session`.

A clone forward (:func:`jvpreg.clone.eager.forward.active`, where every entry point runs one) opens a session when no
other clone forward runs in its context; a clone forward started inside it (a sub-call, a checkpointed region's
recomputation, an FSDP unit's body) joins it (``depth``). The session lives in a :class:`contextvars.ContextVar`, so
what one forward holds is its own and goes with it: nothing is left in the engine's modules when it ends.

*Dispatch.* The session carries the dispatcher it was opened with (``dispatch``), which
:meth:`CloneTensor.__torch_function__ <jvpreg.clone.core.tensor.CloneTensor.__torch_function__>` calls: the floor
that routes ops hands itself to the clone batch with every forward, instead of filling a slot of this floor at import.

*Routes.* Code out of ``__torch_function__``'s sight (custom autograd Functions, checkpointing, compiled code,
TorchScript, ``torch.func`` transforms, tensor factories, FlexAttention) is reached by patching torch's entry points
while a clone forward runs. Each route registers ``(install, uninstall)`` when its module is imported
(:func:`register_route`); the outermost forward installs them all, in that order, when it opens its session
(:func:`enter`), and uninstalls them in the reverse order when it ends (:func:`leave`), once the session is closed.
Outside a clone forward nothing of torch is patched.

Not in a session, since they span several forwards and a replayed program runs without one: the user's settings
(the fallback mode and :func:`~jvpreg.clone.eager.dispatch.record_fallbacks`,
:func:`~jvpreg.clone.core.device_paths.accelerator_path`) and the parameter slots swapped for clones
(:mod:`jvpreg.clone.eager.parameter_slots`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["Session", "current", "enter", "leave", "holding", "register_route", "ROUTES"]

Route = Tuple[Callable[["Session"], None], Callable[["Session"], None]]
#: ``(install, uninstall)`` of every route, in the order their modules registered them (a table, filled at import)
ROUTES: List[Route] = []


class Session:
    """One outermost clone forward and the clone forwards nested in it.

    Attributes:
        dispatch: ``dispatch(func, args, kwargs)``, called for every torch function that meets a clone batch.
        transform_level: the ``torch.func`` interpreter level the forward began at (-1: none); a clone batch met by
            an op at a deeper level reached a transform by closure (:mod:`jvpreg.clone.eager.nested_transforms`).
        depth: the clone forwards running in the session (1: the outermost alone).
        tracer: the tracer while :mod:`jvpreg.clone.program.capture` records the forward, else ``None``.
        compiling: the capture under way records a program for ``engine="compiled"``.
        record_checkpoint: while a capture records, what a checkpoint with gradients runs instead of torch's
            (:func:`jvpreg.clone.program.checkpointed_regions.open_region`), else ``None``.
        region: the checkpointed region whose nodes the tracer records now (``None``: none).
        made: ``id -> weakref`` of the floating-point tensors the factories made in the forward
            (:mod:`jvpreg.clone.eager.made_tensors`).
        watched_modules: the modules the forward runs, searched for stored clone batches at its end
            (:mod:`jvpreg.clone.eager.stored_clones`).
        watched_arguments: ``(a list or dict the forward was passed, ids of the clone batches it held then)``.
        saved: what a route saved when it was installed, to put back when it is uninstalled, under its module's name.
    """

    __slots__ = ("dispatch", "transform_level", "depth", "tracer", "compiling", "record_checkpoint", "region", "made",
                 "watched_modules", "watched_arguments", "saved")

    def __init__(self, dispatch: Callable[[Callable, tuple, dict], Any]):
        top = torch._C._functorch.peek_interpreter_stack()
        self.dispatch = dispatch
        self.transform_level = -1 if top is None else top.level()
        self.depth = 0
        self.tracer: Any = None
        self.compiling = False
        self.record_checkpoint: Optional[Callable[[Dict[str, Any]], Iterator[None]]] = None
        self.region: Any = None
        self.made: Dict[int, Any] = {}
        self.watched_modules: List[Any] = []
        self.watched_arguments: List[Tuple[Any, set]] = []
        self.saved: Dict[str, Any] = {}


_CURRENT: contextvars.ContextVar[Optional[Session]] = contextvars.ContextVar("jvpreg_clone_session", default=None)

#: ``current()``: the :class:`Session` of the clone forward running in this context, or ``None`` (one C call: the
#: clone batch asks it for every op)
current = _CURRENT.get


def register_route(install: Callable[[Session], None], uninstall: Callable[[Session], None]) -> None:
    """Install ``install(session)`` when an outermost clone forward opens its session and ``uninstall(session)`` when
    it ends (called by each route's module when it is imported)."""
    ROUTES.append((install, uninstall))


def register_patches(replacements: Dict[Tuple[Any, str], Any]) -> None:
    """A route that sets ``owner.name = replacement`` for each ``(owner, name)`` while a clone forward runs, and puts
    back what was there when it was registered."""
    originals = {key: getattr(*key) for key in replacements}

    def install(session: Session) -> None:
        for (owner, name), replacement in replacements.items():
            setattr(owner, name, replacement)

    def uninstall(session: Session) -> None:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)

    register_route(install, uninstall)


def enter(dispatch: Callable[[Callable, tuple, dict], Any]) -> Session:
    """The session of a clone forward that starts: a new one with every route installed if no clone forward runs in
    this context, else the one that runs; its ``depth`` one more. Each :func:`enter` is paired with a :func:`leave`
    (:func:`jvpreg.clone.eager.forward.active` pairs them)."""
    session = _CURRENT.get()
    if session is None:
        session = Session(dispatch)
        _CURRENT.set(session)
        try:
            for install, _ in ROUTES:
                install(session)
        except BaseException:
            _close(session)
            raise
    session.depth += 1
    return session


def leave(session: Session) -> None:
    """The clone forward that :func:`enter` gave ``session`` to ends; the outermost closes it: no forward runs from
    here on (the routes' last steps see none), then every route is uninstalled, the last installed first."""
    session.depth -= 1
    if session.depth == 0:
        _close(session)


def _close(session: Session) -> None:
    _CURRENT.set(None)
    for _, uninstall in reversed(ROUTES):
        uninstall(session)


@contextlib.contextmanager
def holding(**values: Any) -> Iterator[None]:
    """Inside, the current session's fields named take ``values``; they are put back after (a capture nested in an
    eager forward leaves the forward as it found it).

    Example::

        >>> with holding(tracer=tracer):  # the capture records from here on
        ...     out = fn(*args)
    """
    session = _CURRENT.get()
    if session is None:
        raise RuntimeError("jvpreg clone mode: holding() sets fields of the running clone forward's session; enter "
                           "one first (jvpreg.clone.eager.forward.active)")
    before = {name: getattr(session, name) for name in values}
    for name, value in values.items():
        setattr(session, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(session, name, value)
