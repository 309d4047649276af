"""Small UNet (Ronneberger et al., 2015) with an optional classification head."""

from __future__ import annotations

import torch
from torch import nn

from jvpreg.models._utils import check_positive_int

__all__ = ["DoubleConv", "Down", "Up", "UNet"]

_UPSAMPLE_MODES = ("transpose", "bilinear")


class DoubleConv(nn.Sequential):
    """``(Conv3x3 -> BatchNorm -> ReLU) x 2``; preserves the spatial size.

    Args:
        in_channels: Input channels.
        out_channels: Output channels of both convolutions.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=False),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=False),
        )


class Down(nn.Sequential):
    """``MaxPool2d(2) -> DoubleConv``; halves the spatial size.

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(nn.MaxPool2d(kernel_size=2), DoubleConv(in_channels, out_channels))


class Up(nn.Module):
    """Upsample by 2, concatenate the skip connection, then ``DoubleConv``.

    The upsampling maps ``in_channels -> in_channels // 2`` channels, either with
    a ``2x2`` stride-2 transposed convolution (``"transpose"``) or with bilinear
    upsampling followed by a ``1x1`` convolution (``"bilinear"``). The skip has
    ``in_channels // 2`` channels, so the ``DoubleConv`` maps ``in_channels ->
    in_channels // 2``.

    Args:
        in_channels: Channels of the coarse input (twice the skip's channels).
        mode: ``"transpose"`` or ``"bilinear"``.
    """

    def __init__(self, in_channels: int, mode: str = "transpose") -> None:
        super().__init__()
        half = in_channels // 2
        if mode == "transpose":
            self.up: nn.Module = nn.ConvTranspose2d(in_channels, half, kernel_size=2, stride=2)
        elif mode == "bilinear":
            self.up = nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                nn.Conv2d(in_channels, half, kernel_size=1),
            )
        else:
            raise ValueError(f"upsample must be one of {_UPSAMPLE_MODES}, got {mode!r}")
        self.conv = DoubleConv(in_channels, half)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """Upsample ``x``, concatenate ``[skip, up(x)]`` on channels and convolve."""
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """Standard UNet with configurable depth and width.

    Encoder level ``i`` (``0..depth``) has ``base_width * 2**i`` channels; each
    level below the first is reached by a ``2x2`` max-pool, so the input height
    and width must be divisible by ``2**depth``. The decoder mirrors it with
    upsampling and skip concatenations, ending at ``base_width`` channels.

    Output:
        - ``num_classes is None``: a ``1x1`` conv to ``out_channels`` gives an
          image ``(B, out_channels, H, W)`` (autoencoder / eigenvalue use).
        - ``num_classes`` set: global average pooling of the last decoder
          features (``base_width`` channels) and a ``Linear`` give
          ``(B, num_classes)`` logits (the paper's image-classification benchmark).
          No ``1x1`` output conv is built in that case.

    Args:
        in_channels: Input image channels.
        out_channels: Output image channels when ``num_classes`` is None;
            defaults to ``in_channels``.
        depth: Number of down/up-sampling stages.
        base_width: Channels of the first level.
        num_classes: If set, add the classification head described above.
        upsample: ``"transpose"`` (transposed conv) or ``"bilinear"`` (bilinear
            upsample + ``1x1`` conv).
    """

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int | None = None,
        depth: int = 4,
        base_width: int = 32,
        num_classes: int | None = None,
        upsample: str = "transpose",
    ) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.out_channels = (
            in_channels if out_channels is None else check_positive_int(out_channels, "out_channels")
        )
        self.depth = check_positive_int(depth, "depth")
        self.base_width = check_positive_int(base_width, "base_width")
        self.num_classes = None if num_classes is None else check_positive_int(num_classes, "num_classes")
        if upsample not in _UPSAMPLE_MODES:
            raise ValueError(f"upsample must be one of {_UPSAMPLE_MODES}, got {upsample!r}")

        widths = [base_width * 2**i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, widths[0])
        self.downs = nn.ModuleList(Down(widths[i], widths[i + 1]) for i in range(depth))
        self.ups = nn.ModuleList(Up(widths[i + 1], upsample) for i in reversed(range(depth)))
        if self.num_classes is None:
            self.outc: nn.Module | None = nn.Conv2d(widths[0], self.out_channels, kernel_size=1)
            self.head: nn.Module | None = None
        else:
            self.outc = None
            self.head = nn.Sequential(
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[0], self.num_classes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the UNet.

        Args:
            x: Images ``(B, in_channels, H, W)`` with ``H`` and ``W`` divisible by
                ``2**depth``.

        Returns:
            ``(B, out_channels, H, W)`` if ``num_classes`` is None, else
            ``(B, num_classes)``.

        Raises:
            ValueError: If the input is not 4-D, has the wrong number of channels,
                or a spatial size not divisible by ``2**depth``.
        """
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"UNet expects input of shape (B, {self.in_channels}, H, W), got {tuple(x.shape)}"
            )
        factor = 2**self.depth
        height, width = x.shape[-2:]
        if height % factor or width % factor:
            raise ValueError(
                f"UNet(depth={self.depth}) needs H and W divisible by {factor}, got {height}x{width}"
            )
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        h = skips.pop()
        for up in self.ups:
            h = up(h, skips.pop())
        if self.head is not None:
            return self.head(h)
        assert self.outc is not None
        return self.outc(h)
