"""Name -> builder registry for every architecture used by jvpreg.

All builders share the keyword-only signature
``builder(*, in_channels, num_classes, image_size, **kwargs) -> nn.Module``
(``image_size`` already normalized to ``(H, W)``), and only depend on
torch/torchvision. torchvision models are always built with ``weights=None``
(nothing is ever downloaded).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

import torchvision
from torch import nn

from jvpreg.models._utils import check_positive_int, to_pair
from jvpreg.models.dit import DiT
from jvpreg.models.rnn import RowRNN
from jvpreg.models.small import MLP, LeNet5, SmallCNN
from jvpreg.models.time_unet import TimeUNet
from jvpreg.models.unet import UNet

__all__ = [
    "MODELS",
    "MIN_IMAGE_SIZE",
    "PAPER_ARCHITECTURES",
    "SMALL_ARCHITECTURES",
    "TORCHVISION_TEST_ARCHITECTURES",
    "ModelBuilder",
    "build_model",
    "list_models",
    "register_model",
    "replace_first_conv",
]

ModelBuilder = Callable[..., nn.Module]

#: The 13 architectures benchmarked in Balestriero & Baraniuk (2021), in the paper's order.
PAPER_ARCHITECTURES: tuple[str, ...] = (
    "rnn",
    "unet",
    "vgg16",
    "vgg19",
    "inception_v3",
    "resnet50",
    "resnet101",
    "resnet152",
    "efficientnet_b0",
    "efficientnet_b1",
    "densenet121",
    "densenet169",
    "densenet201",
)

#: Small hand-written networks for tests and the default experiment.
SMALL_ARCHITECTURES: tuple[str, ...] = ("mlp", "small_cnn", "lenet5")

#: Cheaper torchvision networks used in tests.
TORCHVISION_TEST_ARCHITECTURES: tuple[str, ...] = ("resnet18", "vgg11_bn", "vgg11")

#: Smallest input side (pixels) each architecture accepts; unlisted ones accept any size >= 1
#: (or are checked by their own constructor). Derived from the torchvision strides/pools.
MIN_IMAGE_SIZE: dict[str, int] = {
    "inception_v3": 75,
    **{name: 32 for name in ("vgg11", "vgg11_bn", "vgg16", "vgg19")},
    **{name: 29 for name in ("densenet121", "densenet169", "densenet201")},
}

#: Models that accept ``num_classes=None`` (an image output, or no class conditioning).
_UNCONDITIONAL: tuple[str, ...] = ("unet", "dit", "time_unet")

#: Registry: lower-case name -> builder. Extend it with :func:`register_model`.
MODELS: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Decorator adding a builder to :data:`MODELS` under ``name.lower()``.

    Args:
        name: Registry name.

    Returns:
        A decorator that registers and returns the builder unchanged.

    Raises:
        ValueError: If the name is already registered.
    """
    key = name.lower()

    def decorator(builder: ModelBuilder) -> ModelBuilder:
        if key in MODELS:
            raise ValueError(f"Model {key!r} is already registered")
        MODELS[key] = builder
        return builder

    return decorator


def replace_first_conv(model: nn.Module, in_channels: int) -> nn.Module:
    """Swap the first ``nn.Conv2d`` of ``model`` for one with ``in_channels`` inputs.

    Every other hyper-parameter of the convolution (out channels, kernel, stride,
    padding, dilation, groups, bias, padding mode) is kept; the new weight is
    Kaiming-normal (``fan_out``, ReLU) initialized, bias zero. The model is
    modified in place and returned. No-op if the first conv already has
    ``in_channels`` inputs.

    Args:
        model: Network to modify.
        in_channels: New number of input channels.

    Returns:
        ``model``.

    Raises:
        ValueError: If ``model`` contains no ``nn.Conv2d``, or the first one is
            grouped (the group count would not divide the new channels cleanly).
    """
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            break
    else:
        raise ValueError(f"{type(model).__name__} has no nn.Conv2d to adapt to {in_channels} channels")
    if module.in_channels == in_channels:
        return model
    if module.groups != 1:
        raise ValueError(f"cannot re-channel grouped first conv {path!r} (groups={module.groups})")
    new = nn.Conv2d(
        in_channels,
        module.out_channels,
        kernel_size=module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        groups=1,
        bias=module.bias is not None,
        padding_mode=module.padding_mode,
    )
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, new)
    return model


# --------------------------------------------------------------------------- small nets


