"""Tests for jvpreg.data: digits, synthetic, torchvision (offline errors), resize, metadata checks."""
from __future__ import annotations

import pytest
import torch

from jvpreg.data import (CIFAR10DataModule, DigitsDataModule, FashionMNISTDataModule, MNISTDataModule,
                         SyntheticDataModule, load_digits_tensors, resize_images)
from jvpreg.data.directions import brightness, contrast


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is faster (and steadier on a shared CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _first(loader):
    return next(iter(loader))


def test_digits_tensors_are_real_sklearn_digits():
    x, y = load_digits_tensors()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert sorted(y.unique().tolist()) == list(range(10))


def test_digits_splits_are_disjoint_complete_and_deterministic():
    dm = DigitsDataModule(batch_size=32, val_fraction=0.1, seed=3)
    dm.setup()
    n_train, n_val, n_test = len(dm.data_train), len(dm.data_val), len(dm.data_test)
    assert n_train + n_val + n_test == 1797
    assert 350 <= n_test <= 370  # stratified 20%
    x, y = _first(dm.train_dataloader())
    assert x.shape == (32, 1, 8, 8) and y.shape == (32,)
    # the test split does not depend on the training seed
    other = DigitsDataModule(seed=4)
    other.setup()
    assert torch.equal(dm.data_test.tensors[0], other.data_test.tensors[0])
    assert dm.data_val.indices != other.data_val.indices
    again = DigitsDataModule(seed=3)
    again.setup()
    assert dm.data_val.indices == again.data_val.indices


def test_digits_resize_and_metadata():
    dm = DigitsDataModule(resize=32, image_size=32, in_channels=1, num_classes=10, eval_batch_size=16)
    assert dm.image_size == (32, 32) and dm.input_shape == (1, 32, 32)
    x, _ = _first(dm.test_dataloader())
    assert x.shape == (16, 1, 32, 32)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


@pytest.mark.parametrize("kwargs, match", [
    ({"image_size": 16}, r"image_size=\(16, 16\) does not match the dataset .*data.resize"),
    ({"in_channels": 3}, r"in_channels=3 does not match the dataset \(in_channels=1\)"),
    ({"num_classes": 5}, r"num_classes=5 does not match"),
    ({"batch_size": 0}, r"expected batch_size >= 1, got 0"),
    ({"val_fraction": 1.0}, r"expected val_fraction in \[0, 1\), got 1.0"),
    ({"resize": -2}, r"expected resize to be a positive int"),
    ({"test_fraction": 0.0}, r"expected test_fraction in \(0, 1\)"),
])
def test_digits_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)


def test_digits_type_errors():
    with pytest.raises(TypeError, match=r"expected batch_size to be an int, got float 3.5"):
        DigitsDataModule(batch_size=3.5)


@pytest.mark.slow
def test_synthetic_shapes_determinism_and_balance():
    dm = SyntheticDataModule(in_channels=3, size=32, num_classes=10, n_train=200, n_test=300, batch_size=8)
    dm.setup()
    x, y = _first(dm.train_dataloader())
    assert x.shape == (8, 3, 32, 32)
    yt = dm.data_test.tensors[1]
    counts = torch.bincount(yt, minlength=10)
    assert (counts > 0).sum() >= 9  # every (or nearly every) class present
    dm2 = SyntheticDataModule(in_channels=3, size=32, num_classes=10, n_train=200, n_test=300)
    dm2.setup()
    assert torch.equal(dm.data_test.tensors[0], dm2.data_test.tensors[0])


def test_synthetic_rule_is_learnable_by_a_linear_model():
    dm = SyntheticDataModule(in_channels=1, size=8, num_classes=4, n_train=1024, n_test=256, val_fraction=0.0)
    dm.setup()
    x, y = dm.data_train.dataset.tensors

    def features(z):
        return torch.cat([z.flatten(1) - 0.5, torch.ones(len(z), 1)], dim=1)

    w = torch.linalg.lstsq(features(x), torch.nn.functional.one_hot(y, 4).float()).solution  # least squares
    xt, yt = dm.data_test.tensors
    acc = (features(xt) @ w).argmax(1).eq(yt).float().mean()
    assert acc > 0.8


def test_synthetic_resize_generates_at_final_size():
    dm = SyntheticDataModule(size=8, resize=16, image_size=16, n_train=16, n_test=8)
    x, _ = _first(dm.test_dataloader())
    assert x.shape[-2:] == (16, 16)


@pytest.mark.parametrize("cls, folder", [(MNISTDataModule, "MNIST/raw"), (FashionMNISTDataModule, "FashionMNIST/raw"),
                                         (CIFAR10DataModule, "cifar-10-batches-py")])
def test_torchvision_offline_error_says_what_to_do(tmp_path, cls, folder):
    with pytest.raises(FileNotFoundError, match=r"not found under data_dir=.*download=False") as info:
        cls(str(tmp_path))  # fails at construction (config time), before any training
    msg = str(info.value)
    assert folder in msg and "data.download=true" in msg and "copy the files there" in msg
    dm = cls(str(tmp_path), download=True)  # would download in prepare_data; nothing is fetched here
    assert dm.download and dm.input_shape[0] in (1, 3)


def test_torchvision_metadata():
    assert MNISTDataModule("x", download=True).input_shape == (1, 28, 28)
    assert CIFAR10DataModule("x", download=True, resize=64).input_shape == (3, 64, 64)
    with pytest.raises(TypeError, match="expected download to be a bool"):
        MNISTDataModule("x", download="yes")


def test_resize_images_noop_and_shape():
    x = torch.rand(2, 3, 8, 8)
    assert resize_images(x, None) is x and resize_images(x, (8, 8)) is x
    assert resize_images(x, (5, 7)).shape == (2, 3, 5, 7)


def test_directions():
    x = torch.rand(2, 1, 4, 4)
    assert contrast(x, None) is x
    assert torch.equal(brightness(x), torch.ones_like(x))
