"""Few-step sampling of a mean-flow model: ``z_r = z_t - (t - r) u(z_t, r, t)`` from ``t = 1`` (noise) to ``0``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["sample"]


@torch.no_grad()
def sample(model: nn.Module, noise: torch.Tensor, steps: int = 1, labels: Optional[torch.Tensor] = None, *,
           time_order: str = "rt", label_key: str = "y") -> torch.Tensor:
    """``steps`` mean-flow jumps over equal intervals of ``[0, 1]``, starting at ``z_1 = noise``.

    Args:
        model: ``u(z, r, t, **{label_key: labels})`` (``time_order="tr"``: ``u(z, t, r, ...)``).
        noise: ``(B, ...)`` standard normal.
        steps: number of jumps (1: ``x = e - u(e, 0, 1)``).
        labels: class labels passed to the model, or ``None``.

    Example::

        >>> x = sample(dit, torch.randn(16, 1, 8, 8), steps=1, labels=torch.arange(16) % 10)
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"sample(model, noise, steps): expected steps to be an int >= 1, got {steps!r}.")
    if time_order not in ("rt", "tr"):
        raise ValueError(f"sample(...): expected time_order 'rt' or 'tr', got {time_order!r}.")
    kwargs = {} if labels is None else {label_key: labels}
    z = noise
    grid = torch.linspace(1.0, 0.0, steps + 1, dtype=noise.dtype, device=noise.device)
    for t_, r_ in zip(grid[:-1], grid[1:]):
        t, r = t_.expand(z.shape[0]), r_.expand(z.shape[0])
        u = model(z, r, t, **kwargs) if time_order == "rt" else model(z, t, r, **kwargs)
        z = z - (t_ - r_) * u
    return z
