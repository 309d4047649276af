"""Top-k singular values / eigenvalues of per-sample Jacobians from JVPs (and VJPs).

Both routines are the paper's §5 algorithms ("BlockSVD" and "eigen", Bentbib & Kanber 2015)
written as block subspace iteration with a Rayleigh–Ritz step at every iteration, batched over
the samples of ``x`` and, with the default clone engine, over the ``m = k + oversample`` block
directions: one iteration pushes all ``m`` directions of all ``B`` samples through ONE forward
of ``(m + 1)·B`` rows.

Singular values (:func:`top_singular_values`), per sample, with ``V`` (``D_in × m``) orthonormal:

1. ``Y = J V`` (``m`` JVPs);  thin SVD ``Y = U Σ Wᵀ`` — Rayleigh–Ritz for ``JᵀJ`` on ``span V``:
   Ritz values ``σ = diag Σ``, left vectors ``U``, right vectors ``V W`` (so ``J v_i = σ_i u_i``
   holds exactly);
2. ``Z = Jᵀ U`` (``m`` VJPs) — gives the residual ``‖Jᵀu_i − σ_i v_i‖ / σ_1`` for free;
3. stop when every top-k value moved by at most ``tol`` relative (``|σ_i − σ_i'| ≤ tol·σ_i``);
   else ``V ← orth(Z)`` (``span Z = span JᵀJ V``, columns ordered by Ritz value).

Convergence of ``σ_i`` is linear with rate ``(σ_{m+1}/σ_i)²`` per iteration: oversampling helps
when the top values are clustered. A sample whose values have converged is frozen and dropped
from later passes. The relative-change criterion is cheap but not a certificate: check
``residual`` when it matters.

Eigenvalues (:func:`top_eigenvalues`, square Jacobians only, JVPs only — no VJP, no graph):
orthogonal iteration ``V ← orth(J V)`` with Schur–Rayleigh–Ritz at every step,
``H = Vᵀ J V`` (``m × m``), ``H s = λ s``, Ritz vector ``V s`` and residual
``‖J V s − λ V s‖ / |λ_1|``. It finds the eigenvalues of largest **modulus**; limits:

* rate ``|λ_{m+1}| / |λ_i|`` per iteration (not squared): slow when moduli cluster, which is
  common for network Jacobians — use a generous ``oversample``;
* ``J`` is not symmetric, so eigenvalues come in complex-conjugate pairs and are returned as a
  complex tensor (take ``.real`` only when you know they are real); a pair straddling the
  block edge converges slowly — keep ``oversample >= 2``;
* non-normal ``J``: eigenvalues are ill-conditioned; a small residual then does not imply an
  accurate eigenvalue, and ``|λ_1|`` may be far below ``σ_1``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ._jacobian import (
    ConvergenceWarning,
    PerSampleJacobian,
    check_engine,
    check_generator,
    check_inputs,
    check_nonnegative_float,
    check_positive_int,
)

__all__ = ["EigenResult", "SpectralResult", "top_eigenvalues", "top_singular_values"]


@dataclass
class SpectralResult:
    """Top-k singular triplets of each per-sample Jacobian (see :func:`top_singular_values`).

    Attributes:
        values: ``(B, k)`` singular values, descending.
        left: ``(B, k, D_out)`` left singular vectors ``u_i`` (unit norm), or ``None``.
        right: ``(B, k, D_in)`` right singular vectors ``v_i`` (unit norm, flattened input), or ``None``.
            Signs are arbitrary but consistent: ``J v_i = σ_i u_i``.
        converged: every sample reached ``tol``.
        n_iter: iterations run (the largest over samples).
        residual: ``(B,)`` ``max_i ‖Jᵀu_i − σ_i v_i‖ / σ_1`` at the returned triplets.
        sample_converged: ``(B,)`` bool, per-sample convergence.
        rel_change: ``(B,)`` relative change of the top-k values at each sample's last iteration
            (``inf`` after a single iteration); compared with ``tol``.
        stats: cost accounting — ``n_jvp``/``n_vjp`` (directions pushed/pulled, summed over passes)
            and ``jvp_seconds``/``vjp_seconds`` (wall time inside the products).
    """

    values: torch.Tensor
    left: Optional[torch.Tensor]
    right: Optional[torch.Tensor]
    converged: bool
    n_iter: int
    residual: torch.Tensor
    sample_converged: torch.Tensor
    rel_change: Optional[torch.Tensor] = None
    stats: dict = field(default_factory=dict)


@dataclass
class EigenResult:
    """Dominant eigenpairs of each per-sample square Jacobian (see :func:`top_eigenvalues`).

    Attributes:
        values: ``(B, k)`` complex eigenvalues, by decreasing modulus (conjugate pairs: ``+Im`` first).
        vectors: ``(B, k, D)`` complex unit right eigenvectors (Ritz vectors), or ``None``.
        converged, n_iter, sample_converged, rel_change, stats: as in :class:`SpectralResult`.
        residual: ``(B,)`` ``max_i ‖J x_i − λ_i x_i‖ / |λ_1|``.
    """

    values: torch.Tensor
    vectors: Optional[torch.Tensor]
    converged: bool
    n_iter: int
    residual: torch.Tensor
    sample_converged: torch.Tensor
    rel_change: Optional[torch.Tensor] = None
    stats: dict = field(default_factory=dict)


def _orth(V: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the ``k`` rows of each ``(B, k, D)`` block (QR)."""
    Q, _ = torch.linalg.qr(V.transpose(1, 2))
    return Q.transpose(1, 2)


