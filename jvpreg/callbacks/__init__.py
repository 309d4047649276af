"""Lightning callbacks that attach JVP penalties to an unmodified LightningModule.

``Trainer(callbacks=[JacobianRegularizer(weight=0.01)])``: the module's own forward in its
``training_step`` runs once on the concatenated clone batch and ``weight * penalty`` is added to the
loss it returns; several regularizers share that one forward. :func:`regularized_forward` is the
helper for manual optimization. ``JacobianMonitor`` logs the Jacobian's spectrum on a validation batch.
"""
from ..losses.base import regularized_forward
from .monitor import JacobianMonitor
from .regularizer import (ConstraintRegularizer, JacobianRegularizer, JVPRegularizer, ParameterSensitivityRegularizer,
                          SpectralRegularizer, TangentPropRegularizer)
from .scale_check import PenaltyScaleWarning
from .shared import SharedForward

__all__ = [
    "ConstraintRegularizer", "JVPRegularizer", "JacobianMonitor", "JacobianRegularizer", "PenaltyScaleWarning",
    "ParameterSensitivityRegularizer", "SharedForward", "SpectralRegularizer", "TangentPropRegularizer",
    "regularized_forward",
]
