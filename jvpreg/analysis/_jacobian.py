"""Per-sample Jacobian products shared by every analysis routine.

Layout (stated once): a batch ``x`` of shape ``(B, *in_shape)`` has ``B`` per-sample Jacobians
``J_i = d f(x)[i] / d x[i]`` of shape ``(D_out, D_in)`` with ``D_in = prod(in_shape)`` and
``D_out = prod(out_shape)``. Blocks of vectors are stored **sample-major and flattened**:
``V`` of shape ``(B, k, D_in)`` holds ``k`` input-space vectors per sample, and
``JV = J @ V`` has shape ``(B, k, D_out)``. Every routine of :mod:`jvpreg.analysis` works in
this layout and converts once, here, to the engines' tangent layout ``(k, B, *in_shape)``.

Per-sample Jacobians are what a batched JVP/VJP gives **only when the model treats samples
independently**: eval-mode BatchNorm, no dropout, no attention across the batch. A
train-mode module with BatchNorm or dropout triggers a warning (nothing is changed on the model).

Engines:

* ``"clone"`` (default): ``k`` JVPs in ONE forward of ``(k+1)·B`` rows with
  :func:`jvpreg.jvp` (``batched_tangents=True``).
* ``"torch.func"``: ``k`` JVPs by ``torch.func.vmap`` over ``torch.func.jvp`` (the reference the
  benchmark compares against).

VJPs (the engine only changes the JVPs): ``torch.func.vmap`` over the function returned by
``torch.func.vjp`` — one recorded plain forward of ``B`` rows, kept for the operator's lifetime,
and one batched backward for ``k`` cotangents. On CPU it was as fast as or faster than
``torch.autograd.grad(..., is_grads_batched=True)`` and much faster than backpropagating through the
clone forward. With the clone engine, a model whose backward cannot
be vmapped falls back to ``is_grads_batched`` and then to a loop of ``k`` backwards.

Both engines compute the same quantities; the algorithms built on top are engine-agnostic.
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..clone import jvp as clone_jvp

__all__ = ["ENGINES", "ConvergenceWarning", "PerSampleJacobian", "random_directions"]

#: Names accepted by the ``engine=`` argument of every analysis routine.
ENGINES: tuple[str, ...] = ("clone", "torch.func")
#: Names accepted by ``distribution=``.
DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian")

_BATCH_COUPLED = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


class ConvergenceWarning(UserWarning):
    """An iterative method stopped at ``max_iter`` before reaching its tolerance."""


def check_engine(where: str, engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"{where}: engine must be one of {ENGINES}, got {engine!r}.")
    return engine


def check_positive_int(where: str, name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}.")
    return value


def check_nonnegative_float(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0) or math.isinf(value):
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}.")
    return float(value)


def check_generator(where: str, generator) -> Optional[torch.Generator]:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{where}: generator must be a torch.Generator or None, got {type(generator).__name__}.")
    return generator


def check_inputs(where: str, model, x) -> None:
    if not callable(model):
        raise TypeError(f"{where}: expected model to be callable (an nn.Module or a function), "
                        f"got {type(model).__name__}.")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected x to be a tensor of shape (B, *in_shape), got {type(x).__name__}.")
    if x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"{where}: expected x of shape (B, *in_shape) with B >= 1, got shape {tuple(x.shape)}.")
    if not x.is_floating_point():
        raise TypeError(f"{where}: x must be floating point, got dtype {x.dtype}.")
    if isinstance(model, nn.Module) and model.training:
        coupled = [type(m).__name__ for m in model.modules() if isinstance(m, _BATCH_COUPLED)]
        if coupled:
            warnings.warn(
                f"{where}: the model is in training mode and contains {sorted(set(coupled))}; per-sample "
                "Jacobians assume samples are processed independently (batch statistics and dropout masks "
                "couple them or make f random). Call model.eval() first.", UserWarning, stacklevel=3)


def random_directions(shape: Sequence[int], distribution: str, *, dtype: torch.dtype, device: torch.device,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Rademacher (``±1``) or standard Gaussian entries, drawn on the generator's device."""
    gen_device = generator.device if generator is not None else device
    if distribution == "rademacher":
        r = torch.randint(0, 2, tuple(shape), generator=generator, device=gen_device).to(dtype).mul_(2).sub_(1)
    elif distribution == "gaussian":
        r = torch.randn(tuple(shape), generator=generator, device=gen_device, dtype=dtype)
    else:  # pragma: no cover - validated by callers
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    return r.to(device)


