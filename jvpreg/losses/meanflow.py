"""Mean-flow (Geng et al., 2025) and continuous-time consistency losses with ``du/dt`` from a clone forward of
``[primal; tangent]`` rows, optionally shared with the training forward.

``z = (1 - t) x + t e``, ``v = e - x``, ``du/dt = d/dλ u(z + λ v, r, t + λ)|_0`` (the JVP of
``u(z, r, t)`` along ``(v, 0, 1)``), target ``u_tgt = v - (t - r) du/dt`` under stop-gradient, loss
``mean_b sg(w_b) ||Δ_b||²`` with ``Δ = u - u_tgt`` and ``w = 1 / (||Δ||² + c)^p``.

Two ways to run it, the same numbers (tests: float64, 1e-10):

* ``shared_forward=True``: ``(z, r, t)`` are packed with tangents ``(v, 0, 1)`` into clone batches
  (:func:`jvpreg.clone.pack`), the model runs once on them (:func:`jvpreg.clone.call`: captured
  program from the second call on), and :func:`jvpreg.clone.unpack` gives ``u`` (the primal rows:
  exactly the plain forward's output and its autograd graph, so ``∂loss/∂θ`` is exact) and ``du/dt``
  (detached: the stop-gradient). Train-mode BatchNorm takes its statistics and running averages from
  the primal rows only, and dropout draws one mask for all rows, so ``du/dt`` is the derivative of the
  very function whose output is trained. Its backward also runs through the tangent rows'
  linearisation (zero gradient, but every smooth op's second-order terms are evaluated), which on the
  CPU costs more than a second plain forward: measured in ``experiments/results/bench_meanflow_cpu.md``.
* ``shared_forward=False`` (default): the clone JVP under ``torch.no_grad`` (``2B`` rows, no graph),
  then a plain forward of ``B`` rows with gradients: 2 forwards + 1 backward of ``B`` rows where the
  references take a forward-mode or double-backward JVP plus the same forward. As in the references, the
  two calls draw two dropout masks and update BatchNorm running statistics twice (the batch statistics,
  hence ``u`` and ``du/dt``, are the same).

``objective="consistency"`` is the same JVP with ``r = 0``: ``u(z, 0, t)`` then maps ``z_t`` to
``z_0 = z_t - t u`` in one step, and ``u = v - t du/dt`` is the continuous-time consistency condition
``d/dt (z_t - t u(z_t, 0, t)) = 0`` for the linear (flow-matching) path. sCM's TrigFlow
parameterisation, tangent normalisation and warm-up schedule are not implemented.

Implementation choices: ``||Δ||²`` sums over every non-batch dim (as MeanFlow's reference code);
random times, noise and dropped labels come from the global RNG, or from a private generator with
``seed=`` (not part of the state dict).
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..clone import between_graphs, call, pack, unpack
from .base import check_choice, check_float, check_seed

__all__ = ["MeanFlowLoss", "MeanFlowOutput", "adaptive_l2", "sample_times"]

_OBJECTIVES = ("meanflow", "consistency")
_ORDERS = ("rt", "tr")
_DISTRIBUTIONS = ("logit_normal", "uniform")
_METHODS = ("clone", "torch.func", "autograd")


def sample_times(n: int, *, distribution: str = "logit_normal", mean: float = -0.4, std: float = 1.0,
                 equal_fraction: float = 0.75, generator: Optional[torch.Generator] = None,
                 device: Any = None, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(r, t)`` of shape ``(n,)`` with ``0 <= r <= t <= 1``: two draws sorted, then ``r = t`` on a fraction.

    ``distribution``: ``"logit_normal"`` (``sigmoid(N(mean, std²))``, MeanFlow's default ``(-0.4, 1.0)``) or
    ``"uniform"``. ``equal_fraction``: the share of samples with ``r = t`` (plain flow matching there;
    MeanFlow's best ImageNet setting is 0.75).

    Example::

        >>> r, t = sample_times(64, equal_fraction=0.75)
    """
    where = "sample_times(n, ...)"
    check_choice(where, "distribution", distribution, _DISTRIBUTIONS)
    check_float(where, "equal_fraction", equal_fraction, low=0.0, high=1.0)
    check_float(where, "std", std, low=0.0, low_open=True)
    check_float(where, "mean", mean)
    if distribution == "uniform":
        a = torch.rand((2, n), generator=generator, device=device, dtype=torch.float32)
    else:
        a = torch.sigmoid(torch.randn((2, n), generator=generator, device=device, dtype=torch.float32) * std + mean)
    r, t = a.min(0).values, a.max(0).values
    equal = torch.rand((n,), generator=generator, device=device, dtype=torch.float32) < equal_fraction
    r = torch.where(equal, t, r)
    return r.to(dtype), t.to(dtype)


