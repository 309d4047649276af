"""A small DiT (Peebles & Xie, 2023) for mean-flow / consistency models: ``u = DiT(z, r, t, y)``.

Patchify (a stride-``p`` convolution) plus a fixed 2-d sin-cos position table, ``depth`` adaLN-zero
blocks (``x += g1 * Attn(modulate(LN(x), b1, a1)); x += g2 * MLP(modulate(LN(x), b2, a2))`` with
``(b, a, g)`` from the conditioning ``c = emb(t) + emb(t - r) + emb(y)``), an adaLN final layer and
unpatchify. Attention runs through ``F.scaled_dot_product_attention`` (fused kernels where the
backend allows). Every reshape uses positional shapes.

Implementation choices: the two time inputs are embedded as ``t`` and ``t - r`` (the interval length;
MeanFlow's default), each by sinusoidal features of the time (unscaled: see
:class:`TimeEmbedding`) and a 2-layer SiLU MLP; the class embedding has ``num_classes + 1`` rows, the last one
the "null" label that classifier-free-guidance training puts in place of dropped labels
(:attr:`DiT.null_label`). As in DiT, the modulation and output layers start at zero (``zero_init=False``
leaves PyTorch's init, which tests use so that every parameter gets a gradient).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from jvpreg.models._utils import check_positive_int, to_pair

__all__ = ["DiT", "DiTBlock", "TimeEmbedding", "sincos_table"]


def sincos_table(dim: int, grid: tuple) -> torch.Tensor:
    """Fixed 2-d sin-cos position table ``(h * w, dim)`` (half the features per axis)."""
    h, w = grid
    quarter = dim // 4
    freqs = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    parts = []
    for pos in (ys.flatten(), xs.flatten()):
        angle = pos[:, None] * freqs[None]
        parts += [angle.sin(), angle.cos()]
    table = torch.cat(parts, dim=1)
    return F.pad(table, (0, dim - table.shape[1])).float()


class TimeEmbedding(nn.Module):
    """``MLP(sin/cos(t * f_k))``, ``f_k = 10000^(-k/K)``: a scalar time per sample ``(B,)`` to ``(B, dim)``.

    Times in ``[0, 1]`` enter unscaled (no ``1000 t`` as in diffusion codebases): the mean-flow target holds
    ``∂u/∂t``, which a ``1000 t`` embedding multiplies by up to 1000.

    Args:
        dim: output width.
        freq_dim: number of sinusoidal features (half sines, half cosines).
    """

    def __init__(self, dim: int, freq_dim: int = 64) -> None:
        super().__init__()
        self.freq_dim = check_positive_int(freq_dim, "freq_dim")
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(freq_dim // 2) / (freq_dim // 2)),
                             persistent=False)
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        angle = t[:, None] * self.freqs.to(t.dtype)[None]
        return self.mlp(torch.cat([angle.cos(), angle.sin()], dim=1))


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift`` with per-sample ``shift, scale: (B, D)`` over tokens ``x: (B, N, D)``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """adaLN-zero transformer block: self-attention and an MLP, each gated by the conditioning.

    Args:
        dim: token width; heads: attention heads (``dim % heads == 0``); mlp_ratio: MLP width / dim.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b1, a1, g1, b2, a2, g2 = self.ada(c).chunk(6, dim=1)
        x = x + g1.unsqueeze(1) * self.attention(modulate(self.norm1(x), b1, a1))
        return x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), b2, a2))


class DiT(nn.Module):
    """Small class-conditional DiT taking two times: ``forward(z, r, t, y=None) -> u`` of ``z``'s shape.

    Args:
        in_channels: image channels.
        image_size: ``(H, W)`` or ``S``, divisible by ``patch_size``.
        patch_size: side of a square patch.
        dim: token width. depth: number of blocks. heads: attention heads. mlp_ratio: MLP width / dim.
        num_classes: class labels ``0..num_classes-1`` plus the null label ``num_classes``; ``None``:
            unconditional (``y`` must then be ``None``).
        zero_init: start the modulation and output layers at zero (DiT's adaLN-zero).

    Raises:
        TypeError/ValueError: non-positive sizes, ``dim`` not divisible by ``heads`` (or by 4),
            an image not divisible into patches.

    Example::

        >>> net = DiT(1, 8, patch_size=2, dim=64, depth=4, heads=4, num_classes=10)
        >>> u = net(z, r, t, y)          # z: (B, 1, 8, 8); r, t: (B,); y: (B,) int64
    """

    def __init__(self, in_channels: int = 1, image_size=8, *, patch_size: int = 2, dim: int = 64, depth: int = 4,
                 heads: int = 4, mlp_ratio: float = 4.0, num_classes: Optional[int] = 10,
                 zero_init: bool = True) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.patch_size = p = check_positive_int(patch_size, "patch_size")
        check_positive_int(dim, "dim")
        check_positive_int(depth, "depth")
        check_positive_int(heads, "heads")
        if dim % heads or dim % 4:
            raise ValueError(f"DiT(dim={dim}, heads={heads}): dim must be divisible by heads and by 4.")
        h, w = to_pair(image_size)
        if h % p or w % p:
            raise ValueError(f"DiT(image_size={(h, w)}, patch_size={p}): the image sides must be divisible by the "
                             "patch size.")
        self.grid = (h // p, w // p)
        self.num_classes = None if num_classes is None else check_positive_int(num_classes, "num_classes")
        self.patchify = nn.Conv2d(in_channels, dim, kernel_size=p, stride=p)
        self.register_buffer("pos", sincos_table(dim, self.grid)[None], persistent=False)
        self.t_embed = TimeEmbedding(dim)
        self.dt_embed = TimeEmbedding(dim)
        self.y_embed = None if num_classes is None else nn.Embedding(num_classes + 1, dim)
        self.blocks = nn.ModuleList(DiTBlock(dim, heads, mlp_ratio) for _ in range(depth))
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, p * p * in_channels)
        if zero_init:
            for lin in [blk.ada[1] for blk in self.blocks] + [self.final_ada[1], self.out]:
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)

    @property
    def null_label(self) -> Optional[int]:
        """The label index meaning "no class" (classifier-free guidance), or ``None`` when unconditional."""
        return self.num_classes

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, h*w, p*p*C)`` back to images ``(B, C, h*p, w*p)``."""
        b, p, c = x.shape[0], self.patch_size, self.in_channels
        h, w = self.grid
        x = x.reshape(b, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, c, h * p, w * p)

    def forward(self, z: torch.Tensor, r: torch.Tensor, t: torch.Tensor,
                y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Average velocity ``u(z, r, t | y)`` over ``[r, t]``: ``z (B, C, H, W)``, ``r, t (B,)``, ``y (B,)``."""
        x = self.patchify(z).flatten(2).transpose(1, 2) + self.pos.to(z.dtype)
        c = self.t_embed(t) + self.dt_embed(t - r)
        if self.y_embed is not None:
            if y is None:
                y = torch.full((z.shape[0],), self.num_classes, dtype=torch.long, device=z.device)
            c = c + self.y_embed(y)
        elif y is not None:
            raise ValueError("DiT(num_classes=None) is unconditional; call it without y.")
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        return self.unpatchify(self.out(modulate(self.final_norm(x), shift, scale)))
