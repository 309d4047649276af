"""Networks benchmarked by jvpreg and a name-based registry to build them.

Only depends on torch/torchvision; :func:`build_timm` and :func:`build_hf` (timm and Hugging Face
models, optional extras) import their package when called.
"""

from jvpreg.models.registry import (
    MODELS,
    PAPER_ARCHITECTURES,
    build_model,
    list_models,
    register_model,
    replace_first_conv,
)
from jvpreg.models.external import HFImageClassifier, build_hf, build_timm
from jvpreg.models.dit import DiT
from jvpreg.models.rnn import RowRNN
from jvpreg.models.small import MLP, LeNet5, SmallCNN
from jvpreg.models.time_unet import TimeUNet
from jvpreg.models.unet import UNet

__all__ = [
    "DiT",
    "MLP",
    "MODELS",
    "PAPER_ARCHITECTURES",
    "LeNet5",
    "RowRNN",
    "SmallCNN",
    "TimeUNet",
    "UNet",
    "HFImageClassifier",
    "build_hf",
    "build_model",
    "build_timm",
    "list_models",
    "register_model",
    "replace_first_conv",
]
