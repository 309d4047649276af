"""A tiny time-conditioned conv UNet ``u = TimeUNet(z, r, t, y)`` for tests of mean-flow losses.

``jvpreg.models.UNet`` takes an image only; this one adds the two times and an optional class the
same way the DiT does (``c = emb(t) + emb(t - r) + emb(y)``, a per-channel bias in every block).
Two levels: ``conv -> block -> avg-pool -> block -> nearest upsample -> concat skip -> block -> conv``,
each block ``conv3x3 -> norm -> SiLU (+ c bias)``, with ``norm`` GroupNorm or (train-mode) BatchNorm.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from jvpreg.models._utils import check_positive_int
from jvpreg.models.dit import TimeEmbedding

__all__ = ["TimeUNet"]

_NORMS = ("group", "batch")


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, dim: int, norm: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(min(4, cout), cout) if norm == "group" else nn.BatchNorm2d(cout)
        self.cond = nn.Linear(dim, cout)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)) + self.cond(c)[:, :, None, None])


class TimeUNet(nn.Module):
    """Tiny two-level conv UNet with time and class conditioning; ``forward(z, r, t, y=None)``.

    Args:
        in_channels: image channels (the output has the same). width: channels of the first level.
        num_classes: labels ``0..num_classes-1`` plus the null label ``num_classes``; ``None``: unconditional.
        norm: ``"group"`` (GroupNorm) or ``"batch"`` (BatchNorm2d).

    Raises:
        ValueError: unknown ``norm``, odd image sides (checked in ``forward``).
    """

    def __init__(self, in_channels: int = 1, width: int = 16, *, num_classes: Optional[int] = 10,
                 norm: str = "group") -> None:
        super().__init__()
        if norm not in _NORMS:
            raise ValueError(f"TimeUNet(norm={norm!r}): expected one of {', '.join(map(repr, _NORMS))}.")
        self.in_channels = check_positive_int(in_channels, "in_channels")
        w = check_positive_int(width, "width")
        self.num_classes = None if num_classes is None else check_positive_int(num_classes, "num_classes")
        dim = 2 * w
        self.t_embed = TimeEmbedding(dim, freq_dim=16)
        self.dt_embed = TimeEmbedding(dim, freq_dim=16)
        self.y_embed = None if num_classes is None else nn.Embedding(num_classes + 1, dim)
        self.inc = nn.Conv2d(in_channels, w, 3, padding=1)
        self.down = _Block(w, w, dim, norm)
        self.mid = _Block(w, 2 * w, dim, norm)
        self.up = _Block(3 * w, w, dim, norm)
        self.outc = nn.Conv2d(w, in_channels, 3, padding=1)

    @property
    def null_label(self) -> Optional[int]:
        """The label index meaning "no class", or ``None`` when unconditional."""
        return self.num_classes

    def forward(self, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor,
                y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``u(z, r, t | y)`` of ``z``'s shape ``(B, C, H, W)`` (``H, W`` even); ``r, t, y: (B,)``."""
        if z.shape[-1] % 2 or z.shape[-2] % 2:
            raise ValueError(f"TimeUNet needs even image sides, got {tuple(z.shape[-2:])}.")
        c = self.t_embed(t) + self.dt_embed(t - r)
        if self.y_embed is not None:
            if y is None:
                y = torch.full((z.shape[0],), self.num_classes, dtype=torch.long, device=z.device)
            c = c + self.y_embed(y)
        h0 = self.down(self.inc(z), c)
        h1 = self.mid(F.avg_pool2d(h0, 2), c)
        h = self.up(torch.cat([h0, F.interpolate(h1, scale_factor=2.0, mode="nearest")], dim=1), c)
        return self.outc(h)
