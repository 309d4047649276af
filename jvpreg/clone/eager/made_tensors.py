"""Tensors a forward makes from sizes alone and then fills with batch data.

``out = torch.zeros(x.shape[0], c, m); out[..., :k] = f(x)`` (a Fourier neural operator's spectral convolution,
a decoder loop's ``outputs[:, t] = h``, a scatter into ``torch.zeros``) writes batch data into a tensor that the
forward made with a factory. Such a tensor is a plain tensor of the primal's shape, which cannot hold the blocks of
a clone batch. While a clone forward runs, the factories (``torch.zeros``, ``ones``, ``empty``, ``full``, their
``_like`` forms and ``Tensor.new_*``) note the floating-point tensors they make; the first write of batch data
into one of them turns it, in place, into a state clone (every block its current value, zero tangent, as
``torch.func.jvp`` has a constant) and the write lands block by block. The user's variable keeps pointing at the
same tensor object, now ``K`` blocks (:func:`fill_or_refuse`, the one place every write site asks).

Exact: before the write the tensor does not depend on the input, and the write is the ordinary clone write.
Refused (the write raises :class:`jvpreg.clone.eager.dispatch.BatchWriteError`, as before): a tensor that a view or
another tensor shares memory with (their reads would not see the blocks), one that requires grad, and tensors that
were not made during this clone forward (a buffer, a cache, a tensor passed in). A captured program records the
promotion as the ops that build the blocks. Cost: one Python call per factory call in eager clone mode and
capture; a captured program replays none of it.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Optional

import torch
from torch._C import DisableTorchFunctionSubclass

from jvpreg.clone.core.errors import BatchWriteError, STATE_WRITE_HINT
from jvpreg.clone.core.session import current, register_patches
from jvpreg.clone.core.tensor import CloneTensor, capturing, claim, iter_clones, tile, track

_FACTORIES = {
    torch: ("zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like"),
    torch.Tensor: ("new_zeros", "new_ones", "new_empty", "new_full"),
}
_ORIGINALS: Dict[tuple, Callable] = {(owner, name): getattr(owner, name)
                                     for owner, names in _FACTORIES.items() for name in names}


def _noting(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def make(*args, **kwargs):
        out = factory(*args, **kwargs)
        if type(out) is torch.Tensor and (out.is_floating_point() or out.is_complex()):
            session = current()
            if session is not None:  # (none in a thread the clone forward does not run in)
                session.made[id(out)] = weakref.ref(out)  # by id: a WeakSet would compare tensors with ==
        return out

    return make


_NOTING = {key: _noting(original) for key, original in _ORIGINALS.items()}  # built once: install is setattrs
#: noting factory -> the plain one: ``__torch_function__`` receives the function torch looks up at call time, and the
#: engine's rules are registered for the plain ones (:func:`jvpreg.clone.eager.dispatch.dispatch` maps it back)
ORIGINAL_OF: Dict[Callable, Callable] = {_NOTING[key]: original for key, original in _ORIGINALS.items()}


def _known_to_torchscript() -> None:
    """TorchScript, which torch may run inside a forward (its forward-AD decompositions are scripted on first use),
    maps ``torch.zeros`` to ``aten::zeros`` by the function's identity: the noting factories map to the same ops.
    Its table is built first, from the plain factories."""
    try:
        from torch.jit import _builtins

        table = _builtins._get_builtin_table()
        for key, noting in _NOTING.items():
            op = table.get(id(_ORIGINALS[key]))
            if op is not None:
                table[id(noting)] = op
    except (ImportError, AttributeError):  # no such table in this torch: nothing maps
        pass


_known_to_torchscript()


register_patches(_NOTING)  # factories note what they make in the session while a clone forward runs


def _made(target: Any) -> bool:
    """``target`` is a tensor a factory made in the running clone forward."""
    session = current()
    made = None if session is None else session.made.get(id(target))
    return made is not None and made() is target


def blocks_of(*values: Any) -> Optional[int]:
    """The block count ``K`` of the first clone among ``values`` (pytrees), or ``None``."""
    clone = next(iter_clones(values), None)
    if clone is None:
        return None
    with DisableTorchFunctionSubclass():
        return clone.shape[0]


def _sole(t: torch.Tensor) -> bool:
    """No other tensor (a view taken before the write) shares ``t``'s memory: the storage is held by ``t`` and by
    the storage object made to ask."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2
    except (AttributeError, RuntimeError, NotImplementedError):  # no such query (older torch), or no storage
        return False


def _why_not(target: Any) -> str:
    """For a refused write's error: why a tensor this forward made was not filled (``""`` for any other tensor)."""
    if not _made(target):
        return ""
    if target.requires_grad:
        return " (The tensor was made in this forward but requires grad: make it without requires_grad=True.)"
    return (" (The tensor was made in this forward, but a view of it was taken before this write, which would not see "
            "the batch's blocks: take views after the writes.)")


def _promoted(target: Any, k: Optional[int]) -> bool:
    """Turn ``target``, a plain tensor made by a factory in this clone forward, into a state clone of ``k`` blocks
    (in place: the same Python object) so that batch data can be written into it; ``False`` where that would not be
    exact (see the module docstring)."""
    if (k is None or type(target) is not torch.Tensor or not _made(target) or target.requires_grad
            or target._base is not None or not _sole(target)):
        return False
    with DisableTorchFunctionSubclass():
        phys = tile(target, k)
        target.data = phys  # the same tensor object, now K blocks (a capture records tile's ops, not this)
    target.__class__ = CloneTensor
    target._jvp_state = True
    claim(target, phys)
    if capturing():
        track(target, phys)
    del current().made[id(target)]
    return True


def fill_or_refuse(target: Any, k: Optional[int], refusal: str) -> None:
    """A write of ``k``-block batch data into the plain tensor ``target``: promote it (a tensor this forward made),
    or raise :class:`jvpreg.clone.eager.dispatch.BatchWriteError` with ``refusal`` (what the write was and what to do), why
    a tensor this forward made was refused, and the state-write hint."""
    if _promoted(target, k):
        return

    raise BatchWriteError(refusal + _why_not(target) + STATE_WRITE_HINT)
