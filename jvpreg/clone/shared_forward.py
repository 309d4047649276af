"""The shared clone forward of a module call, as the penalties (:func:`jvpreg.losses.regularized_forward`) and the
callbacks (:class:`jvpreg.callbacks.SharedForward`) run it: one place decides where the tangent rows enter the call.

The input ``x`` of the call carries directions ``u`` (shape ``(k, *x.shape)``). They are packed, ``[x; x + s u]``:

* inside the program (:meth:`SharedCall.packed`), which is then ``(args, u, s) -> (f(x), J u, s)``, packing and
  unpacking recorded with the model's ops as :func:`jvpreg.jvp`'s are, wherever :meth:`SharedCall.packs` says so:
  on the captured and compiled engines, for a module whose arguments are no containers (a list, tuple or dict
  the forward could write into would be rebuilt inside the program, and the writes lost) and that receives ``x``
  once (found again by identity), with no hook outside the call that would see plain tensors where it expects
  the clone batch, and only the input carrying directions (parameter clones are swapped in before the call);
* else before the call: the caller passes the clone batch (:func:`jvpreg.clone.pack`), with the perturbed
  parameters swapped for their clones (:func:`swapped_clones`), runs it with :meth:`SharedCall.__call__` and
  splits the output with :func:`jvpreg.clone.unpack`. Both give the same numbers.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from jvpreg.clone.api import call, checked_scales, host_scales, packable, packed_call
from jvpreg.clone.eager import forward
from jvpreg.clone.eager.parameter_slots import swapped_tensors
from jvpreg.clone.program import capture

__all__ = ["SharedCall", "packed_scales", "swapped_clones"]


class SharedCall:
    """One module's shared clone forward: the engine it runs on, the code it clones, where its input is packed.

    Args:
        module: the module (or function) the caller calls; a ``torch.compile``-d one is cloned through its
            original code (the compiled engine compiles the clone program instead).
        engine: how the clone forward runs (see :func:`jvpreg.jvp`): ``"auto"``, ``"captured"``, ``"compiled"``,
            ``"graphed"`` or ``"eager"``.
        where: the caller, named in errors.

    Attributes:
        called: ``module`` as given.
        engine: the engine, ``"auto"`` resolved for a compiled module (:func:`jvpreg.jvp`'s rule).
        module: what the clone forward runs: ``module``, or the original under ``torch.compile``.

    Raises:
        ValueError: an unknown ``engine``.

    Example::

        >>> shared = SharedCall(model, "auto", where="my_step(model, x)")
        >>> if shared.packs((x,), {}, x):
        ...     s, finite = packed_scales(x, u)
        ...     out, tan, s = shared.packed((x,), {}, x, u, s, finite=finite)   # one program: (x, u, s) -> ...
        ... else:
        ...     (xc,), s = jvpreg.clone.pack((x,), (u,))
        ...     out, tan = jvpreg.clone.unpack(shared((xc,), {}), s)
    """

    def __init__(self, module: Any, engine: str = "auto", *, where: str = "jvpreg.clone.SharedCall(module)"):
        self.called = module
        self.engine = capture.resolve_engine(engine, module, where)
        self.module = capture.unwrap_compiled(module)

    def packs(self, args: Sequence[Any], kwargs: Mapping[str, Any], x: torch.Tensor, *,
              hooks_outside: bool = False) -> bool:
        """Whether ``module(*args, **kwargs)`` packs the directions of its argument ``x`` inside the program
        (:meth:`packed`): not on the eager engine, for a module, with no container among the arguments and ``x``
        among them once. ``hooks_outside``: a hook the call runs inside of (a forward hook of the module whose
        ``forward`` is the call) sees its arguments or output, and would see the plain ones."""
        return (self.engine != "eager" and not hooks_outside and isinstance(self.module, nn.Module)
                and packable(args, kwargs) and sum(v is x for v in (*args, *kwargs.values())) == 1)

    def packed(self, args: Sequence[Any], kwargs: Mapping[str, Any], x: torch.Tensor, u: torch.Tensor,
               s: Optional[torch.Tensor], *, fn: Optional[Callable] = None,
               finite: Optional[bool] = None) -> Tuple[Any, Any, torch.Tensor]:
        """``(f(x), J u, s)`` from one program ``(args, u, s) -> (f(x), J u, s)`` in which ``x`` (found among the
        arguments by identity) is replaced by ``[x; x + s u]`` (:func:`jvpreg.clone.api.packed_call`).

        ``s``, ``finite``: from :func:`packed_scales` (``s`` is ``None`` where the program chooses it).
        ``fn``: the code to record (default: the module's call, its hooks included; ``module.forward`` from
        inside the module's call)."""
        at = [i for i, v in enumerate((*args, *kwargs.values())) if v is x]
        if len(at) != 1:
            raise RuntimeError(f"SharedCall.packed: the input is passed {len(at)} times to {type(self.module).__name__}"
                               f"; pack it inside the program only where SharedCall.packs says so (it needs the input "
                               "once), else pass the clone batch (jvpreg.clone.pack) to the call.")
        return packed_call(self.module, tuple(args), kwargs, at[0], u, s, fn=self.module if fn is None else fn,
                           engine=self.engine, finite=True if finite else None)

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any], *, fn: Optional[Callable] = None) -> Any:
        """The call on clone arguments (from :func:`jvpreg.clone.pack`), run by the engine; its output is a clone
        batch for :func:`jvpreg.clone.unpack`. ``fn``: as in :meth:`packed`."""
        if fn is None:
            return call(self.module, args, kwargs, engine=self.engine)
        return capture.call(self.module, tuple(args), dict(kwargs), engine=self.engine, fn=fn)

    def forward_called(self) -> ContextManager[None]:
        """Inside: calling the module reaches its ``forward`` attribute, also where the module is compiled in place
        (``module.compile()``: its call runs the compiled ``_call_impl``, which Dynamo enters before ``forward``)."""
        if not capture.compiled_in_place(self.called):
            return contextlib.nullcontext()
        return _uncompiled_call(self.called)


