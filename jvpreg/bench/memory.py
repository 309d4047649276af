"""What a forward keeps for backward, counted exactly (the RSS peak of a step moves between runs)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable

import torch

__all__ = ["saved_bytes", "peak_live_bytes"]


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> float:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs, those of ``exclude``
    (e.g. the parameters) left out.

    Counted with ``torch.autograd.graph.saved_tensors_hooks``: a view counts its whole storage (it keeps it
    alive); a tensor with no storage of its own (a forward-AD dual, a functorch wrapper) counts its own size.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[Any, int] = {}

    def pack(t):
        try:
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        except RuntimeError:
            key, size = ("tensor", id(t)), t.numel() * t.element_size()
        if key not in skip:
            seen[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return float(sum(seen.values()))


def peak_live_bytes(fn: Callable[[], Any]) -> "float | None":
    """Peak bytes of live CPU tensors while ``fn()`` runs, above what was live when it started.

    Counted from the allocator's own events (``torch.profiler`` with ``profile_memory``, its memory timeline):
    what the program needs at its worst moment (activations, gradients, temporaries), independent of what
    glibc keeps or returns to the OS, which moves a step's RSS peak between runs, and more between methods
    with different allocation sizes. ``None`` where this torch's profiler has no memory timeline.
    """
    try:
        from torch.profiler import profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
            fn()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    except Exception:  # a private API: absent or changed in some torch versions
        return None
    totals = [sum(row) for row in sizes]
    return float(max(totals) - totals[0]) if totals else None