class PerSampleJacobian:
    """Products with the per-sample Jacobians ``J_i`` of ``model`` at ``x`` (see module docstring).

    Args:
        model: callable ``(B, *in_shape) -> (B, *out_shape)`` tensor.
        x: the batch (detached; never modified).
        engine: ``"clone"`` or ``"torch.func"``.
        chunk_size: at most this many directions per pass (``None``: all at once). A JVP pass
            with the clone engine holds ``(chunk_size + 1) * B`` rows.
        where: name of the calling API, for error messages.

    Attributes:
        output: ``f(x)`` of shape ``(B, *out_shape)`` (no graph).
        in_shape, out_shape, d_in, d_out, batch_size.
    """

    def __init__(self, model: Callable, x: torch.Tensor, *, engine: str = "clone",
                 chunk_size: Optional[int] = None, where: str = "jvpreg.analysis") -> None:
        self.model = model
        self.where = where
        self.engine = check_engine(where, engine)
        self.chunk_size = chunk_size
        with torch.inference_mode(False):
            self.x = x.detach().clone() if x.is_inference() else x.detach()
        self.batch_size = x.shape[0]
        self.in_shape = tuple(x.shape[1:])
        self.d_in = math.prod(self.in_shape)
        with torch.no_grad():
            out = model(self.x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{where}: model(x) must return one tensor, got {type(out).__name__}; wrap the model "
                            "in a function that returns the output of interest.")
        if out.dim() < 1 or out.shape[0] != self.batch_size:
            raise ValueError(f"{where}: model(x) must keep the batch dim: x has B={self.batch_size} samples but "
                             f"the output has shape {tuple(out.shape)}.")
        if not out.is_floating_point():
            raise TypeError(f"{where}: model(x) must be floating point, got {out.dtype}.")
        self.output = out
        self.out_shape = tuple(out.shape[1:])
        self.d_out = math.prod(self.out_shape)
        self._graph = None  # (x_leaf, y) recorded lazily for VJPs
        self._func_vjp = None
        self.vjp_method = "torch.func.vjp"
        #: cost accounting, shared with :meth:`subset` operators: directions pushed forward / pulled
        #: back (summed over passes, per sample of the pass) and wall seconds spent in each (CPU-side
        #: wall time: asynchronous on CUDA unless the caller synchronises).
        self.stats = {"n_jvp": 0, "n_vjp": 0, "jvp_seconds": 0.0, "vjp_seconds": 0.0}

    # ------------------------------------------------------------------ helpers
    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def _chunks(self, k: int):
        step = k if not self.chunk_size else max(1, int(self.chunk_size))
        for start in range(0, k, step):
            yield slice(start, min(k, start + step))

    def _to_tangents(self, V: torch.Tensor) -> torch.Tensor:
        """``(B, k, D_in)`` -> ``(k, B, *in_shape)``."""
        k = V.shape[1]
        return V.transpose(0, 1).reshape(k, self.batch_size, *self.in_shape).to(self.dtype)

    # ------------------------------------------------------------------ products
    def jvp(self, V: torch.Tensor) -> torch.Tensor:
        """``J_i V_i`` for every sample: ``(B, k, D_in)`` -> ``(B, k, D_out)`` (no graph)."""
        if V.shape[0] != self.batch_size or V.shape[2] != self.d_in:
            raise ValueError(f"{self.where}: internal error, V has shape {tuple(V.shape)}, expected "
                             f"({self.batch_size}, k, {self.d_in}).")
        outs = []
        t0 = time.perf_counter()
        with torch.no_grad():
            for sl in self._chunks(V.shape[1]):
                T = self._to_tangents(V[:, sl])
                if self.engine == "clone":
                    _, JT = clone_jvp(self.model, (self.x,), (T,), batched_tangents=True)
                else:
                    x, model = self.x, self.model
                    JT = torch.func.vmap(lambda t: torch.func.jvp(model, (x,), (t,))[1])(T)
                outs.append(JT.reshape(T.shape[0], self.batch_size, self.d_out).transpose(0, 1))
        out = torch.cat(outs, dim=1)
        self.stats["n_jvp"] += V.shape[1]
        self.stats["jvp_seconds"] += time.perf_counter() - t0
        return out

    def _record(self):
        if self._graph is None:
            with torch.inference_mode(False), torch.enable_grad():
                leaf = self.x.clone().requires_grad_(True)
                y = self.model(leaf)
            self._graph = (leaf, y)
        return self._graph

    def vjp(self, W: torch.Tensor) -> torch.Tensor:
        """``J_iᵀ W_i`` for every sample: ``(B, k, D_out)`` -> ``(B, k, D_in)`` (no graph)."""
        if W.shape[0] != self.batch_size or W.shape[2] != self.d_out:
            raise ValueError(f"{self.where}: internal error, W has shape {tuple(W.shape)}, expected "
                             f"({self.batch_size}, k, {self.d_out}).")
        outs = []
        t0 = time.perf_counter()
        for sl in self._chunks(W.shape[1]):
            C = W[:, sl].transpose(0, 1).reshape(-1, self.batch_size, *self.out_shape).to(self.dtype)
            outs.append(self._vjp_chunk(C).reshape(C.shape[0], self.batch_size, self.d_in).transpose(0, 1))
        out = torch.cat(outs, dim=1)
        self.stats["n_vjp"] += W.shape[1]
        self.stats["vjp_seconds"] += time.perf_counter() - t0
        return out

    def _vjp_chunk(self, C: torch.Tensor) -> torch.Tensor:
        """``(k, B, *out_shape)`` cotangents -> ``(k, B, *in_shape)``.

        ``vmap`` over the function returned by ``torch.func.vjp`` (one recorded forward, one batched
        backward). The clone engine falls back to ``torch.autograd.grad(..., is_grads_batched=True)``
        and then to a loop of ``k`` backwards if the model's ops cannot be vmapped; the name of the
        method in use is ``self.vjp_method``.
        """
        with torch.inference_mode(False), torch.enable_grad():
            if self.vjp_method == "torch.func.vjp":
                try:
                    if self._func_vjp is None:
                        _, self._func_vjp = torch.func.vjp(self.model, self.x)
                    fn = self._func_vjp
                    return torch.func.vmap(lambda c: fn(c)[0])(C).detach()
                except (RuntimeError, NotImplementedError):
                    if self.engine == "torch.func":
                        raise
                    self._func_vjp = None
                    self.vjp_method = "autograd.grad(is_grads_batched)"
            leaf, y = self._record()
            if self.vjp_method == "autograd.grad(is_grads_batched)":
                try:
                    (g,) = torch.autograd.grad(y, leaf, C, retain_graph=True, is_grads_batched=True)
                    return g.detach()
                except (RuntimeError, NotImplementedError):
                    self.vjp_method = "autograd.grad loop"
            return torch.stack([torch.autograd.grad(y, leaf, c, retain_graph=True)[0] for c in C]).detach()

    def release(self) -> None:
        """Free the recorded graph (the next VJP records a new one)."""
        self._graph = None
        self._func_vjp = None

    def subset(self, index: torch.Tensor) -> "PerSampleJacobian":
        """The same operator on the samples ``x[index]`` (valid because samples are independent)."""
        op = PerSampleJacobian(self.model, self.x[index], engine=self.engine, chunk_size=self.chunk_size,
                               where=self.where)
        op.stats = self.stats
        return op
