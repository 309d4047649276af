"""Networks benchmarked by jvpreg and a name-based registry to build them.

Only depends on torch/torchvision.
"""

from jvpreg.models.registry import (
    MODELS,
    PAPER_ARCHITECTURES,
    build_model,
    list_models,
    register_model,
    replace_first_conv,
)
from jvpreg.models.rnn import RowRNN
from jvpreg.models.small import MLP, LeNet5, SmallCNN
from jvpreg.models.unet import UNet

__all__ = [
    "MLP",
    "MODELS",
    "PAPER_ARCHITECTURES",
    "LeNet5",
    "RowRNN",
    "SmallCNN",
    "UNet",
    "build_model",
    "list_models",
    "register_model",
    "replace_first_conv",
]
