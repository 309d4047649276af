"""Input-space directions of simple data transformations, for ``ConstraintRegularizer(direction=...)``.

Each function has the signature ``direction(x, y) -> u`` with ``u`` of ``x``'s shape: the tangent of
a one-parameter transformation ``x(t)`` at ``t = 0``. A ``kind="zero"`` constraint along ``u`` makes
the model invariant to that transformation to first order. Select one from a Hydra config with
``direction: {_target_: hydra.utils.get_method, path: jvpreg.data.directions.contrast}``.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["brightness", "contrast"]


def contrast(x: torch.Tensor, y: Any = None) -> torch.Tensor:
    """Tangent of the contrast change ``x(t) = (1 + t) x``: ``u = x``."""
    return x


def brightness(x: torch.Tensor, y: Any = None) -> torch.Tensor:
    """Tangent of the brightness shift ``x(t) = x + t``: ``u = 1``."""
    return torch.ones_like(x)
