"""torchvision datasets (MNIST, Fashion-MNIST, CIFAR-10) as LightningDataModules.

Nothing is downloaded unless ``download=True``: offline, missing files raise a
``FileNotFoundError`` that names the folder and the files expected there and says how to get them
(copy them there, point ``data_dir`` at an existing copy, or set ``download=True`` when online).
Images are converted to float32 in ``[0, 1]`` (no normalization, see :mod:`jvpreg.data.base`).
The test set is the official test split; validation is ``val_fraction`` of the training split.
"""
from __future__ import annotations

import os
from typing import Any, Tuple

from torch.utils.data import Dataset

from .base import ImageDataModule

__all__ = ["CIFAR10DataModule", "FashionMNISTDataModule", "MNISTDataModule", "TorchvisionDataModule"]


class TorchvisionDataModule(ImageDataModule):
    """Base for torchvision classification datasets stored under ``data_dir``.

    Args:
        download: Download the files into ``data_dir`` if missing (needs internet).
        **kwargs: See :class:`~jvpreg.data.base.ImageDataModule`.

    Raises:
        FileNotFoundError: At construction (and in :meth:`prepare_data`/:meth:`setup`) when the files
            are missing and ``download`` is false; the message says where to put them.
    """

    dataset_name = ""  #: torchvision.datasets class name
    expected_files: Tuple[str, ...] = ()  #: files (relative to data_dir) shown in the error message

    def __init__(self, *args: Any, download: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(download, bool):
            raise TypeError(f"{type(self).__name__}(...): expected download to be a bool, got {download!r}.")
        self.download = download
        if not download and not self._exists():  # fail at config time, before any training starts
            raise self._missing_error()

    def _dataset_cls(self):
        import torchvision.datasets

        return getattr(torchvision.datasets, self.dataset_name)

    def _exists(self) -> bool:
        ds = self._dataset_cls().__new__(self._dataset_cls())
        ds.root = os.path.expanduser(self.data_dir)
        if hasattr(ds, "_check_exists"):
            return bool(ds._check_exists())
        return bool(ds._check_integrity())

    def _missing_error(self) -> FileNotFoundError:
        root = os.path.abspath(os.path.expanduser(self.data_dir))
        files = ", ".join(self.expected_files)
        return FileNotFoundError(
            f"{type(self).__name__}: {self.dataset_name} not found under data_dir={root!r} and download=False "
            f"(expected {files} in that folder). Fix: copy the files there (or set data.data_dir=/path/to/a/copy, "
            f"or the JVPREG_DATA_DIR environment variable), or set data.download=true when online.")

    def prepare_data(self) -> None:
        """Download the files if ``download`` is set; otherwise check they are present."""
        if self._exists():
            return
        if not self.download:
            raise self._missing_error()
        os.makedirs(self.data_dir, exist_ok=True)
        cls = self._dataset_cls()
        cls(self.data_dir, train=True, download=True)
        cls(self.data_dir, train=False, download=True)

    def load(self) -> Tuple[Dataset, Dataset]:
        import torchvision.transforms as T

        if not self._exists():
            raise self._missing_error()
        cls = self._dataset_cls()
        tf = T.ToTensor()
        return (cls(self.data_dir, train=True, download=False, transform=tf),
                cls(self.data_dir, train=False, download=False, transform=tf))


def _mnist_files(folder: str) -> Tuple[str, ...]:
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    return tuple(os.path.join(folder, "raw", n) for n in names)


class MNISTDataModule(TorchvisionDataModule):
    """MNIST handwritten digits: ``(1, 28, 28)``, 10 classes, 60k train / 10k test.

    Example::

        >>> dm = MNISTDataModule("data", batch_size=128, download=True)   # or files already in data/MNIST/raw
    """

    dataset_name = "MNIST"
    expected_files = _mnist_files("MNIST")
    native_channels, native_classes, native_size = 1, 10, (28, 28)


class FashionMNISTDataModule(TorchvisionDataModule):
    """Fashion-MNIST: ``(1, 28, 28)``, 10 classes, 60k train / 10k test."""

    dataset_name = "FashionMNIST"
    expected_files = _mnist_files("FashionMNIST")
    native_channels, native_classes, native_size = 1, 10, (28, 28)


class CIFAR10DataModule(TorchvisionDataModule):
    """CIFAR-10: ``(3, 32, 32)``, 10 classes, 50k train / 10k test (python version of the archive)."""

    dataset_name = "CIFAR10"
    expected_files = tuple(os.path.join("cifar-10-batches-py", f)
                           for f in ("data_batch_1", "...", "data_batch_5", "test_batch", "batches.meta"))
    native_channels, native_classes, native_size = 3, 10, (32, 32)
