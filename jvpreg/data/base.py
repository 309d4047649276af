"""Shared base of the image-classification LightningDataModules.

Conventions (implementation choices, used by every datamodule here):

* Samples are ``(x, y)`` with ``x`` a float32 tensor ``(C, H, W)`` with pixel values in ``[0, 1]``
  (no mean/std normalization, so noise levels and attack radii are in pixel units and adversarial
  examples are clamped to ``[0, 1]``) and ``y`` an int64 class index.
* ``resize`` (``None``, ``S`` or ``(H, W)``) bilinearly resizes every image; use it for models
  whose minimum input is larger than the data (e.g. ``resize=32`` for VGG on 8x8 digits).
* The shape metadata ``in_channels``, ``num_classes`` and ``image_size`` are constructor arguments
  so that a Hydra config can both declare them (the model configs interpolate
  ``${data.image_size}`` etc.) and have them checked against the dataset: a mismatch is a
  ``ValueError`` at construction time, never a silent shape error later.
* Splits are deterministic given ``seed``: the validation set is ``val_fraction`` of the training
  split, drawn with a ``torch.Generator`` seeded by ``seed``.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from pytorch_lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Subset

__all__ = ["ImageDataModule", "ResizedDataset", "to_size", "resize_images"]

Size = Union[int, Sequence[int]]


def to_size(where: str, name: str, value: Optional[Size]) -> Optional[Tuple[int, int]]:
    """``None``, ``S`` or ``(H, W)`` as ``None`` or an ``(H, W)`` pair of positive ints."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{where}: expected {name} to be None, an int or an (H, W) pair, got {value!r}.")
    if isinstance(value, int):
        value = (value, value)
    try:
        pair = tuple(int(v) for v in value)
    except TypeError:
        raise TypeError(f"{where}: expected {name} to be None, an int or an (H, W) pair, got {value!r}.") from None
    if len(pair) != 2 or min(pair) < 1 or any(int(v) != v for v in value):
        raise ValueError(f"{where}: expected {name} to be a positive int or an (H, W) pair of positive ints, "
                         f"got {value!r}.")
    return pair  # type: ignore[return-value]


