"""LightningDataModules for jvpreg: scikit-learn's bundled digits (the default, no download),
torchvision MNIST / Fashion-MNIST / CIFAR-10 (``download=False`` by default), and synthetic data.

All yield ``(x, y)`` with ``x`` float32 ``(C, H, W)`` in ``[0, 1]``; see :mod:`jvpreg.data.base`.
"""
from .base import ImageDataModule, resize_images
from .digits import DigitsDataModule, load_digits_tensors
from .synthetic import SyntheticDataModule, make_synthetic
from .vision import CIFAR10DataModule, FashionMNISTDataModule, MNISTDataModule, TorchvisionDataModule

__all__ = [
    "CIFAR10DataModule", "DigitsDataModule", "FashionMNISTDataModule", "ImageDataModule", "MNISTDataModule",
    "SyntheticDataModule", "TorchvisionDataModule", "load_digits_tensors", "make_synthetic", "resize_images",
]
