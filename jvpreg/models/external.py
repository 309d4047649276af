"""Model sources outside jvpreg: any timm architecture, and Hugging Face image classifiers.

Both are optional extras (``pip install -e ".[timm,hf]"``); nothing here imports ``timm`` or
``transformers`` until a builder is called, and a missing package raises an ``ImportError`` that
names the ``pip install`` to run. Models are built with random weights from their configuration
(``pretrained=False``: nothing is downloaded), sized to the data (input channels, classes, image size).

Implementation choices:

* :func:`build_timm` passes ``img_size`` to the architectures that take it (ViT, Swin, DeiT, ...,
  whose position embeddings depend on the image size) and retries without it for the others
  (convolutional networks), so one model config serves every timm name.
* :func:`build_hf` returns an :class:`HFImageClassifier`: the Hugging Face model called as
  ``model(pixel_values=x).logits``, so that the LightningModule, the robustness evaluation and
  ``jvpreg-eval`` see a plain ``x -> logits`` network. The raw model is its ``.model`` attribute;
  regularizing it directly (``module="net.model", input_key="pixel_values", output_key="logits"``)
  gives the same penalty.
"""
from __future__ import annotations

import difflib
import importlib.util
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from jvpreg.models._utils import check_positive_int, to_pair

__all__ = ["HF_ARCHITECTURES", "HFImageClassifier", "build_hf", "build_timm", "require"]

#: ``arch`` names of :func:`build_hf` that the tests cover (any Hugging Face ``model_type`` with an
#: image-classification head works, e.g. ``"deit"``, ``"beit"``, ``"resnet"``).
HF_ARCHITECTURES: tuple[str, ...] = ("vit", "convnext", "swin")

_EXTRAS = {"timm": ("timm", "timm"), "transformers": ("hf", "transformers")}


def require(package: str, what: str) -> None:
    """Raise an ``ImportError`` with the install command when the optional ``package`` is missing.

    Args:
        package: ``"timm"`` or ``"transformers"``.
        what: what needs it, for the message (e.g. ``"model=timm"``).

    Raises:
        ImportError: ``package`` is not installed.

    Example::

        >>> require("timm", "model=timm")     # no-op when timm is installed
    """
    if importlib.util.find_spec(package) is None:
        extra, pip_name = _EXTRAS[package]
        raise ImportError(f"jvpreg: {what} needs the optional package {pip_name!r}, which is not installed. Fix: "
                          f'pip install -e ".[{extra}]" (from a jvpreg checkout) or pip install {pip_name}.')


# --------------------------------------------------------------------------- timm