@register_model("mlp")
def _build_mlp(
    *, in_channels: int, num_classes: int, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    return MLP(in_channels * image_size[0] * image_size[1], num_classes=num_classes, **kwargs)


@register_model("small_cnn")
def _build_small_cnn(
    *, in_channels: int, num_classes: int, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    return SmallCNN(in_channels, num_classes, image_size=image_size, **kwargs)


@register_model("lenet5")
def _build_lenet5(
    *, in_channels: int, num_classes: int, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    return LeNet5(in_channels, num_classes, image_size=image_size, **kwargs)


@register_model("rnn")
def _build_rnn(
    *, in_channels: int, num_classes: int, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    return RowRNN(in_channels, image_size, num_classes, **kwargs)


@register_model("unet")
def _build_unet(
    *, in_channels: int, num_classes: int | None, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    depth = kwargs.get("depth", 4)
    factor = 2**depth if isinstance(depth, int) and depth > 0 else 1
    if image_size[0] % factor or image_size[1] % factor:
        raise ValueError(
            f"unet(depth={depth}) needs image_size divisible by {factor}, got {image_size[0]}x{image_size[1]}"
        )
    return UNet(in_channels, num_classes=num_classes, **kwargs)


@register_model("dit")
def _build_dit(
    *, in_channels: int, num_classes: int | None, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    return DiT(in_channels, image_size, num_classes=num_classes, **kwargs)


@register_model("time_unet")
def _build_time_unet(
    *, in_channels: int, num_classes: int | None, image_size: tuple[int, int], **kwargs: Any
) -> nn.Module:
    return TimeUNet(in_channels, num_classes=num_classes, **kwargs)


# --------------------------------------------------------------------------- torchvision


def _torchvision_builder(name: str, **defaults: Any) -> ModelBuilder:
    """Builder for ``torchvision.models.<name>(weights=None, num_classes=..., **defaults)``."""
    factory = getattr(torchvision.models, name)

    def build(
        *, in_channels: int, num_classes: int, image_size: tuple[int, int], **kwargs: Any
    ) -> nn.Module:
        del image_size  # validated by build_model via MIN_IMAGE_SIZE
        if "weights" in kwargs and kwargs["weights"] is not None:
            raise ValueError(
                f"{name}: pretrained weights are not supported (got weights={kwargs['weights']!r})"
            )
        kwargs.pop("weights", None)
        model = factory(weights=None, num_classes=num_classes, **{**defaults, **kwargs})
        return replace_first_conv(model, in_channels)

    build.__name__ = build.__qualname__ = f"_build_{name}"
    build.__doc__ = f"``torchvision.models.{name}(weights=None, num_classes=num_classes)``, first conv re-channeled."
    return build


for _name in PAPER_ARCHITECTURES + TORCHVISION_TEST_ARCHITECTURES:
    if _name in MODELS:
        continue
    if _name == "inception_v3":
        # No auxiliary head, no ImageNet input re-normalization, PyTorch default init
        # (torchvision's truncated-normal init is slow and needs scipy). Needs >= 75x75 inputs.
        register_model(_name)(
            _torchvision_builder(_name, aux_logits=False, init_weights=False, transform_input=False)
        )
    else:
        register_model(_name)(_torchvision_builder(_name))
del _name


# --------------------------------------------------------------------------- public API


def list_models() -> list[str]:
    """Return all registered model names, sorted."""
    return sorted(MODELS)


def _lookup(name: str) -> tuple[str, ModelBuilder]:
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__} {name!r}")
    key = name.strip().lower().replace("-", "_")
    if key in MODELS:
        return key, MODELS[key]
    close = difflib.get_close_matches(key, list(MODELS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown model {name!r}.{hint} Known models: {', '.join(list_models())}")


def build_model(
    name: str,
    *,
    in_channels: int,
    num_classes: int | None,
    image_size: int | Sequence[int],
    **kwargs: Any,
) -> nn.Module:
    """Build a registered network.

    Args:
        name: Registry name (case-insensitive, ``-`` treated as ``_``); see
            :func:`list_models`.
        in_channels: Input image channels. For torchvision models other than 3,
            the first convolution is replaced (see :func:`replace_first_conv`).
        num_classes: Output classes (class labels for ``dit`` and ``time_unet``). ``unet``, ``dit`` and
            ``time_unet`` accept ``None`` (image output; unconditional).
        image_size: Input ``(H, W)`` or ``S``. Needed by size-dependent models
            (``mlp``, ``rnn``, ``lenet5``) and checked against each architecture's
            minimum (:data:`MIN_IMAGE_SIZE`, e.g. 75 for ``inception_v3``).
        **kwargs: Extra constructor arguments for the architecture (e.g.
            ``hidden`` for ``mlp``, ``hidden_size`` for ``rnn``, ``depth`` for
            ``unet``, ``dropout`` for torchvision nets).

    Returns:
        The freshly initialized ``nn.Module`` (train mode, CPU, float32).

    Raises:
        ValueError: Unknown name (message lists the known names and the closest
            match), non-positive sizes, or an image smaller than the
            architecture allows.
        TypeError: Arguments of the wrong type.
    """
    key, builder = _lookup(name)
    check_positive_int(in_channels, "in_channels")
    if num_classes is None:
        if key not in _UNCONDITIONAL:
            raise ValueError(f"num_classes=None is only supported by {', '.join(map(repr, _UNCONDITIONAL))}, got "
                             f"model {key!r}")
    else:
        check_positive_int(num_classes, "num_classes")
    size = to_pair(image_size)
    min_size = MIN_IMAGE_SIZE.get(key)
    if min_size is not None and min(size) < min_size:
        raise ValueError(f"{key} needs images of at least {min_size}x{min_size}, got {size[0]}x{size[1]}")
    return builder(in_channels=in_channels, num_classes=num_classes, image_size=size, **kwargs)
