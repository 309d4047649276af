"""Random images with a learnable rule, for smoke tests of any architecture at any size.

``x ~ N(0.5, 0.25²)`` clamped to ``[0, 1]``, shape ``(C, H, W)``; the label is the argmax over
``num_classes`` fixed random 3x3 "teacher" filters of the spatial mean of their (zero-padded)
responses to ``x - 0.5``, each score standardized over a reference sample so that the classes are
roughly balanced. That rule is translation-invariant, so convolutional networks with global
pooling learn it, and linear in ``x``, so MLPs and RNNs learn it too. Everything is generated from
``data_seed`` (the teacher) and the split index, so the data are identical across runs and ranks.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from .base import ImageDataModule, to_size

__all__ = ["SyntheticDataModule", "make_synthetic"]


def make_synthetic(n: int, in_channels: int, image_size: Tuple[int, int], num_classes: int, *, data_seed: int = 0,
                   split: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples ``(x, y)`` of the synthetic rule (see the module docstring)."""
    g = torch.Generator().manual_seed(data_seed)
    filters = torch.randn(num_classes, in_channels, 3, 3, generator=g)
    filters = filters / filters.flatten(1).norm(dim=1)[:, None, None, None]
    def draw(count: int, gen: torch.Generator) -> torch.Tensor:
        return (0.5 + 0.25 * torch.randn(count, in_channels, *image_size, generator=gen)).clamp(0.0, 1.0)

    def score(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x - 0.5, filters, padding=1).mean(dim=(2, 3))

    with torch.no_grad():
        ref = score(draw(1024, g))  # standardize each class score so the classes are balanced
        mu, sd = ref.mean(0), ref.std(0).clamp_min(1e-12)
        x = draw(n, torch.Generator().manual_seed(data_seed * 1000 + 17 + split))
        y = ((score(x) - mu) / sd).argmax(dim=1)
    return x, y


class SyntheticDataModule(ImageDataModule):
    """Synthetic images of any shape with a learnable label rule (smoke tests, benchmarks).

    Args:
        in_channels: Image channels.
        num_classes: Number of classes.
        size: Native image side ``S`` or ``(H, W)`` (``resize`` changes what the model sees).
        image_size: Expected model input size, checked (see :class:`~jvpreg.data.base.ImageDataModule`).
        n_train: Training samples (the validation set is taken from them).
        n_test: Test samples.
        data_seed: Seed of the teacher filters and of the samples.
        **kwargs: See :class:`~jvpreg.data.base.ImageDataModule`.

    Example::

        >>> dm = SyntheticDataModule(in_channels=3, size=32, num_classes=10, n_train=256)
    """

    def __init__(self, *args: Any, in_channels: int = 1, num_classes: int = 10, size: Any = 8,
                 image_size: Any = None, n_train: int = 512, n_test: int = 256, data_seed: int = 0, **kwargs: Any):
        where = "SyntheticDataModule(...)"
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("n_train", n_train),
                            ("n_test", n_test)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: expected {name} to be an int >= 1, got {value!r}.")
        if num_classes < 2:
            raise ValueError(f"{where}: expected num_classes >= 2, got {num_classes}.")
        self.native_channels = in_channels
        self.native_classes = num_classes
        self.native_size = to_size(where, "size", size)  # type: ignore[assignment]
        self.n_train, self.n_test, self.data_seed = n_train, n_test, int(data_seed)
        super().__init__(*args, image_size=image_size, **kwargs)

    @property
    def image_size(self) -> Tuple[int, int]:
        return self.resize or self.native_size  # type: ignore[return-value]

    def load(self) -> Tuple[Dataset, Dataset]:
        size = self.image_size  # generated directly at the final size
        args = (self.in_channels, size, self.num_classes)
        x, y = make_synthetic(self.n_train, *args, data_seed=self.data_seed, split=0)
        xt, yt = make_synthetic(self.n_test, *args, data_seed=self.data_seed, split=1)
        return TensorDataset(x, y), TensorDataset(xt, yt)

    def resized(self, dataset: Dataset) -> Dataset:
        return dataset  # already generated at the final size
