"""Tests for jvpreg.models: registry, builders and the hand-written networks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from jvpreg.models import (
    MLP,
    MODELS,
    PAPER_ARCHITECTURES,
    LeNet5,
    RowRNN,
    SmallCNN,
    UNet,
    build_model,
    list_models,
)

NUM_CLASSES = 7
BATCH = 2

# (in_channels, H, W) per registry name; anything not listed uses 3x32x32.
INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "inception_v3": (3, 75, 75),
    "mlp": (1, 8, 8),
    "small_cnn": (1, 8, 8),
    "lenet5": (1, 28, 28),
    "dit": (1, 8, 8),
    "time_unet": (1, 8, 8),
}

#: Generative models ``u(z, r, t, y)``: an image of the input's shape out.
TIME_CONDITIONED = ("dit", "time_unet")


def _input_shape(name: str) -> tuple[int, int, int]:
    return INPUT_SHAPES.get(name, (3, 32, 32))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --------------------------------------------------------------------------- registry


def test_paper_architectures_order() -> None:
    assert PAPER_ARCHITECTURES == (
        "rnn", "unet", "vgg16", "vgg19", "inception_v3", "resnet50", "resnet101", "resnet152",
        "efficientnet_b0", "efficientnet_b1", "densenet121", "densenet169", "densenet201",
    )  # fmt: skip


def test_registry_contents() -> None:
    names = list_models()
    assert names == sorted(MODELS)
    assert all(name == name.lower() for name in names)
    required = set(PAPER_ARCHITECTURES) | {"mlp", "small_cnn", "resnet18", "vgg11_bn", "vgg11"}
    assert required <= set(names)


HEAVY_MODELS = {"densenet169", "resnet101", "resnet152", "vgg11", "vgg11_bn", "vgg16", "vgg19"}  # 1-5 s each: sweep


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.sweep) if n in HEAVY_MODELS else n
                                  for n in list_models()])
def test_every_model_builds_and_runs(name: str) -> None:
    c, h, w = _input_shape(name)
    model = build_model(name, in_channels=c, num_classes=NUM_CLASSES, image_size=(h, w)).eval()
    x = torch.randn(BATCH, c, h, w)
    with torch.no_grad():
        if name in TIME_CONDITIONED:
            out = model(x, torch.zeros(BATCH), torch.ones(BATCH), torch.arange(BATCH))
        else:
            out = model(x)
    assert out.shape == (x.shape if name in TIME_CONDITIONED else (BATCH, NUM_CLASSES))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0", "densenet121", "inception_v3"])
def test_torchvision_first_conv_rechanneled(name: str) -> None:
    _, h, w = _input_shape(name)
    model = build_model(name, in_channels=1, num_classes=NUM_CLASSES, image_size=(h, w)).eval()
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1
    assert sum(isinstance(m, nn.Conv2d) and m.in_channels == 3 for m in model.modules()) == 0
    with torch.no_grad():
        assert model(torch.randn(BATCH, 1, h, w)).shape == (BATCH, NUM_CLASSES)


def test_first_conv_kept_for_three_channels() -> None:
    model = build_model("resnet18", in_channels=3, num_classes=4, image_size=32)
    assert model.conv1.weight.shape == (64, 3, 7, 7)
    assert model.fc.out_features == 4


def test_unknown_name_suggests_closest() -> None:
    expected = r"Unknown model 'resnt50'\. Did you mean 'resnet50'\? Known models: .*resnet18"
    with pytest.raises(ValueError, match=expected):
        build_model("resnt50", in_channels=3, num_classes=10, image_size=32)


def test_unknown_name_without_close_match_lists_known() -> None:
    with pytest.raises(ValueError, match=r"Unknown model 'zzzz'\. Known models: densenet121, "):
        build_model("zzzz", in_channels=3, num_classes=10, image_size=32)


def test_name_is_case_insensitive() -> None:
    model = build_model("Small-CNN", in_channels=1, num_classes=3, image_size=8)
    assert isinstance(model, SmallCNN)


def test_non_string_name_is_type_error() -> None:
    with pytest.raises(TypeError, match="model name must be a str"):
        build_model(3, in_channels=3, num_classes=10, image_size=32)  # type: ignore[arg-type]


def test_image_too_small_for_inception() -> None:
    with pytest.raises(ValueError, match=r"inception_v3 needs images of at least 75x75, got 32x32"):
        build_model("inception_v3", in_channels=3, num_classes=10, image_size=32)


def test_num_classes_none_only_for_unet() -> None:
    with pytest.raises(ValueError, match="num_classes=None is only supported by 'unet'"):
        build_model("resnet18", in_channels=3, num_classes=None, image_size=32)
    model = build_model("unet", in_channels=3, num_classes=None, image_size=16, depth=2, base_width=4)
    with torch.no_grad():
        assert model.eval()(torch.randn(BATCH, 3, 16, 16)).shape == (BATCH, 3, 16, 16)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"in_channels": 0}, ValueError, "in_channels must be a positive int, got 0"),
        ({"num_classes": 2.5}, TypeError, "num_classes must be a positive int, got float 2.5"),
        ({"image_size": "32"}, TypeError, r"image_size must be an int or a \(H, W\) pair"),
        ({"image_size": (32, -1)}, ValueError, r"image_size\[1\] must be a positive int, got -1"),
    ],
)
def test_build_model_argument_errors(kwargs: dict, exc: type, match: str) -> None:
    args = {"in_channels": 3, "num_classes": 10, "image_size": 32, **kwargs}
    with pytest.raises(exc, match=match):
        build_model("resnet18", **args)


def test_pretrained_weights_rejected() -> None:
    with pytest.raises(ValueError, match="pretrained weights are not supported"):
        build_model("resnet18", in_channels=3, num_classes=10, image_size=32, weights="DEFAULT")


@pytest.mark.slow
def test_models_import_without_hydra_or_wandb() -> None:
    code = (
        "import sys, jvpreg.models\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'wandb', 'omegaconf'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- RowRNN


@pytest.mark.parametrize(
    ("in_channels", "image_size", "hidden_size", "num_layers"),
    [(1, 8, 16, 1), (3, (32, 16), 8, 2)],
)
def test_row_rnn_shapes(in_channels: int, image_size, hidden_size: int, num_layers: int) -> None:
    model = RowRNN(in_channels, image_size, NUM_CLASSES, hidden_size=hidden_size, num_layers=num_layers)
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    assert model.rnn.input_size == in_channels * w
    assert model.rnn.num_layers == num_layers
    out = model(torch.randn(BATCH, in_channels, h, w))
    assert out.shape == (BATCH, NUM_CLASSES)


def test_row_rnn_matches_manual_recurrence() -> None:
    model = RowRNN(2, (5, 3), 4, hidden_size=6)
    x = torch.randn(BATCH, 2, 5, 3)
    rnn = model.rnn
    h = torch.zeros(BATCH, 6)
    for t in range(5):
        x_t = x[:, :, t, :].reshape(BATCH, -1)  # row t, channel-major (C*W)
        h = torch.relu(x_t @ rnn.weight_ih_l0.T + rnn.bias_ih_l0 + h @ rnn.weight_hh_l0.T + rnn.bias_hh_l0)
    torch.testing.assert_close(model(x), model.head(h))


def test_row_rnn_rejects_wrong_shape() -> None:
    model = RowRNN(1, 8, 10)
    with pytest.raises(ValueError, match=r"RowRNN expects input of shape \(B, 1, 8, 8\), got \(2, 1, 8, 9\)"):
        model(torch.randn(2, 1, 8, 9))


# --------------------------------------------------------------------------- UNet


@pytest.mark.parametrize(
    ("depth", "upsample", "size", "out_channels"),
    [(2, "transpose", (16, 24), None), (3, "bilinear", (16, 16), 5), (4, "transpose", (32, 48), 1)],
)
def test_unet_image_output_keeps_spatial_size(depth: int, upsample: str, size, out_channels) -> None:
    model = UNet(3, out_channels=out_channels, depth=depth, base_width=4, upsample=upsample).eval()
    with torch.no_grad():
        out = model(torch.randn(BATCH, 3, *size))
    assert out.shape == (BATCH, 3 if out_channels is None else out_channels, *size)


@pytest.mark.parametrize(("depth", "upsample"), [(2, "transpose"), (4, "bilinear")])
def test_unet_classification_head(depth: int, upsample: str) -> None:
    model = UNet(1, depth=depth, base_width=4, num_classes=20, upsample=upsample).eval()
    assert model.outc is None
    with torch.no_grad():
        assert model(torch.randn(BATCH, 1, 32, 32)).shape == (BATCH, 20)


def test_unet_default_config() -> None:
    model = UNet()
    assert model.depth == 4 and model.base_width == 32 and len(model.downs) == 4
    assert model.downs[-1][1][0].out_channels == 32 * 2**4


def test_unet_rejects_indivisible_size() -> None:
    model = UNet(3, depth=3, base_width=4)
    with pytest.raises(ValueError, match=r"needs H and W divisible by 8, got 12x16"):
        model(torch.randn(1, 3, 12, 16))
    with pytest.raises(ValueError, match="upsample must be one of"):
        UNet(3, upsample="nearest")


# --------------------------------------------------------------------------- small nets


@pytest.mark.parametrize(
    ("activation", "dropout", "batchnorm"), [("relu", 0.0, False), ("tanh", 0.2, True), (nn.GELU, 0.0, False)]
)
def test_mlp(activation, dropout: float, batchnorm: bool) -> None:
    model = MLP(64, hidden=(32, 16), num_classes=NUM_CLASSES, activation=activation, dropout=dropout,
                batchnorm=batchnorm).eval()  # fmt: skip
    assert sum(isinstance(m, nn.BatchNorm1d) for m in model.modules()) == (2 if batchnorm else 0)
    assert sum(isinstance(m, nn.Dropout) for m in model.modules()) == (2 if dropout else 0)
    assert model(torch.randn(BATCH, 1, 8, 8)).shape == (BATCH, NUM_CLASSES)


def test_mlp_errors() -> None:
    with pytest.raises(ValueError, match="Unknown activation 'swish'"):
        MLP(4, activation="swish")
    with pytest.raises(ValueError, match=r"MLP expects .* 64 features per sample, got shape \(2, 3, 8, 8\)"):
        MLP(64)(torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize(("in_channels", "size"), [(1, 8), (1, 28), (3, 32)])
def test_small_cnn_sizes(in_channels: int, size: int) -> None:
    model = SmallCNN(in_channels, NUM_CLASSES, width=8, image_size=size).eval()
    with torch.no_grad():
        assert model(torch.randn(BATCH, in_channels, size, size)).shape == (BATCH, NUM_CLASSES)


def test_small_cnn_too_small() -> None:
    with pytest.raises(ValueError, match="SmallCNN needs images of at least 4x4, got 2x2"):
        SmallCNN(1, 10, image_size=2)


@pytest.mark.parametrize("size", [28, 32])
def test_lenet5(size: int) -> None:
    model = LeNet5(1, NUM_CLASSES, image_size=size)
    assert model(torch.randn(BATCH, 1, size, size)).shape == (BATCH, NUM_CLASSES)
    with pytest.raises(ValueError, match="LeNet5 needs images of at least 12x12, got 8x8"):
        LeNet5(1, 10, image_size=8)
