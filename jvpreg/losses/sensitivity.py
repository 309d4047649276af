"""Sensitivity of the output to random perturbations of chosen weights (a flatness penalty).

The JVP w.r.t. a weight ``W`` in direction ``U`` is the "swapped layer weight" of docs/design.md §1: the
layer's weight is replaced, for this forward only, by the clone ``[W; W + s U]``, so a layer
``h = W z + b`` gives ``W z + b + s U z`` in the tangent block. With no input tangent, everything
before the first perturbed layer runs once on the plain batch.

``relative=True`` (implementation choice): each parameter's direction is scaled by that parameter's
root-mean-square value, ``U_p = rms(W_p) * N(0, I)``, so the penalty measures relative (layer-wise)
perturbations and does not change when a weight followed by BatchNorm is rescaled. Every matched
parameter is perturbed jointly in each projection, so ``E[penalty] = sum_p c_p² ||J_{W_p} f||_F²``
averaged over samples (``c_p = rms(W_p)``, or 1).
"""
from __future__ import annotations

import fnmatch
from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn

from .base import JVPPenalty, accum, PenaltyContext, check_choice, check_int
from .sharded import is_sharded

__all__ = ["ParameterSensitivity"]


def _rms(p: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean(p²))`` as a plain tensor; of a sharded (``DTensor``) parameter over all its shards."""
    ms = accum(p.detach()).pow(2).mean()
    return (ms.full_tensor() if is_sharded(ms) else ms).sqrt()


class ParameterSensitivity(JVPPenalty):
    """Weight-space Hutchinson estimate: ``E_U ||J_W f(x) U||²`` for random directions on chosen weights.

    ``penalty = 1/(k m) * sum_{j<k} sum_{b<m} ||(sum_p J_{W_p} f(x) U_{p,j})_b||²`` with ``U ~ N(0, I)``
    (times ``rms(W_p)`` when ``relative``): small values mean a flat minimum along those weights.

    Args:
        params: ``fnmatch`` patterns over the model's parameter names (``named_parameters()`` of the
            module whose forward is cloned), e.g. ``("*conv*weight",)`` or ``"layer4.*"``.
        n_projections: number ``k`` of random weight directions per step.
        relative: scale each parameter's direction by its RMS (see the module docstring).
        distribution: ``"gaussian"`` or ``"rademacher"``.
        name, output_key, seed: see :class:`JVPPenalty`.

    Raises:
        TypeError: ``params`` not a str or a sequence of str.
        ValueError: empty ``params``, ``n_projections < 1``, unknown ``distribution``. At call time,
            patterns that match no parameter (the message lists the model's parameter names).

    Example::

        >>> reg = ParameterSensitivity(params=("layer4.*.conv*.weight",))
        >>> out, sens = reg(resnet, x)                     # one forward, weight JVP in the tangent block
        >>> loss = F.cross_entropy(out, y) + 1e-3 * sens
    """

    def __init__(self, params: Union[str, Sequence[str]] = ("*conv*weight",), n_projections: int = 1,
                 relative: bool = True, distribution: str = "gaussian", *, name: Optional[str] = None,
                 output_key: Any = None, seed: Optional[int] = None):
        super().__init__(name=name, output_key=output_key, seed=seed)
        where = "ParameterSensitivity(...)"
        if isinstance(params, str):
            params = (params,)
        if not isinstance(params, Sequence) or not all(isinstance(p, str) for p in params):
            raise TypeError(f"{where}: expected params to be a str or a sequence of str patterns, got {params!r}.")
        if not params:
            raise ValueError(f"{where}: expected at least one parameter name pattern, got an empty sequence.")
        if not isinstance(relative, bool):
            raise TypeError(f"{where}: expected relative to be a bool, got {relative!r}.")
        self.params = tuple(params)
        self.n_projections = check_int(where, "n_projections", n_projections, 1)
        self.relative = relative
        self.distribution = check_choice(where, "distribution", distribution, ("gaussian", "rademacher"))

    def matched(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The parameters of ``model`` matched by :attr:`params` (name -> parameter)."""
        found = {n: p for n, p in model.named_parameters()
                 if p.is_floating_point() and any(fnmatch.fnmatchcase(n, pat) for pat in self.params)}
        if not found:
            names = [n for n, _ in model.named_parameters()]
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"ParameterSensitivity(name={self.name!r}): params={self.params!r} match no parameter "
                             f"of {type(model).__name__}; its parameters are: {shown or '(none)'}.")
        return found

    def param_directions(self, model: nn.Module, context: PenaltyContext) -> Dict[str, torch.Tensor]:
        dirs = {}
        with torch.no_grad():
            for name, p in self.matched(model).items():
                u = self.sample((self.n_projections, *p.shape), p, self.distribution)
                if self.relative:
                    u = u * _rms(p).to(u.dtype)
                dirs[name] = u
        return dirs

    def penalty(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        k, m = jvp.shape[0], jvp.shape[1]
        return accum(jvp).pow(2).sum() / (k * m)

    def extra_repr(self) -> str:
        return (f"params={self.params!r}, n_projections={self.n_projections}, relative={self.relative}, "
                + super().extra_repr())