def resize_images(x: torch.Tensor, size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Bilinear resize of ``(..., C, H, W)`` images to ``size`` (no-op for ``None`` or the same size)."""
    if size is None or tuple(x.shape[-2:]) == tuple(size):
        return x
    lead = x.shape[:-3]
    flat = x.reshape(-1, *x.shape[-3:])
    out = F.interpolate(flat, size=size, mode="bilinear", align_corners=False, antialias=min(size) < min(x.shape[-2:]))
    return out.clamp(0.0, 1.0).reshape(*lead, *out.shape[-3:])


class ResizedDataset(Dataset):
    """Wraps a dataset of ``(image, label)`` and resizes each image on access."""

    def __init__(self, dataset: Dataset, size: Optional[Tuple[int, int]]):
        self.dataset = dataset
        self.size = size

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        x, y = self.dataset[index]
        return resize_images(x, self.size), y


class ImageDataModule(LightningDataModule):
    """Base datamodule: splits, loaders, optional resize, and checked shape metadata.

    Subclasses set the class attributes ``native_channels``, ``native_classes``, ``native_size``
    (or override the matching properties) and implement :meth:`load` returning ``(train, test)``
    datasets of ``(x, y)`` pairs at the native size.

    Args:
        data_dir: Root folder for files (torchvision datasets); unused by in-memory datasets.
        batch_size: Training batch size (evaluation loaders use ``eval_batch_size``).
        eval_batch_size: Validation/test batch size; ``None``: ``batch_size``.
        num_workers: DataLoader worker processes.
        val_fraction: Fraction of the training split held out for validation (``0 <= f < 1``).
        resize: ``None``, ``S`` or ``(H, W)``: bilinear resize of every image.
        seed: Seed of the train/validation split.
        pin_memory: DataLoader ``pin_memory``.
        in_channels, num_classes, image_size: Expected shape metadata (``None``: not checked); see
            the module docstring.

    Raises:
        TypeError, ValueError: On invalid arguments or metadata that does not match the dataset.
    """

    native_channels: int = 1
    native_classes: int = 10
    native_size: Tuple[int, int] = (8, 8)

    def __init__(self, data_dir: str = "data", batch_size: int = 64, *, eval_batch_size: Optional[int] = None,
                 num_workers: int = 0, val_fraction: float = 0.1, resize: Optional[Size] = None, seed: int = 0,
                 pin_memory: bool = False, in_channels: Optional[int] = None, num_classes: Optional[int] = None,
                 image_size: Optional[Size] = None):
        super().__init__()
        where = f"{type(self).__name__}(...)"
        for name, value in (("batch_size", batch_size), ("num_workers", num_workers), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where}: expected {name} to be an int, got {type(value).__name__} {value!r}.")
        if batch_size < 1:
            raise ValueError(f"{where}: expected batch_size >= 1, got {batch_size}.")
        if num_workers < 0:
            raise ValueError(f"{where}: expected num_workers >= 0, got {num_workers}.")
        if eval_batch_size is not None and (not isinstance(eval_batch_size, int) or eval_batch_size < 1):
            raise ValueError(f"{where}: expected eval_batch_size to be None or an int >= 1, got {eval_batch_size!r}.")
        if not isinstance(val_fraction, (int, float)) or not 0.0 <= float(val_fraction) < 1.0:
            raise ValueError(f"{where}: expected val_fraction in [0, 1), got {val_fraction!r}.")
        self.data_dir = str(data_dir)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.val_fraction = float(val_fraction)
        self.resize = to_size(where, "resize", resize)
        self.seed = seed
        self.pin_memory = bool(pin_memory)
        self._check_metadata(where, in_channels, num_classes, image_size)
        self.data_train: Optional[Dataset] = None
        self.data_val: Optional[Dataset] = None
        self.data_test: Optional[Dataset] = None

    # -- metadata ---------------------------------------------------------------------------
    @property
    def in_channels(self) -> int:
        """Channels of one image."""
        return self.native_channels

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return self.native_classes

    @property
    def image_size(self) -> Tuple[int, int]:
        """``(H, W)`` of the images the model sees (after ``resize``)."""
        return self.resize or tuple(self.native_size)  # type: ignore[return-value]

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        """``(C, H, W)`` of one model input."""
        return (self.in_channels, *self.image_size)  # type: ignore[return-value]

    def _check_metadata(self, where: str, in_channels: Any, num_classes: Any, image_size: Any) -> None:
        size = to_size(where, "image_size", image_size)
        checks = (("in_channels", in_channels, self.in_channels), ("num_classes", num_classes, self.num_classes),
                  ("image_size", size, self.image_size))
        for name, given, actual in checks:
            if given is not None and tuple(_as_tuple(given)) != tuple(_as_tuple(actual)):
                hint = (" To change the input size, set resize (e.g. data.resize=32) instead of image_size."
                        if name == "image_size" else "")
                raise ValueError(f"{where}: {name}={given!r} does not match the dataset ({name}={actual!r}).{hint}")

    # -- datasets ---------------------------------------------------------------------------
    def load(self) -> Tuple[Dataset, Dataset]:
        """Return ``(train, test)`` datasets of ``(x, y)`` at the native size. Subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__}.load() is only implemented by subclasses")

    def setup(self, stage: Optional[str] = None) -> None:
        """Load the data once and split train/validation (deterministic in ``seed``)."""
        if self.data_train is not None:
            return
        train, test = self.load()
        if self.resize is not None:
            train, test = self.resized(train), self.resized(test)
        n = len(train)  # type: ignore[arg-type]
        n_val = int(math.floor(self.val_fraction * n)) if self.val_fraction > 0 else 0
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
        self.data_val = Subset(train, perm[:n_val]) if n_val else None
        self.data_train = Subset(train, perm[n_val:])
        self.data_test = test

    def resized(self, dataset: Dataset) -> Dataset:
        """``dataset`` with images resized to :attr:`resize` (in-memory datasets override this)."""
        return ResizedDataset(dataset, self.resize)

    # -- loaders ----------------------------------------------------------------------------
    def _loader(self, dataset: Optional[Dataset], *, shuffle: bool, batch_size: int) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: this split is empty (val_fraction=0?)")
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
                          generator=torch.Generator().manual_seed(self.seed) if shuffle else None)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.data_train, shuffle=True, batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        self.setup()
        if self.data_val is None:
            return []
        return self._loader(self.data_val, shuffle=False, batch_size=self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.data_test, shuffle=False, batch_size=self.eval_batch_size)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_shape={self.input_shape}, num_classes={self.num_classes}, "
                f"batch_size={self.batch_size})")


def _as_tuple(v: Any) -> Tuple:
    if isinstance(v, (tuple, list)):
        return tuple(v)
    return (v,)