def build_timm(name: str, *, in_channels: int, num_classes: int, image_size: int | Sequence[int],
               pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Any timm architecture by name, sized to the data.

    Args:
        name: a timm model name (``timm.list_models()``), e.g. ``"convnext_atto"``, ``"resnet10t"``,
            ``"vit_tiny_patch16_224"``.
        in_channels: input channels (timm's ``in_chans``).
        num_classes: classes of the new head.
        image_size: input ``(H, W)`` or ``S``; given as ``img_size`` to architectures that take it.
        pretrained: load timm's pretrained weights (downloads them: needs network access).
        **kwargs: further timm model arguments, e.g. ``depths=[1, 1, 1, 1], dims=[8, 16, 32, 64]``
            (ConvNeXt) or ``depth=2, patch_size=4`` (ViT) for small test networks.

    Returns:
        The timm model (train mode), ``(B, in_channels, H, W) -> (B, num_classes)``.

    Raises:
        ImportError: timm is not installed (the message gives the install command).
        ValueError: unknown model name (with the closest timm names).
        RuntimeError: ``pretrained=True`` and the weights could not be downloaded.

    Example::

        >>> net = build_timm("convnext_atto", in_channels=1, num_classes=10, image_size=32,
        ...                  depths=[1, 1, 1, 1], dims=[8, 16, 32, 64])
        >>> net(torch.randn(2, 1, 32, 32)).shape
        torch.Size([2, 10])
    """
    require("timm", "model=timm")
    import timm

    check_positive_int(in_channels, "in_channels")
    check_positive_int(num_classes, "num_classes")
    if not isinstance(name, str) or not timm.is_model(name):
        close = difflib.get_close_matches(str(name), timm.list_models(), n=3, cutoff=0.75)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"build_timm(name): unknown timm model {name!r}.{hint} List them with "
                         f"timm.list_models('{str(name).split('_')[0]}*').")
    args = {"pretrained": bool(pretrained), "num_classes": num_classes, "in_chans": in_channels, **kwargs}
    try:
        try:
            return timm.create_model(name, img_size=to_pair(image_size, "image_size"), **args)
        except TypeError as err:
            if "img_size" not in str(err) or "img_size" in kwargs:
                raise
            return timm.create_model(name, **args)  # an architecture without an img_size argument
    except (OSError, RuntimeError) as err:
        if not pretrained:
            raise
        raise RuntimeError(f"build_timm({name!r}, pretrained=True): could not load the pretrained weights "
                           f"({type(err).__name__}: {err}). They are downloaded from the Hugging Face Hub: run "
                           "online once (the cache is reused offline), or use model.pretrained=false.") from err


# --------------------------------------------------------------------------- Hugging Face


class HFImageClassifier(nn.Module):
    """A Hugging Face image classifier as a plain ``x -> logits`` network.

    Args:
        model: the Hugging Face model (``...ForImageClassification``).
        input_key: the forward argument that receives the images.
        output_key: the field of the returned ``ModelOutput`` that holds the logits.

    Example::

        >>> net = HFImageClassifier(ViTForImageClassification(config))
        >>> logits = net(torch.randn(2, 3, 16, 16))          # == net.model(pixel_values=x).logits
    """

    def __init__(self, model: nn.Module, input_key: str = "pixel_values", output_key: str = "logits"):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"HFImageClassifier(model): expected an nn.Module, got {type(model).__name__}.")
        for arg, val in (("input_key", input_key), ("output_key", output_key)):
            if not isinstance(val, str) or not val:
                raise TypeError(f"HFImageClassifier(...): expected {arg} to be a non-empty str, got {val!r}.")
        self.model = model
        self.input_key = input_key
        self.output_key = output_key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``model(**{input_key: x})[output_key]``."""
        return self.model(**{self.input_key: x})[self.output_key]


def _config_class_args(config_cls: type) -> set:
    names = set()
    for cls in config_cls.__mro__:
        if "__init__" in vars(cls):
            names |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    return names


def build_hf(arch: str = "vit", *, in_channels: int, num_classes: int, image_size: int | Sequence[int],
             config: Mapping[str, Any] | None = None, pretrained: str | None = None, input_key: str = "pixel_values",
             output_key: str = "logits") -> HFImageClassifier:
    """A Hugging Face image classifier built from a config (random weights) or from a checkpoint name.

    Args:
        arch: the Hugging Face ``model_type``: ``"vit"``, ``"convnext"``, ``"swin"`` (tested), or any other
            with an image-classification head (``"deit"``, ``"beit"``, ``"resnet"``, ...).
        in_channels: ``num_channels`` of the config.
        num_classes: ``num_labels`` of the config.
        image_size: ``image_size`` of the config (square images: one side).
        config: further config fields, e.g. ``{"hidden_size": 64, "num_hidden_layers": 2}`` (checked
            against the config class: a misspelt field is an error, not silently stored).
        pretrained: a Hub checkpoint name (e.g. ``"google/vit-base-patch16-224"``) to load instead
            (needs network access or the Hub cache; the head is re-initialised for ``num_classes``).
        input_key, output_key: see :class:`HFImageClassifier`.

    Returns:
        An :class:`HFImageClassifier` (train mode).

    Raises:
        ImportError: transformers is not installed (the message gives the install command).
        ValueError: unknown ``arch`` or config field (with the closest names).

    Example::

        >>> net = build_hf("vit", in_channels=1, num_classes=10, image_size=8,
        ...                config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        ...                        "intermediate_size": 64, "patch_size": 2})
        >>> net(torch.randn(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """
    require("transformers", f"model=hf (arch={arch!r})")
    from transformers import AutoConfig, AutoModelForImageClassification
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    where = f"build_hf(arch={arch!r})"
    check_positive_int(in_channels, "in_channels")
    check_positive_int(num_classes, "num_classes")
    if arch not in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        known = sorted(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)
        close = difflib.get_close_matches(str(arch), known, n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"{where}: not a Hugging Face model_type with an image-classification head.{hint} "
                         f"Known: {', '.join(known)}.")
    fields = dict(config or {})
    h, w = to_pair(image_size, "image_size")
    sizing = {"num_channels": in_channels, "num_labels": num_classes, "image_size": h if h == w else [h, w]}
    if pretrained:
        model = AutoModelForImageClassification.from_pretrained(pretrained, ignore_mismatched_sizes=True,
                                                                **{**sizing, **fields})
        return HFImageClassifier(model, input_key, output_key)
    config_cls = CONFIG_MAPPING[arch]
    known = _config_class_args(config_cls)
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: {config_cls.__name__} has no field {unknown[0]!r}.{hint} Its fields: "
                         f"{', '.join(sorted(known))}.")
    if "image_size" not in known:
        sizing.pop("image_size")
    cfg = AutoConfig.for_model(arch, **{**sizing, **fields})
    return HFImageClassifier(AutoModelForImageClassification.from_config(cfg), input_key, output_key)