def _start(where: str, init, B: int, m: int, d: int, *, dtype, device, generator) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    V = torch.randn((B, m, d), generator=generator, device=gen_device, dtype=dtype).to(device)
    if init is not None:
        if not isinstance(init, torch.Tensor) or init.dim() != 3 or init.shape[0] != B or init.shape[2] != d \
                or init.shape[1] > m:
            got = tuple(init.shape) if isinstance(init, torch.Tensor) else type(init).__name__
            raise ValueError(f"{where}: init must have shape (B={B}, j<={m}, D={d}) (start vectors, flattened), "
                             f"got {got}.")
        V[:, : init.shape[1]] = init.to(device=device, dtype=dtype)
    return _orth(V)


def _validate(where, model, x, k, tol, max_iter, oversample, engine, generator, chunk_size):
    check_inputs(where, model, x)
    check_positive_int(where, "k", k)
    check_nonnegative_float(where, "tol", tol)
    check_positive_int(where, "max_iter", max_iter)
    check_positive_int(where, "oversample", oversample, minimum=0)
    check_engine(where, engine)
    check_generator(where, generator)
    if chunk_size is not None:
        check_positive_int(where, "chunk_size", chunk_size)


def _warn_not_converged(where: str, done: torch.Tensor, change: torch.Tensor, tol: float, max_iter: int) -> None:
    bad = int((~done).sum())
    warnings.warn(
        f"{where}: {bad} of {done.numel()} samples did not converge to tol={tol:g} in max_iter={max_iter} "
        f"iterations (largest relative change of the values at the last step: {float(change.max()):.3g}). "
        "Increase max_iter or oversample, or loosen tol; see the result's residual.",
        ConvergenceWarning, stacklevel=3)


