"""Row-by-row recurrent classifier (the paper's "RNN" benchmark architecture)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from jvpreg.models._utils import check_positive_int, to_pair

__all__ = ["RowRNN"]


class RowRNN(nn.Module):
    """Elman RNN that reads an image one row at a time, then classifies.

    The image ``(B, C, H, W)`` is viewed as a sequence of ``H`` steps, each step
    being one image row with all its channels, ``x_t in R^{C*W}``. The recurrence
    is ``h_t = relu(W_ih x_t + W_hh h_{t-1} + b)`` (stacked ``num_layers`` times,
    ``h_0 = 0``) and the logits are ``W_out h_H + b_out`` (last hidden state of the
    top layer).

    Implemented with ``nn.RNN(nonlinearity="relu", batch_first=True)``.

    Args:
        in_channels: Number of image channels ``C``.
        image_size: ``(H, W)`` or ``S`` for ``S x S``. ``H`` is the number of
            recurrent steps and ``C * W`` the per-step input size.
        num_classes: Output dimension of the linear head.
        hidden_size: Hidden state size of every RNN layer.
        num_layers: Number of stacked RNN layers.
        nonlinearity: ``"relu"`` (the paper's setting) or ``"tanh"``.

    Shape:
        - Input: ``(B, C, H, W)``.
        - Output: ``(B, num_classes)``.
    """

    def __init__(
        self,
        in_channels: int,
        image_size: int | Sequence[int],
        num_classes: int,
        hidden_size: int = 128,
        num_layers: int = 1,
        nonlinearity: str = "relu",
    ) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.image_size = to_pair(image_size)
        self.num_classes = check_positive_int(num_classes, "num_classes")
        self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        self.num_layers = check_positive_int(num_layers, "num_layers")
        if nonlinearity not in ("relu", "tanh"):
            raise ValueError(f"nonlinearity must be 'relu' or 'tanh', got {nonlinearity!r}")
        height, width = self.image_size
        self.rnn = nn.RNN(
            input_size=in_channels * width,
            hidden_size=hidden_size,
            num_layers=num_layers,
            nonlinearity=nonlinearity,
            batch_first=True,
        )
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Classify a batch of images.

        Args:
            x: Images of shape ``(B, C, H, W)`` matching ``in_channels``/``image_size``.

        Returns:
            Logits of shape ``(B, num_classes)``.

        Raises:
            ValueError: If ``x`` does not have shape ``(B, C, H, W)`` with the
                configured ``C``, ``H`` and ``W``.
        """
        expected = (self.in_channels, *self.image_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"RowRNN expects input of shape (B, {expected[0]}, {expected[1]}, {expected[2]}), "
                f"got {tuple(x.shape)}"
            )
        batch, channels, height, width = x.shape
        # (B, C, H, W) -> (B, H, C, W) -> (B, H, C*W): one step per image row.
        seq = x.permute(0, 2, 1, 3).reshape(batch, height, channels * width)
        out, _ = self.rnn(seq)  # (B, H, hidden): top-layer hidden state at every step
        return self.head(out[:, -1])

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, image_size={self.image_size}"
