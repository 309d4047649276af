"""Penalties on directional derivatives along given directions: JVP constraints and tangent prop.

Directions here are constants: whatever a direction function returns is detached, so gradients
reach the parameters through ``J_f(x)`` only. Every penalty is a mean over the rows (samples) that
carry tangents and, for several directions, over the directions.

Tangent prop (Simard et al. 1992): for a transformation ``T_t`` with ``T_0 = id`` and image ``I``,
the tangent vector is ``d/dt I(p + t v(p))|_{t=0} = v(p) · ∇I(p)`` with the vector fields
``translate_x: (1, 0)``, ``translate_y: (0, 1)``, ``rotate: (-y, x)``, ``scale: (x, y)`` in pixel
coordinates ``(x, y)`` = (column, row) measured from the image centre. ``∇I`` is computed per
channel by central differences (default) or the Sobel operator (scaled by 1/8, i.e. a smoothed
central difference), with replicate padding at the borders. Units: translations per pixel,
rotation per radian, scale per unit of log-scale.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .base import JVPPenalty, accum, PenaltyContext, check_choice, check_float

__all__ = ["JVPConstraint", "TangentProp", "image_gradients", "image_tangents"]

_KINDS = ("zero", "nonneg", "nonpos", "target", "lipschitz")
TRANSFORMS = ("translate_x", "translate_y", "rotate", "scale")


def _per_row(x: torch.Tensor) -> torch.Tensor:
    """Sum over every dim after the first two of ``(k, m, ...)``."""
    return x.flatten(2).sum(-1)


class JVPConstraint(JVPPenalty):
    """A penalty on the directional derivative ``J_f(x) u`` for user-given directions ``u = direction(x, y)``.

    With ``g = J_f(x) u`` per sample: ``zero``: ``||g||²`` (invariance); ``nonneg``: ``sum relu(margin - g)^p``
    (monotone non-decreasing along ``u``); ``nonpos``: ``sum relu(g + margin)^p``; ``target``:
    ``||g - t||²``; ``lipschitz``: ``relu(||g|| / ||u|| - L)^p``. The penalty is the mean over
    samples (and directions).

    Args:
        direction: ``direction(x, y) -> u`` with ``u`` of shape ``x.shape`` or ``(k, *x.shape)`` (``y``
            is the batch's target, or ``None`` when unknown), or a fixed tensor broadcastable to
            ``x.shape`` (e.g. a unit vector of one input feature). Detached.
        kind: ``"zero"``, ``"nonneg"``, ``"nonpos"``, ``"target"`` or ``"lipschitz"``.
        target: required for ``kind="target"``: a number, a tensor broadcastable to ``J u``'s shape, or
            ``target(x, y) -> tensor``.
        lipschitz: required for ``kind="lipschitz"``: the bound ``L > 0``.
        margin: hinge margin for ``nonneg``/``nonpos`` (``>= 0``).
        power: exponent ``p`` of the hinge kinds (1: hinge, 2: squared hinge).
        name, output_key: see :class:`JVPPenalty`.

    Raises:
        TypeError: ``direction`` neither callable nor a tensor; ``target`` of the wrong type.
        ValueError: unknown ``kind``; ``target``/``lipschitz`` missing or given for the wrong kind.

    Example::

        >>> e0 = torch.zeros(4); e0[0] = 1                 # monotone in feature 0
        >>> reg = JVPConstraint(e0, kind="nonneg")
        >>> out, pen = reg(model, x)
        >>> smooth = JVPConstraint(lambda x, y: torch.randn_like(x), kind="lipschitz", lipschitz=1.0)
    """

    def __init__(self, direction: Union[Callable[[torch.Tensor, Any], torch.Tensor], torch.Tensor],
                 kind: str = "zero", target: Any = None, lipschitz: Optional[float] = None, *,
                 margin: float = 0.0, power: float = 1.0, name: Optional[str] = None, output_key: Any = None):
        super().__init__(name=name, output_key=output_key)
        where = "JVPConstraint(...)"
        if isinstance(direction, torch.Tensor):
            self.register_buffer("fixed_direction", direction.detach().clone(), persistent=False)
            self.direction = None
        elif callable(direction):
            self.fixed_direction = None
            self.direction = direction
        else:
            raise TypeError(f"{where}: expected direction to be a callable direction(x, y) or a tensor, "
                            f"got {type(direction).__name__}.")
        self.kind = check_choice(where, "kind", kind, _KINDS)
        if kind == "target":
            if target is None:
                raise ValueError(f"{where}: kind='target' needs target= (a number, a tensor or target(x, y)).")
            if isinstance(target, bool) or not (isinstance(target, (int, float, torch.Tensor)) or callable(target)):
                raise TypeError(f"{where}: expected target to be a number, a tensor or a callable, "
                                f"got {type(target).__name__}.")
        elif target is not None:
            raise ValueError(f"{where}: target is only used with kind='target', got kind={kind!r}.")
        if kind == "lipschitz":
            if lipschitz is None:
                raise ValueError(f"{where}: kind='lipschitz' needs lipschitz=L (a positive number).")
            lipschitz = check_float(where, "lipschitz", lipschitz, low=0.0, low_open=True)
        elif lipschitz is not None:
            raise ValueError(f"{where}: lipschitz is only used with kind='lipschitz', got kind={kind!r}.")
        if isinstance(target, torch.Tensor):
            self.register_buffer("fixed_target", target.detach().clone(), persistent=False)
            self.target = None
        else:
            self.fixed_target = None
            self.target = target
        self.lipschitz = lipschitz
        self.margin = check_float(where, "margin", margin, low=0.0)
        self.power = check_float(where, "power", power, low=0.0, low_open=True)

    def directions(self, x: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        where = f"JVPConstraint(name={self.name!r})"
        if self.direction is None:
            u = self.fixed_direction.to(device=x.device, dtype=x.dtype)
        else:
            u = self.direction(x, context.target)
            if not isinstance(u, torch.Tensor):
                raise TypeError(f"{where}: direction(x, y) must return a tensor, got {type(u).__name__}.")
        u = u.detach().to(device=x.device, dtype=x.dtype)
        if not (tuple(u.shape[1:]) == tuple(x.shape) and u.dim() == x.dim() + 1):
            try:
                u = u.broadcast_to(x.shape)[None]
            except RuntimeError as err:
                raise ValueError(f"{where}: direction has shape {tuple(u.shape)}; expected x's shape "
                                 f"{tuple(x.shape)}, (k, *x.shape), or a shape broadcastable to x's.") from err
        if self.kind == "lipschitz":
            context.extra["direction_norm"] = accum(u).flatten(2).norm(dim=-1)  # (k, B)
        return u

    def _target(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        t = self.fixed_target if self.target is None else self.target
        if callable(t):
            t = t(context.x, context.target)
        t = torch.as_tensor(t, device=jvp.device).to(jvp.dtype)
        b, m = context.x.shape[0], context.rows
        if m < b and t.dim() == jvp.dim() - 1 and t.shape[0] == b:
            t = t[:m]
        elif m < b and t.dim() == jvp.dim() and t.shape[1] == b:
            t = t[:, :m]
        return t.detach()

    def penalty(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        g = accum(jvp)
        if self.kind == "zero":
            per = _per_row(g.pow(2))
        elif self.kind == "nonneg":
            per = _per_row(F.relu(self.margin - g).pow(self.power))
        elif self.kind == "nonpos":
            per = _per_row(F.relu(g + self.margin).pow(self.power))
        elif self.kind == "target":
            per = _per_row((g - self._target(g, context)).pow(2))
        else:  # lipschitz
            un = context.extra["direction_norm"][:, : context.rows].to(g.device)
            gn = g.flatten(2).norm(dim=-1)
            ratio = gn / un.clamp_min(torch.finfo(torch.float32).tiny)
            per = torch.where(un > 0, F.relu(ratio - self.lipschitz).pow(self.power), torch.zeros_like(ratio))
        return per.mean()

    def extra_repr(self) -> str:
        extra = f", lipschitz={self.lipschitz}" if self.kind == "lipschitz" else ""
        return f"kind={self.kind!r}{extra}, " + super().extra_repr()


def image_gradients(images: torch.Tensor, method: str = "central") -> tuple:
    """``(d/dx, d/dy)`` of ``(..., H, W)`` images per pixel (x: columns, y: rows), replicate padding.

    ``central``: ``dI/dx ~ (I[x+1] - I[x-1]) / 2``; ``sobel``: the Sobel filter divided by 8.

    Example::

        >>> dx, dy = image_gradients(torch.rand(8, 3, 32, 32), "sobel")   # each (8, 3, 32, 32)
    """
    shape = images.shape
    z = images.reshape(-1, 1, shape[-2], shape[-1])
    zp = F.pad(z, (1, 1, 1, 1), mode="replicate")
    if method == "central":
        dx = (zp[..., 1:-1, 2:] - zp[..., 1:-1, :-2]) * 0.5
        dy = (zp[..., 2:, 1:-1] - zp[..., :-2, 1:-1]) * 0.5
    elif method == "sobel":
        k = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=z.dtype, device=z.device) / 8
        dx = F.conv2d(zp, k[None, None])
        dy = F.conv2d(zp, k.t()[None, None])
    else:
        raise ValueError(f"image_gradients: expected method 'central' or 'sobel', got {method!r}.")
    return dx.reshape(shape), dy.reshape(shape)


def image_tangents(images: torch.Tensor, transforms: Sequence[str] = TRANSFORMS, method: str = "central") -> torch.Tensor:
    """Tangent vectors ``(k, *images.shape)`` of the named transformations (see the module docstring).

    ``tau_t = v_t · ∇I`` with ``v = (1, 0), (0, 1), (-y, x), (x, y)`` for translate_x/translate_y/rotate/scale.

    Example::

        >>> tau = image_tangents(images, ("rotate", "scale"))   # (2, B, C, H, W)
    """
    h, w = images.shape[-2], images.shape[-1]
    dx, dy = image_gradients(images, method)
    xs = torch.arange(w, dtype=images.dtype, device=images.device) - (w - 1) / 2
    ys = (torch.arange(h, dtype=images.dtype, device=images.device) - (h - 1) / 2)[:, None]
    fields = {
        "translate_x": lambda: dx,
        "translate_y": lambda: dy,
        "rotate": lambda: -ys * dx + xs * dy,
        "scale": lambda: xs * dx + ys * dy,
    }
    return torch.stack([fields[t]() for t in transforms])


class TangentProp(JVPPenalty):
    """Tangent prop: invariance of ``f`` to small image transformations (Simard et al. 1992).

    ``penalty = (1/m) sum_{b<m} sum_t ||J_f(x_b) tau_t(x_b)||²`` with the tangent vectors ``tau_t``
    computed from each image (module docstring); one forward of ``(1 + len(transforms)) B`` rows.

    Args:
        transforms: any of ``"translate_x"``, ``"translate_y"``, ``"rotate"``, ``"scale"``.
        gradient: image derivative, ``"central"`` differences or ``"sobel"``.
        name, output_key: see :class:`JVPPenalty`.

    Raises:
        TypeError: ``transforms`` not a str or sequence of str.
        ValueError: empty, unknown or repeated transforms; unknown ``gradient``. At call time, an
            input with fewer than 3 dims (needs ``(B, ..., H, W)``).

    Example::

        >>> reg = TangentProp(("rotate", "scale"))
        >>> out, pen = reg(model, images)                  # images: (B, C, H, W)
        >>> loss = F.cross_entropy(out, y) + 0.01 * pen
    """

    def __init__(self, transforms: Union[str, Sequence[str]] = TRANSFORMS, gradient: str = "central", *,
                 name: Optional[str] = None, output_key: Any = None):
        super().__init__(name=name, output_key=output_key)
        where = "TangentProp(...)"
        if isinstance(transforms, str):
            transforms = (transforms,)
        if not isinstance(transforms, Sequence) or not all(isinstance(t, str) for t in transforms):
            raise TypeError(f"{where}: expected transforms to be a str or a sequence of str, got {transforms!r}.")
        if not transforms:
            raise ValueError(f"{where}: expected at least one transform of {', '.join(TRANSFORMS)}; got none.")
        for t in transforms:
            check_choice(where, "each transform", t, TRANSFORMS)
        if len(set(transforms)) != len(transforms):
            raise ValueError(f"{where}: transforms repeat: {tuple(transforms)!r}.")
        self.transforms = tuple(transforms)
        self.gradient = check_choice(where, "gradient", gradient, ("central", "sobel"))

    def directions(self, x: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        if x.dim() < 3:
            raise ValueError(f"TangentProp(name={self.name!r}): expected images of shape (B, ..., H, W), "
                             f"got shape {tuple(x.shape)}.")
        with torch.no_grad():
            return image_tangents(x.detach(), self.transforms, self.gradient)

    def penalty(self, jvp: torch.Tensor, context: PenaltyContext) -> torch.Tensor:
        return accum(jvp).pow(2).sum() / jvp.shape[1]

    def extra_repr(self) -> str:
        return f"transforms={self.transforms!r}, gradient={self.gradient!r}, " + super().extra_repr()