def top_singular_values(model: Callable, x: torch.Tensor, k: int, *, tol: float = 1e-6, max_iter: int = 100,
                        oversample: int = 4, return_vectors: bool = True,
                        generator: Optional[torch.Generator] = None, engine: str = "clone",
                        chunk_size: Optional[int] = None, init: Optional[torch.Tensor] = None) -> SpectralResult:
    """Top-``k`` singular values (and vectors) of each per-sample Jacobian ``J_f(x_i)``.

    Block power (subspace) iteration on ``JᵀJ`` with Rayleigh–Ritz (module docstring): each
    iteration is ``m = min(k + oversample, D_in, D_out)`` JVPs — one clone pass of ``(m+1)·B``
    rows — and ``m`` VJPs on one recorded forward.

    ``J_f(x_i) = ∂f(x)[i] / ∂x[i]`` is the per-sample Jacobian: valid when the model treats samples
    independently (eval mode: no batch statistics, no dropout). A training-mode model with
    BatchNorm/dropout triggers a warning.

    Args:
        model: callable mapping ``(B, *in_shape)`` to a ``(B, *out_shape)`` tensor.
        x: the batch, ``(B, *in_shape)``, floating point. The float dtype sets the precision.
        k: number of singular values, ``1 <= k <= min(D_in, D_out)``.
        tol: stop when ``|σ_i^(t) − σ_i^(t−1)| <= tol · σ_i^(t)`` for all ``i <= k`` (per sample).
            ``tol=0`` runs exactly ``max_iter`` iterations (and warns): the way to time or compare
            a fixed amount of work.
        max_iter: iteration cap; reaching it unconverged raises a :class:`ConvergenceWarning`.
        oversample: extra block directions (faster convergence for clustered values).
        return_vectors: also return ``left``/``right`` vectors.
        generator: ``torch.Generator`` for the random start block.
        engine: ``"clone"`` (:func:`jvpreg.jvp`) or ``"torch.func"`` (reference).
        chunk_size: at most this many directions per JVP/VJP pass (memory cap); default all ``m``.
        init: optional start vectors ``(B, j, D_in)``, ``j <= m`` (e.g. a previous result's
            ``right``); the remaining directions are random.

    Returns:
        :class:`SpectralResult` with ``values (B, k)``, ``left (B, k, D_out)``,
        ``right (B, k, D_in)``, ``converged``, ``n_iter``, ``residual (B,)``.

    Raises:
        TypeError / ValueError: bad arguments (named in the message).

    Example::

        >>> unet = build_model("unet", in_channels=1, num_classes=None, image_size=64).eval()
        >>> res = top_singular_values(unet, torch.randn(2, 1, 64, 64), k=10, tol=1e-4)
        >>> res.values.shape, res.right.shape          # (2, 10), (2, 10, 4096)
    """
    where = "top_singular_values(model, x, k)"
    _validate(where, model, x, k, tol, max_iter, oversample, engine, generator, chunk_size)
    op = PerSampleJacobian(model, x, engine=engine, chunk_size=chunk_size, where=where)
    B, d_in, d_out = op.batch_size, op.d_in, op.d_out
    if k > min(d_in, d_out):
        raise ValueError(f"{where}: k={k} exceeds min(D_in, D_out) = min({d_in}, {d_out}); a per-sample Jacobian "
                         f"has at most {min(d_in, d_out)} singular values.")
    m = min(k + oversample, d_in, d_out)
    dtype, device = op.dtype, op.device
    V = _start(where, init, B, m, d_in, dtype=dtype, device=device, generator=generator)

    out = {"values": torch.zeros(B, k, dtype=dtype, device=device),
           "left": torch.zeros(B, k, d_out, dtype=dtype, device=device) if return_vectors else None,
           "right": torch.zeros(B, k, d_in, dtype=dtype, device=device) if return_vectors else None}
    eps = torch.finfo(dtype).eps

    def step(op, V, prev):
        Y = op.jvp(V)                                                    # (b, m, D_out)
        U, S, Wh = torch.linalg.svd(Y.transpose(1, 2), full_matrices=False)
        Ul = U.transpose(1, 2)                                           # (b, m, D_out)
        R = Wh @ V                                                       # (b, m, D_in), J R_i = S_i Ul_i
        Z = op.vjp(Ul)                                                   # (b, m, D_in) = Jᵀ Ul
        top = S[:, :k]
        scale = S[:, :1].clamp_min(torch.finfo(dtype).tiny)
        res = (Z[:, :k] - top.unsqueeze(-1) * R[:, :k]).norm(dim=-1).amax(dim=1) / scale[:, 0]
        if prev is None:
            ch = torch.full_like(top[:, 0], float("inf"))
        else:
            ch = ((top - prev).abs() / torch.maximum(top, eps * scale)).amax(dim=1)
        return top, res, ch, {"left": Ul[:, :k], "right": R[:, :k]}, Z

    it = _iterate(where, op, V, step, out, tol=tol, max_iter=max_iter)
    return SpectralResult(values=out["values"], left=out["left"], right=out["right"], converged=it.converged,
                          n_iter=it.n_iter, residual=it.residual, sample_converged=it.done, rel_change=it.change,
                          stats=it.stats)