@contextlib.contextmanager
def _uncompiled_call(module: nn.Module) -> Iterator[None]:
    """Inside: ``module``, compiled in place, calls its plain ``_call_impl``."""
    compiled, module._compiled_call_impl = module._compiled_call_impl, None
    try:
        yield
    finally:
        module._compiled_call_impl = compiled


def packed_scales(x: torch.Tensor, u: torch.Tensor, scale: Any = "auto") -> Tuple[Optional[torch.Tensor],
                                                                                  Optional[bool]]:
    """``(s, finite)`` for :meth:`SharedCall.packed`: the ``(k,)`` scales of ``x`` with directions ``u``
    (:func:`jvpreg.clone.scales`) and whether ``x`` and ``u`` are all finite (``None``: not known); ``(None, None)``
    for ``"auto"`` on an accelerator, where the program chooses them with kernels (a read would wait for the
    device). A CPU ``s`` may be shared by calls with the same scales: read it, never write to it."""
    if scale == "auto" and not host_scales(x):
        return None, None
    return checked_scales([(x, u)], u.shape[0], scale)


@contextlib.contextmanager
def swapped_clones(module: nn.Module, replace: Mapping[torch.Tensor, torch.Tensor], *,
                   watch: bool = True) -> Iterator[None]:
    """Scope of a clone forward of ``module`` in which each tensor ``p`` of it is ``replace[p]`` (a clone batch from
    :func:`jvpreg.clone.clone_of`, tied uses included; :func:`jvpreg.clone.swapped_tensors`).

    Clone mode is on from entry, so hooks around the call (FSDP2's post-forward) may read the clone output before it
    is unpacked. ``watch``: the scope runs ``module`` itself (eager clone mode), so the clone batches its forward
    stores on its submodules are made their primals at the end; ``False`` where the call inside is
    :meth:`SharedCall.__call__` or :func:`jvpreg.clone.call`, which do so for the calls they do not replay."""
    with forward.active(module if watch else None), \
            swapped_tensors(module, replace) if replace else contextlib.nullcontext():
        yield
