"""``scipy.sparse.linalg.LinearOperator`` view of one sample's Jacobian.

``matvec``/``matmat`` are clone JVPs (a block of ``k`` vectors rides in one pass of ``k + 1``
rows), ``rmatvec``/``rmatmat`` VJPs on one recorded forward (kept for the operator's lifetime).
Vectors are flattened; inputs and outputs are float64 numpy arrays, converted to/from the
dtype of ``x`` for the model (so a float32 model gives float32-accurate products).
scipy is imported lazily, so :mod:`jvpreg.analysis` does not need it.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from ._jacobian import PerSampleJacobian, check_engine, check_inputs, check_positive_int

__all__ = ["as_linear_operator"]


def as_linear_operator(model: Callable, x: torch.Tensor, *, engine: str = "clone",
                       chunk_size: Optional[int] = 64):
    """``J_f(x)`` of ONE sample as a ``scipy.sparse.linalg.LinearOperator`` (shape ``(D_out, D_in)``).

    Lets scipy's iterative solvers run on the Jacobian without forming it: ``svds`` (matvec +
    rmatvec), ``eigs`` (square Jacobians), ``lsqr``, ``expm_multiply``…

    Args:
        model: callable ``(1, *in_shape) -> (1, *out_shape)`` tensor, in eval mode.
        x: one sample with its batch dim, shape ``(1, *in_shape)`` (e.g. ``x[i:i+1]``).
        engine: ``"clone"`` or ``"torch.func"``.
        chunk_size: at most this many vectors per pass in ``matmat``/``rmatmat``.

    Returns:
        A ``LinearOperator`` with ``dtype=float64``; ``.matvec(v)`` is ``J v`` for ``v`` of shape
        ``(D_in,)``, ``.rmatvec(w)`` is ``Jᵀ w`` for ``w`` of shape ``(D_out,)``.

    Raises:
        ValueError: ``x`` holds more than one sample.

    Example::

        >>> from scipy.sparse.linalg import svds
        >>> op = as_linear_operator(model.eval(), x[:1])
        >>> s = svds(op, k=5, return_singular_vectors=False)
    """
    from scipy.sparse.linalg import LinearOperator

    where = "as_linear_operator(model, x)"
    check_inputs(where, model, x)
    if x.shape[0] != 1:
        raise ValueError(f"{where}: expected one sample with its batch dim, shape (1, *in_shape), got shape "
                         f"{tuple(x.shape)}; pass x[i:i+1].")
    check_engine(where, engine)
    if chunk_size is not None:
        check_positive_int(where, "chunk_size", chunk_size)
    op = PerSampleJacobian(model, x, engine=engine, chunk_size=chunk_size, where=where)

    def to_torch(a: np.ndarray, d: int) -> torch.Tensor:
        a = np.asarray(a)
        if a.ndim == 1:
            a = a[:, None]
        if np.iscomplexobj(a):
            raise TypeError(f"{where}: the Jacobian operator is real; got a complex vector.")
        return torch.as_tensor(np.ascontiguousarray(a.T), device=op.device).to(op.dtype).reshape(1, -1, d)

    def to_numpy(t: torch.Tensor) -> np.ndarray:
        return t[0].T.detach().to("cpu", torch.float64).numpy()           # (D, k)

    def matmat(V: np.ndarray) -> np.ndarray:
        return to_numpy(op.jvp(to_torch(V, op.d_in)))

    def rmatmat(W: np.ndarray) -> np.ndarray:
        return to_numpy(op.vjp(to_torch(W, op.d_out)))

    return LinearOperator(
        shape=(op.d_out, op.d_in), dtype=np.float64,
        matvec=lambda v: matmat(v)[:, 0], rmatvec=lambda w: rmatmat(w)[:, 0],
        matmat=matmat, rmatmat=rmatmat,
    )
