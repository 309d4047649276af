"""JVP penalties as ``nn.Module``s, usable without Lightning: ``out, penalty = reg(model, x)``.

Every penalty runs ONE clone forward of ``model`` on the concatenated batch ``[x; x + s u_1; ...]``
(docs/design.md, "Shared forward in training"): ``out`` is exactly the plain forward's ``f(x)`` for the
task loss, and the penalty is differentiable with exact gradients. :class:`Stack` runs several
penalties in the same forward; :func:`regularized_forward` is the functional form. :class:`MeanFlowLoss`
is a training objective (mean flows, consistency) whose target is a JVP, from the same kind of forward.
"""
from .base import JVPPenalty, PenaltyContext, Plan, Stack, prepare, regularized_forward
from .constraints import JVPConstraint, TangentProp, image_gradients, image_tangents
from .jacobian import JacobianFrobenius, JacobianSpectralNorm
from .meanflow import MeanFlowLoss, MeanFlowOutput, adaptive_l2, sample_times
from .sensitivity import ParameterSensitivity

__all__ = [
    "JVPConstraint", "JVPPenalty", "JacobianFrobenius", "JacobianSpectralNorm", "MeanFlowLoss", "MeanFlowOutput",
    "ParameterSensitivity", "adaptive_l2", "sample_times",
    "PenaltyContext", "Plan", "Stack", "TangentProp", "image_gradients", "image_tangents", "prepare",
    "regularized_forward",
]
