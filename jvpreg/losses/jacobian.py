"""Penalties on the input-output Jacobian: Frobenius norm (Hutchinson) and spectral norm (power iteration).

Hoffman et al. (2019) scaling, matched to facebookresearch/jacobian_regularizer (``jacobian/jacobian.py``,
``JacobianReg.forward``): for each of ``nproj`` projections they draw, per sample, an *output-space*
vector ``v`` uniform on the unit sphere of R^C, take ``vᵀJ`` by double backprop and return
``R = (1/2) * sum_proj C * ||vᵀJ||² / (nproj * B)``, an unbiased estimate of
``(1/2) * mean_b ||J_b||_F²`` (their docstring: "(1/2) tr |dy/dx|^2"), used as
``loss = task + lambda_JR * R``. ``JacobianFrobenius(normalize="hoffman")`` estimates the same
quantity with the same factor 1/2 and the same per-sample sphere normalisation, on the *input* side
(clone mode gives ``J u``, not ``vᵀJ``): ``u`` uniform on the sphere of radius ``sqrt(D)`` in R^D,
``R = (1/2) * sum_proj ||J u||² / (nproj * B)``. Both have expectation ``(1/2) mean_b ||J_b||_F²``, so
their lambda values transfer (the estimators' variances differ: input- vs output-space projections).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..clone import call, pack, unpack
from .base import JVPPenalty, accum, PenaltyContext, check_choice, check_float, check_int, select_output

__all__ = ["JacobianFrobenius", "JacobianSpectralNorm"]


def _unit_rows(v: torch.Tensor, radius: float = 1.0, eps: float = 0.0) -> torch.Tensor:
    """Rescale each row ``v[i]`` of ``(N, ...)`` to norm ``radius``."""
    flat = v.flatten(1)
    n = flat.norm(dim=1, keepdim=True).clamp_min(eps if eps > 0 else torch.finfo(v.dtype).tiny)
    return (flat * (radius / n)).reshape(v.shape)


class JacobianFrobenius(JVPPenalty):
    """Hutchinson estimate of the mean squared Frobenius norm of the input-output Jacobian.

    ``penalty = c / (k m n) * sum_{j<k} sum_{b<m} ||(J_f(x) u_j)_b||²`` with ``E[u uᵀ] = I``, so
    ``E[penalty] = c / n * (1/m) * sum_b ||J_f(x_b)||_F²`` (``c = 1``, or ``1/2`` with ``normalize="hoffman"``;
    ``n = 1``, or the number of output elements per sample with ``reduction="mean"``).
    With train-mode BatchNorm ``f`` maps the whole batch and the estimate includes the (small)
    cross-sample blocks of its Jacobian. One forward of ``(1 + k) B`` rows.

    Args:
        n_projections: number ``k`` of random directions per step.
        distribution: ``"gaussian"`` (standard normal) or ``"rademacher"`` (±1 entries).
        normalize: ``None``, or ``"hoffman"`` to match Hoffman et al. 2019 (facebookresearch/
            jacobian_regularizer): each sample's direction is rescaled to norm ``sqrt(D)`` (uniform on
            the sphere for ``"gaussian"``) and the penalty carries their factor 1/2, so their
            ``lambda_JR`` transfers as the weight (see the module docstring).
        reduction: ``"sum"`` over a sample's output elements (the squared Frobenius norm), or ``"mean"``
            over them: for dense outputs (segmentation, images), whose sum grows with the output size.
        name, output_key, seed: see :class:`JVPPenalty`.

    Raises:
        TypeError: ``n_projections`` not an int.
        ValueError: ``n_projections < 1`` or an unknown ``distribution``/``normalize``/``reduction``.

    Example::

        >>> reg = JacobianFrobenius(n_projections=1)
        >>> out, jac = reg(model, x)                       # one forward of 2B rows
        >>> loss = F.cross_entropy(out, y) + 0.01 * jac
        >>> loss.backward()
    """

    #: options added after checkpoints stored this penalty's configuration: described in a callback's
    #: ``state_key`` only when they differ from these defaults, so that older checkpoints still resume.
    fingerprint_defaults = {"reduction": "sum"}

    def __init__(self, n_projections: int = 1, distribution: str = "gaussian", normalize: Optional[str] = None, *,
                 reduction: str = "sum", name: Optional[str] = None, output_key: Any = None,
                 seed: Optional[int] = None):
        super().__init__(name=name, output_key=output_key, seed=seed)
        where = "JacobianFrobenius(...)"
        self.n_projections = check_int(where, "n_projections", n_projections, 1)
        self.distribution = check_choice(where, "distribution", distribution, ("gaussian", "rademacher"))
        self.normalize = check_choice(where, "normalize", normalize, (None, "hoffman"))
        self.reduction = check_choice(where, "reduction", reduction, ("sum", "mean"))

    def directions(self, x: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        with torch.no_grad():
            u = self.sample((self.n_projections, *x.shape), x, self.distribution)
            if self.normalize == "hoffman":
                d = x[0].numel()
                u = _unit_rows(u.reshape(-1, *x.shape[1:]), math.sqrt(d)).reshape(u.shape)
        return u

    def penalty(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        k, m = jvp.shape[0], jvp.shape[1]
        n = math.prod(jvp.shape[2:]) if self.reduction == "mean" else 1
        value = accum(jvp).pow(2).sum() / (k * m * n)
        return value * 0.5 if self.normalize == "hoffman" else value

    def extra_repr(self) -> str:
        return (f"n_projections={self.n_projections}, distribution={self.distribution!r}, "
                f"normalize={self.normalize!r}, reduction={self.reduction!r}, " + super().extra_repr())


@contextlib.contextmanager
def preserve_buffers(model: Optional[nn.Module]) -> Iterator[None]:
    """Restore every buffer of ``model`` (BatchNorm running statistics...) on exit."""
    if model is None:
        yield
        return
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


class JacobianSpectralNorm(JVPPenalty):
    """Squared top singular value of each sample's Jacobian, by power iteration with persistent vectors.

    ``penalty = (1/m) sum_{b<m} ||J_f(x_b) v_b||²`` with unit vectors ``v_b``, a lower bound of
    ``mean_b sigma_max(J_f(x_b))²`` that tightens as ``v_b`` converges to the top right singular vector.

    One power-iteration step is free: the JVP ``J v`` comes from the shared clone forward, and the
    VJP ``Jᵀ(J v)`` from the training backward itself (``v`` enters the clone batch as a leaf, and the
    gradient of the loss w.r.t. it is a positive multiple of ``Jᵀ J v``; a hook normalises it into the
    new ``v`` for the next step). ``n_iter > 1`` adds ``n_iter - 1`` extra iterations before the
    forward (one clone forward plus an input-only backward each, with BatchNorm buffers restored
    afterwards). The vectors are a buffer of one vector per batch position, saved in ``state_dict``;
    a smaller batch uses the leading rows, a larger one appends fresh random rows, a new sample shape
    reinitialises them. Without a backward (validation), the vectors do not move. Batches are usually
    shuffled, so a position's vector is a warm start from another sample's Jacobian. Inside a module
    wrapped by DDP, DDP's buffer broadcast replaces each rank's vectors by rank 0's (a warm start too);
    the Lightning callbacks keep the penalty outside the model, so each rank keeps its own.

    Args:
        n_iter: power iterations per step (``1``: only the free one).
        eps: rows whose update has a norm below ``eps`` (or is not finite) keep their vector.
        name, output_key, seed: see :class:`JVPPenalty`.

    Raises:
        TypeError: ``n_iter`` not an int, ``eps`` not a number.
        ValueError: ``n_iter < 1`` or ``eps < 0``.

    Example::

        >>> reg = JacobianSpectralNorm()
        >>> for x, y in loader:
        ...     out, sigma2 = reg(model, x)                # sigma_max² estimate, vectors persist
        ...     (F.cross_entropy(out, y) + 0.01 * sigma2).backward()   # also advances v
        ...     opt.step(); opt.zero_grad()
    """

    vectors: Optional[torch.Tensor]

    def __init__(self, n_iter: int = 1, *, eps: float = 1e-12, name: Optional[str] = None,
                 output_key: Any = None, seed: Optional[int] = None):
        super().__init__(name=name, output_key=output_key, seed=seed)
        where = "JacobianSpectralNorm(...)"
        self.n_iter = check_int(where, "n_iter", n_iter, 1)
        self.eps = check_float(where, "eps", eps, low=0.0)
        self.register_buffer("vectors", None)

    # -- persistent vectors -------------------------------------------------------------------
    def _random_unit(self, n: int, x: torch.Tensor) -> torch.Tensor:
        return _unit_rows(self.sample((n, *x.shape[1:]), x))

    def _vectors_for(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        with torch.no_grad():
            v = self.vectors
            if v is None or tuple(v.shape[1:]) != tuple(x.shape[1:]):
                v = self._random_unit(b, x)
            else:
                v = v.to(device=x.device, dtype=x.dtype)
                if v.shape[0] < b:
                    v = torch.cat([v, self._random_unit(b - v.shape[0], x)])
            self.vectors = v
        return v[:b]

    def _store(self, new: torch.Tensor) -> None:
        """Write normalised updates ``new`` (``(r, *S)``) into the leading rows where they are usable."""
        with torch.no_grad():
            v = self.vectors
            if v is None or tuple(v.shape[1:]) != tuple(new.shape[1:]) or v.shape[0] < new.shape[0]:
                return
            flat = accum(new.detach()).flatten(1)
            norms = flat.norm(dim=1)
            ok = torch.isfinite(norms) & (norms > self.eps)  # rows not ok keep their vector (no host read)
            unit = (flat / norms.clamp_min(torch.finfo(flat.dtype).tiny)[:, None]).reshape(new.shape)
            rows = v[: new.shape[0]]
            rows.copy_(torch.where(ok.reshape(-1, *([1] * (new.dim() - 1))), unit.to(v.dtype), rows))

    def _hook(self, grad: torch.Tensor) -> None:
        self._store(grad)

    def _extra_iterations(self, v: torch.Tensor, context: PenaltyContext, n: int) -> torch.Tensor:
        if context.forward is None:
            raise ValueError("JacobianSpectralNorm(n_iter > 1) needs context.forward to run extra power iterations.")
        x = context.x.detach()
        with preserve_buffers(context.model), torch.enable_grad():
            for _ in range(n):
                leaf = v.detach().requires_grad_()
                (c,), s = pack((x,), (leaf[None],))
                _, t = unpack(call(context.forward, (c,)), s)
                t = select_output(t, self.output_key, type(self).__name__)
                (g,) = torch.autograd.grad(accum(t).pow(2).sum(), leaf)
                self._store(g)
                v = self.vectors[: x.shape[0]]
        return v

    def directions(self, x: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        v = self._vectors_for(x)
        if self.n_iter > 1 and torch.is_grad_enabled():
            v = self._extra_iterations(v, context, self.n_iter - 1)
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            leaf = v.detach().clone().requires_grad_()
            leaf.register_hook(self._hook)
            return leaf[None]
        return v.detach()[None]

    def penalty(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        return accum(jvp).pow(2).flatten(2).sum(-1).mean()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "vectors"
        if key in state_dict:  # shape follows the batch: adopt the saved one
            self.vectors = state_dict[key].detach().clone()
        else:
            self.vectors = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"n_iter={self.n_iter}, " + super().extra_repr()