def adaptive_l2(delta: torch.Tensor, p: float = 1.0, c: float = 1e-3) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean_b sg(w_b) ||Δ_b||², mean_b ||Δ_b||²)`` with ``w = 1 / (||Δ||² + c)^p`` (``p = 0``: plain L2)."""
    sq = delta.pow(2).flatten(1).sum(1)
    if p == 0:
        return sq.mean(), sq.detach().mean()
    w = (sq.detach() + c).pow(-p)
    return (w * sq).mean(), sq.detach().mean()


class MeanFlowOutput(NamedTuple):
    """What :class:`MeanFlowLoss` returns: the loss and the step's tensors (all but ``loss`` and ``u``
    detached). ``mse`` is the unweighted ``mean_b ||Δ_b||²``."""

    loss: torch.Tensor
    mse: torch.Tensor
    u: torch.Tensor
    target: torch.Tensor
    z: torch.Tensor
    r: torch.Tensor
    t: torch.Tensor


class MeanFlowLoss(nn.Module):
    """Mean-flow identity ``u(z, r, t) = v - (t - r) du/dt`` as a loss, ``du/dt`` by a clone-mode JVP.

    ``loss = mean_b sg(w_b) ||u - sg(v - (t - r) (v ∂_z u + ∂_t u))||²_b``, ``w = 1 / (||Δ||² + c)^p``.

    Args:
        objective: ``"meanflow"`` (``r <= t`` sampled) or ``"consistency"`` (``r = 0``: see the module docstring).
        time_order: the model's signature: ``"rt"`` for ``model(z, r, t, ...)``, ``"tr"`` for ``model(z, t, r, ...)``.
        time_distribution, time_mean, time_std, equal_fraction: the times, see :func:`sample_times`
            (``equal_fraction`` is ignored by ``"consistency"``).
        adaptive_p, adaptive_c: the adaptive weight's power ``p >= 0`` and offset ``c > 0``.
        label_key: keyword under which ``labels`` reach the model (``model(z, r, t, **{label_key: y})``).
        label_dropout: probability of replacing a label by the null label (classifier-free guidance training).
        null_label: the null label's index; ``None``: the model's ``null_label`` attribute.
        shared_forward: ``u`` from the clone forward's primal rows (one forward of ``2B`` rows with gradients)
            instead of a second, plain forward after a no-grad clone JVP (see the module docstring).
        method: ``"clone"`` (jvpreg), or a reference as public code writes it, for comparisons: ``"torch.func"``
            (``torch.func.jvp`` under ``torch.no_grad``) or ``"autograd"`` (``torch.autograd.functional.jvp``,
            double backward), each under the math attention backend (the fused kernels have neither formula),
            then a forward with gradients.
        engine, scale: of the clone forward (see :func:`jvpreg.jvp`).
        seed: seed of a private generator for times, noise and dropped labels (``None``: global RNG).

    Raises:
        TypeError/ValueError: an argument of the wrong type or range (the message names it).

    Example::

        >>> loss_fn = MeanFlowLoss(label_dropout=0.1)
        >>> out = loss_fn(dit, x, labels=y)           # clone JVP (2B rows, no graph), then u with gradients
        >>> out.loss.backward(); opt.step()
    """

    def __init__(self, *, objective: str = "meanflow", time_order: str = "rt", time_distribution: str = "logit_normal",
                 time_mean: float = -0.4, time_std: float = 1.0, equal_fraction: float = 0.75,
                 adaptive_p: float = 1.0, adaptive_c: float = 1e-3, label_key: str = "y", label_dropout: float = 0.0,
                 null_label: Optional[int] = None, shared_forward: bool = False, method: str = "clone",
                 engine: str = "auto", scale: Any = "auto", seed: Optional[int] = None) -> None:
        super().__init__()
        where = "MeanFlowLoss(...)"
        self.objective = check_choice(where, "objective", objective, _OBJECTIVES)
        self.time_order = check_choice(where, "time_order", time_order, _ORDERS)
        self.time_distribution = check_choice(where, "time_distribution", time_distribution, _DISTRIBUTIONS)
        self.time_mean = check_float(where, "time_mean", time_mean)
        self.time_std = check_float(where, "time_std", time_std, low=0.0, low_open=True)
        self.equal_fraction = check_float(where, "equal_fraction", equal_fraction, low=0.0, high=1.0)
        self.adaptive_p = check_float(where, "adaptive_p", adaptive_p, low=0.0)
        self.adaptive_c = check_float(where, "adaptive_c", adaptive_c, low=0.0, low_open=True)
        if not isinstance(label_key, str) or not label_key.isidentifier():
            raise TypeError(f"{where}: expected label_key to be a keyword name of the model (e.g. 'y'), got "
                            f"{label_key!r}.")
        self.label_key = label_key
        self.label_dropout = check_float(where, "label_dropout", label_dropout, low=0.0, high=1.0, high_open=True)
        if null_label is not None and (isinstance(null_label, bool) or not isinstance(null_label, int)
                                       or null_label < 0):
            raise TypeError(f"{where}: expected null_label to be None or an int >= 0, got {null_label!r}.")
        self.null_label = null_label
        if not isinstance(shared_forward, bool):
            raise TypeError(f"{where}: expected shared_forward to be a bool, got {shared_forward!r}.")
        self.shared_forward = shared_forward
        self.method = check_choice(where, "method", method, _METHODS)
        self.engine = check_choice(where, "engine", engine, ("auto", "eager", "captured", "compiled"))
        if scale != "auto":
            check_float(where, "scale", scale, low=0.0, low_open=True)
        self.scale = scale
        self.seed = check_seed(where, seed)
        self._generator: Optional[torch.Generator] = None

    def extra_repr(self) -> str:
        return (f"objective={self.objective!r}, time_order={self.time_order!r}, method={self.method!r}, "
                f"shared_forward={self.shared_forward}, adaptive_p={self.adaptive_p}, "
                f"label_dropout={self.label_dropout}")

    def generator(self, device: torch.device) -> Optional[torch.Generator]:
        """The private generator on ``device`` (``None`` without a seed)."""
        if self.seed is None:
            return None
        g = self._generator
        if g is None or g.device.type != torch.device(device).type:
            g = self._generator = torch.Generator(device=device)
            g.manual_seed(self.seed)
        return g

    def sample_times(self, n: int, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(r, t)`` for ``n`` samples as configured (``r = 0`` for ``"consistency"``)."""
        r, t = sample_times(n, distribution=self.time_distribution, mean=self.time_mean, std=self.time_std,
                            equal_fraction=self.equal_fraction, generator=self.generator(like.device),
                            device=like.device, dtype=like.dtype)
        return (torch.zeros_like(t) if self.objective == "consistency" else r), t

    def drop_labels(self, model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` with each replaced by the null label with probability ``label_dropout`` (a new tensor)."""
        if self.label_dropout == 0:
            return labels
        null = self.null_label if self.null_label is not None else getattr(model, "null_label", None)
        if null is None:
            raise ValueError(f"MeanFlowLoss(label_dropout={self.label_dropout}): the model has no null_label "
                             "attribute; pass null_label=<index of the 'no class' label> to MeanFlowLoss.")
        drop = torch.rand(labels.shape, generator=self.generator(labels.device), device=labels.device) \
            < self.label_dropout
        return torch.where(drop, torch.full_like(labels, int(null)), labels)

    @between_graphs
    def forward(self, model: nn.Module, x: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                r: Optional[torch.Tensor] = None, t: Optional[torch.Tensor] = None,
                noise: Optional[torch.Tensor] = None,
                model_kwargs: Optional[Mapping[str, Any]] = None) -> MeanFlowOutput:
        """The loss on data ``x (B, ...)``; ``r, t (B,)`` and ``noise`` (``x``'s shape) drawn when not given.

        ``labels`` (after label dropout) and ``model_kwargs`` are passed to the model as keywords.
        """
        where = "MeanFlowLoss(model, x)"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{where}: expected model to be an nn.Module (a module's clone forward is captured; "
                            f"wrap a function in one), got {type(model).__name__}.")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
            raise TypeError(f"{where}: expected x to be a floating-point batch (B, ...), got "
                            f"{getattr(x, 'dtype', type(x).__name__)}.")
        b = x.shape[0]
        if (r is None) != (t is None):
            raise ValueError(f"{where}: pass both r and t, or neither (then they are sampled).")
        if t is None:
            r, t = self.sample_times(b, x)
        for name, v in (("r", r), ("t", t)):
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (b,):
                raise ValueError(f"{where}: expected {name} of shape ({b},), got {tuple(getattr(v, 'shape', ()))}.")
        r, t = r.to(x), t.to(x)
        if noise is None:
            noise = torch.randn(x.shape, generator=self.generator(x.device), device=x.device,
                                dtype=torch.float32).to(x.dtype)
        elif noise.shape != x.shape:
            raise ValueError(f"{where}: expected noise of x's shape {tuple(x.shape)}, got {tuple(noise.shape)}.")
        kwargs = dict(model_kwargs or {})
        if labels is not None:
            kwargs[self.label_key] = self.drop_labels(model, labels)
        tb = t.reshape(-1, *([1] * (x.dim() - 1)))
        z = (1 - tb) * x + tb * noise
        v = noise - x
        u, dudt = self.velocity_and_derivative(model, z, v, r, t, kwargs)
        target = (v - (t - r).reshape(tb.shape) * dudt).detach()
        loss, mse = adaptive_l2(u - target, self.adaptive_p, self.adaptive_c)
        return MeanFlowOutput(loss, mse, u, target, z.detach(), r, t)

    def velocity_and_derivative(self, model: nn.Module, z: torch.Tensor, v: torch.Tensor, r: torch.Tensor,
                                t: torch.Tensor, kwargs: Mapping[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(u(z, r, t), du/dt)``: ``u`` with its autograd graph, ``du/dt`` along ``(v, 0, 1)`` detached."""
        times, tangents = ((r, t), (torch.zeros_like(r), torch.ones_like(t)))
        if self.time_order == "tr":
            times, tangents = times[::-1], tangents[::-1]
        primals, tans = (z, *times), (v, *tangents)
        if self.method != "clone":
            return self._reference(model, primals, tans, kwargs)
        context = contextlib.nullcontext() if self.shared_forward else torch.no_grad()
        with context:
            clones, s = pack(primals, tuple(u[None] for u in tans), scale=self.scale)
            out = call(model, clones, kwargs, engine=self.engine)
            u, dudt = unpack(out, s, batched=False)
        if not isinstance(u, torch.Tensor):
            raise TypeError(f"MeanFlowLoss: the model returned a {type(u).__name__}; expected the velocity tensor.")
        if not self.shared_forward:
            u = model(*primals, **kwargs)
        return u, dudt.detach()

    def _reference(self, model, primals, tans, kwargs):
        def f(*args):
            return model(*args, **kwargs)

        from torch.nn.attention import SDPBackend, sdpa_kernel

        # neither forward AD nor double backward has a formula for the fused attention kernels: math backend
        with sdpa_kernel(SDPBackend.MATH):
            if self.method == "torch.func":
                with torch.no_grad():
                    _, dudt = torch.func.jvp(f, primals, tans)
            else:
                _, dudt = torch.autograd.functional.jvp(f, primals, tans)
        return f(*primals), dudt.detach()
