"""What a forward keeps for backward, counted exactly (the RSS peak of a step moves 10-30% between runs)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable

import torch

__all__ = ["saved_bytes"]


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