@dataclass
class _Iteration:
    n_iter: int
    done: torch.Tensor
    residual: torch.Tensor
    change: torch.Tensor
    stats: dict

    @property
    def converged(self) -> bool:
        return bool(self.done.all())


def _iterate(where: str, op: PerSampleJacobian, V: torch.Tensor, step: Callable, out: dict, *, tol: float,
             max_iter: int) -> _Iteration:
    """The per-sample block iteration shared by both solvers: ``V <- orth(next)`` on the samples that have not
    converged (``rel. change <= tol``), which leave the operator's batch; their results stay in ``out``.

    ``step(op, V, prev) -> (top, residual, change, results, next)`` runs one iteration on the active samples
    (``prev``: their previous ``top``, ``None`` at first); ``results[name]`` goes to ``out[name][active]``.
    """
    B, dtype, device = op.batch_size, op.dtype, op.device
    residual = torch.full((B,), float("nan"), dtype=dtype, device=device)
    change = torch.full((B,), float("inf"), dtype=dtype, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    active = torch.arange(B, device=device)
    prev = None
    n_iter = 0
    for it in range(1, max_iter + 1):
        n_iter = it
        top, res, ch, results, nxt = step(op, V, prev)
        out["values"][active] = top
        residual[active] = res
        change[active] = ch
        for name, value in results.items():
            if out.get(name) is not None:
                out[name][active] = value
        conv = ch <= tol if tol > 0 else torch.zeros_like(ch, dtype=torch.bool)
        done[active[conv]] = True
        if bool(conv.all()):
            break
        keep = ~conv
        if it < max_iter:
            if not bool(keep.all()):
                active = active[keep]
                op = op.subset(keep.nonzero().squeeze(1))
            V = _orth(nxt[keep])
            prev = top[keep]
    if not bool(done.all()):
        _warn_not_converged(where, done, change[~done], tol, max_iter)
    return _Iteration(n_iter=n_iter, done=done, residual=residual, change=change, stats=dict(op.stats))


def _sort_eig(lam: torch.Tensor, S: torch.Tensor):
    """Sort eigenvalues by modulus (desc), conjugate pairs with ``+Im`` first; permute vectors alike."""
    o1 = torch.sort(-lam.imag, dim=-1, stable=True).indices
    lam, S = lam.gather(-1, o1), S.gather(-1, o1.unsqueeze(-2).expand_as(S))
    o2 = torch.sort(-lam.abs(), dim=-1, stable=True).indices
    return lam.gather(-1, o2), S.gather(-1, o2.unsqueeze(-2).expand_as(S))


def top_eigenvalues(model: Callable, x: torch.Tensor, k: int, *, tol: float = 1e-6, max_iter: int = 200,
                    oversample: int = 4, return_vectors: bool = True, generator: Optional[torch.Generator] = None,
                    engine: str = "clone", chunk_size: Optional[int] = None,
                    init: Optional[torch.Tensor] = None) -> EigenResult:
    """Dominant (largest-modulus) eigenvalues of each square per-sample Jacobian, from JVPs only.

    For autoencoders / image-to-image UNets (``D_out == D_in``). Orthogonal iteration
    ``V ← orth(J V)`` with a Schur–Rayleigh–Ritz step (``eig`` of ``Vᵀ J V``) at every iteration;
    one clone pass of ``(m+1)·B`` rows per iteration, no backward pass. See the module docstring for
    the method's limits (linear rate ``|λ_{m+1}|/|λ_i|``, complex pairs, non-normal ``J``). The
    per-sample caveat of :func:`top_singular_values` applies (eval mode).

    Args:
        model, x, k, tol, max_iter, oversample, return_vectors, generator, engine, chunk_size, init:
            as in :func:`top_singular_values`; the change between iterations is measured as
            ``max_i min_j |λ_i − λ_j'| / |λ_i|`` (robust to reordering of equal-modulus pairs).

    Returns:
        :class:`EigenResult` with complex ``values (B, k)`` and ``vectors (B, k, D)``.

    Raises:
        ValueError: the Jacobian is not square (``D_out != D_in``), or bad arguments.

    Example::

        >>> unet = build_model("unet", in_channels=1, num_classes=None, image_size=32, depth=2).eval()
        >>> res = top_eigenvalues(unet, torch.randn(1, 1, 32, 32), k=4, oversample=12, tol=1e-5)
        >>> res.values.abs()                         # moduli, decreasing
    """
    where = "top_eigenvalues(model, x, k)"
    _validate(where, model, x, k, tol, max_iter, oversample, engine, generator, chunk_size)
    op = PerSampleJacobian(model, x, engine=engine, chunk_size=chunk_size, where=where)
    B, d = op.batch_size, op.d_in
    if op.d_out != d:
        raise ValueError(f"{where}: eigenvalues need a square Jacobian, but D_out={op.d_out} "
                         f"(output {op.out_shape}) != D_in={d} (input {op.in_shape}); use top_singular_values.")
    if k > d:
        raise ValueError(f"{where}: k={k} exceeds the dimension D={d}.")
    m = min(k + oversample, d)
    dtype, device = op.dtype, op.device
    cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    V = _start(where, init, B, m, d, dtype=dtype, device=device, generator=generator)

    out = {"values": torch.zeros(B, k, dtype=cdtype, device=device),
           "vectors": torch.zeros(B, k, d, dtype=cdtype, device=device) if return_vectors else None}
    tiny = torch.finfo(dtype).tiny

    def step(op, V, prev):
        Y = op.jvp(V)                                                    # (b, m, D) rows J v_j
        H = V @ Y.transpose(1, 2)                                        # H[a, b] = v_a · J v_b
        lam, S = torch.linalg.eig(H)                                     # columns of S: eigvecs
        lam, S = _sort_eig(lam, S)
        St = S.transpose(1, 2)                                           # (b, m, m) rows = s_i
        X = St @ V.to(cdtype)                                            # Ritz vectors
        JX = St @ Y.to(cdtype)
        top = lam[:, :k]
        scale = top[:, :1].abs().clamp_min(tiny)
        res = (JX[:, :k] - top.unsqueeze(-1) * X[:, :k]).norm(dim=-1).amax(dim=1) / scale[:, 0]
        if prev is None:
            ch = torch.full_like(res, float("inf"))
        else:
            dist = (top.unsqueeze(-1) - prev.unsqueeze(-2)).abs().amin(dim=-1)
            ch = (dist / torch.maximum(top.abs(), torch.finfo(dtype).eps * scale)).amax(dim=1)
        return top, res, ch, {"vectors": X[:, :k]}, Y

    it = _iterate(where, op, V, step, out, tol=tol, max_iter=max_iter)
    return EigenResult(values=out["values"], vectors=out["vectors"], converged=it.converged, n_iter=it.n_iter,
                       residual=it.residual, sample_converged=it.done, rel_change=it.change, stats=it.stats)
