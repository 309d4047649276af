"""scikit-learn's bundled handwritten digits (8x8, 1 channel, 10 classes) as a LightningDataModule.

The 1,797 images ship with scikit-learn (``sklearn.datasets.load_digits``), so this is real data
that needs no download: the default dataset of ``jvpreg-train``. Pixels (0..16) are scaled to
``[0, 1]``. The test set is a fixed stratified ``test_fraction`` of the images (split seed
``test_seed``, independent of the training seed so every run scores the same test images); the
validation set is ``val_fraction`` of the rest.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
from torch.utils.data import Dataset, TensorDataset

from .base import ImageDataModule, resize_images

__all__ = ["DigitsDataModule", "load_digits_tensors"]


def load_digits_tensors() -> Tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as ``x: (N, 1, 8, 8)`` float32 in ``[0, 1]`` and ``y: (N,)`` int64."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return x, y


class DigitsDataModule(ImageDataModule):
    """Handwritten digits bundled with scikit-learn: ``(1, 8, 8)`` images, 10 classes.

    Args:
        test_fraction: Fraction of the 1,797 images held out as the test set (stratified).
        test_seed: Seed of the test split (fixed by default, so every run shares the test images).
        **kwargs: See :class:`~jvpreg.data.base.ImageDataModule` (``batch_size``, ``val_fraction``,
            ``resize``, ``seed``, ...).

    Example::

        >>> dm = DigitsDataModule(batch_size=64)
        >>> trainer.fit(model, datamodule=dm)
    """

    native_channels = 1
    native_classes = 10
    native_size = (8, 8)

    def __init__(self, *args: Any, test_fraction: float = 0.2, test_seed: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(test_fraction, (int, float)) or not 0.0 < float(test_fraction) < 1.0:
            raise ValueError(f"DigitsDataModule(...): expected test_fraction in (0, 1), got {test_fraction!r}.")
        self.test_fraction = float(test_fraction)
        self.test_seed = int(test_seed)

    def load(self) -> Tuple[Dataset, Dataset]:
        x, y = load_digits_tensors()
        g = torch.Generator().manual_seed(self.test_seed)
        test_idx = []
        for c in range(self.native_classes):  # stratified: the same fraction of every class
            idx = (y == c).nonzero().flatten()
            idx = idx[torch.randperm(len(idx), generator=g)]
            test_idx.append(idx[: int(round(self.test_fraction * len(idx)))])
        test_mask = torch.zeros(len(y), dtype=torch.bool)
        test_mask[torch.cat(test_idx)] = True
        return TensorDataset(x[~test_mask], y[~test_mask]), TensorDataset(x[test_mask], y[test_mask])

    def resized(self, dataset: Dataset) -> Dataset:
        x, y = dataset.tensors  # type: ignore[attr-defined]
        return TensorDataset(resize_images(x, self.resize), y)
