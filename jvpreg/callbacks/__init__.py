"""Lightning callbacks that attach JVP penalties to an unmodified LightningModule.

``Trainer(callbacks=[JacobianRegularizer(weight=0.01)])``: the module's own forward in its
``training_step`` runs once on the concatenated clone batch and ``weight * penalty`` is added to the
loss it returns; several regularizers share that one forward. :func:`regularized_forward` is the
helper for manual optimization. ``JacobianMonitor`` (monitors) is imported lazily from ``.monitor``
on first attribute access (kept out of ``__all__`` so a star import never depends on that module).
"""
from ..losses.base import regularized_forward
from .regularizer import (ConstraintRegularizer, JacobianRegularizer, JVPRegularizer, ParameterSensitivityRegularizer,
                          SpectralRegularizer, TangentPropRegularizer)
from .scale_check import PenaltyScaleWarning
from .shared import SharedForward

__all__ = [
    "ConstraintRegularizer", "JVPRegularizer", "JacobianRegularizer", "PenaltyScaleWarning",
    "ParameterSensitivityRegularizer", "SharedForward", "SpectralRegularizer", "TangentPropRegularizer",
    "regularized_forward",
]


def __getattr__(name: str):
    if name == "JacobianMonitor":  # owned by the monitors module; imported on first use only
        from .monitor import JacobianMonitor

        return JacobianMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
