"""Small networks for tests and the default (digits / MNIST / CIFAR) experiment."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from jvpreg.models._utils import check_positive_int, make_activation, to_pair

__all__ = ["MLP", "SmallCNN", "LeNet5"]


class MLP(nn.Sequential):
    """Fully connected classifier that flattens its input first.

    Layout: ``Flatten -> [Linear -> (BatchNorm1d) -> act -> (Dropout)] * len(hidden) -> Linear``.

    Args:
        in_features: Size of the flattened input (e.g. ``C * H * W``).
        hidden: Widths of the hidden layers (may be empty for a linear model).
        num_classes: Output dimension.
        activation: Activation name (see ``jvpreg.models._utils.ACTIVATIONS``) or
            a zero-argument callable returning an ``nn.Module``.
        dropout: Dropout probability after each hidden activation (0 disables it).
        batchnorm: Insert ``BatchNorm1d`` after each hidden ``Linear``.

    Shape:
        - Input: ``(B, *)`` with ``prod(*) == in_features``.
        - Output: ``(B, num_classes)``.
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (128, 128),
        num_classes: int = 10,
        activation: str | Callable[[], nn.Module] = "relu",
        dropout: float = 0.0,
        batchnorm: bool = False,
    ) -> None:
        check_positive_int(in_features, "in_features")
        check_positive_int(num_classes, "num_classes")
        if isinstance(hidden, int) or not isinstance(hidden, Sequence):
            raise TypeError(f"hidden must be a sequence of ints, got {hidden!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for i, h in enumerate(hidden):
            check_positive_int(h, f"hidden[{i}]")
            layers.append(nn.Linear(width, h, bias=not batchnorm))
            if batchnorm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(make_activation(activation))
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)
        self.in_features = in_features
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten ``x`` and return ``(B, num_classes)`` logits.

        Raises:
            ValueError: If ``x`` does not flatten to ``(B, in_features)``.
        """
        if x.dim() < 2 or x[0].numel() != self.in_features:
            raise ValueError(
                f"MLP expects (B, ...) inputs with {self.in_features} features per sample, "
                f"got shape {tuple(x.shape)}"
            )
        return super().forward(x)


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """``Conv3x3 (same padding) -> BatchNorm2d -> ReLU -> MaxPool2d(2)``."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2),
    )


class SmallCNN(nn.Module):
    """Two ``conv-BN-ReLU-maxpool`` blocks, global average pooling and a linear head.

    Channels are ``in_channels -> width -> 2 * width``. Since the head pools
    globally, any input of side ``>= 4`` works (8x8 digits, 28x28 MNIST,
    32x32 CIFAR, ...).

    Args:
        in_channels: Input image channels.
        num_classes: Output dimension.
        width: Channels of the first block (the second has ``2 * width``).
        image_size: Optional expected ``(H, W)`` or ``S``; only validated
            (``>= 4``), the network itself is size-agnostic.

    Shape:
        - Input: ``(B, in_channels, H, W)`` with ``H, W >= 4``.
        - Output: ``(B, num_classes)``.
    """

    min_size = 4

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 32,
        image_size: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.num_classes = check_positive_int(num_classes, "num_classes")
        self.width = check_positive_int(width, "width")
        if image_size is not None:
            h, w = to_pair(image_size)
            if min(h, w) < self.min_size:
                raise ValueError(
                    f"SmallCNN needs images of at least {self.min_size}x{self.min_size}, got {h}x{w}"
                )
        self.features = nn.Sequential(_conv_block(in_channels, width), _conv_block(width, 2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``(B, num_classes)`` logits for images ``(B, in_channels, H, W)``.

        Raises:
            ValueError: On a wrong rank, channel count, or images smaller than 4x4.
        """
        if x.dim() != 4 or x.shape[1] != self.in_channels or min(x.shape[-2:]) < self.min_size:
            raise ValueError(
                f"SmallCNN expects (B, {self.in_channels}, H, W) with H, W >= {self.min_size}, "
                f"got {tuple(x.shape)}"
            )
        return self.classifier(self.flatten(self.pool(self.features(x))))


class LeNet5(nn.Module):
    """LeNet-5-like CNN (LeCun et al., 1998) with ReLU and max-pooling.

    ``Conv5x5(pad 2, 6) -> act -> MaxPool2 -> Conv5x5(16) -> act -> MaxPool2 ->
    Flatten -> Linear(120) -> act -> Linear(84) -> act -> Linear(num_classes)``.
    The first linear layer's input size is computed from ``image_size``
    (``16*5*5`` for 28x28 inputs), so the input size is fixed at construction
    and must be at least 12x12.

    Args:
        in_channels: Input image channels.
        num_classes: Output dimension.
        image_size: ``(H, W)`` or ``S``; at least 12 per side.
        activation: Activation name or zero-argument module factory.

    Shape:
        - Input: ``(B, in_channels, H, W)`` with ``(H, W) == image_size``.
        - Output: ``(B, num_classes)``.
    """

    min_size = 12

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int | Sequence[int] = 28,
        activation: str | Callable[[], nn.Module] = "relu",
    ) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.num_classes = check_positive_int(num_classes, "num_classes")
        self.image_size = to_pair(image_size)
        h, w = self.image_size
        if min(h, w) < self.min_size:
            raise ValueError(
                f"LeNet5 needs images of at least {self.min_size}x{self.min_size}, got {h}x{w}"
            )
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2),
            make_activation(activation),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            make_activation(activation),
            nn.MaxPool2d(2),
        )
        fh, fw = (h // 2 - 4) // 2, (w // 2 - 4) // 2
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * fh * fw, 120),
            make_activation(activation),
            nn.Linear(120, 84),
            make_activation(activation),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``(B, num_classes)`` logits.

        Raises:
            ValueError: If ``x`` is not ``(B, in_channels, *image_size)``.
        """
        expected = (self.in_channels, *self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"LeNet5 expects input of shape (B, {expected[0]}, {expected[1]}, {expected[2]}), "
                f"got {tuple(x.shape)}"
            )
        return self.classifier(self.features(x))
