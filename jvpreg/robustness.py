"""Robustness and Jacobian evaluation of a trained classifier: noise, FGSM, PGD, transforms, ``||J||_F``.

Every function takes a classifier ``model: (B, C, H, W) -> (B, K)`` logits and an iterable of
``(x, y)`` batches with pixels in ``[0, 1]`` (the jvpreg datamodules' convention). The model is
evaluated in eval mode (its previous mode is restored afterwards), on the device of its parameters.

* ``noise``: accuracy on ``clamp(x + sigma * N(0, I), 0, 1)`` (one fixed noise draw, seeded).
* ``fgsm``: ``x + eps * sign(grad_x CE)`` (Goodfellow et al. 2015), clamped to ``[0, 1]``.
* ``pgd``: ``steps`` signed-gradient steps of size ``alpha`` (default ``2.5 eps / steps``) from a
  random start in the L∞ ball, projected on the ball and on ``[0, 1]`` (Madry et al. 2018).
* ``transforms``: accuracy on rotated / translated images (bilinear, zero fill).
* ``jacobian_frobenius``: per-sample ``||J_f(x_i)||_F`` of the logits w.r.t. the input, computed
  with :func:`jvpreg.jvp` (clone mode, several tangents per pass). ``method="exact"`` pushes the
  ``D = C H W`` basis vectors (exact up to float rounding); ``"hutchinson"`` averages
  ``||J u||²`` over ``n_projections`` Gaussian ``u`` (an unbiased estimate of ``||J||_F²``);
  ``"auto"`` is exact when ``D <= exact_max_dim``. Reported: ``jacobian_fro`` (mean over samples of
  ``||J||_F``) and ``jacobian_fro_sq`` (mean of ``||J||_F²``, the quantity Jacobian regularization
  penalizes).

:func:`evaluate_robustness` runs all of them and returns one flat dict of floats, e.g.
``{"clean_acc": .97, "noise_acc@0.1": .95, "fgsm_acc@0.05": .71, "pgd_acc@0.05": .6,
"jacobian_fro": 3.2, ...}``; :func:`format_table` renders it as Markdown.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "accuracy", "adversarial_accuracy", "evaluate_robustness", "fgsm", "format_table", "jacobian_frobenius",
    "noise_accuracy", "pgd", "transform_accuracy", "transform_images",
]

Batches = Iterable[Tuple[torch.Tensor, torch.Tensor]]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode, restoring each one's previous mode on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _batches(loader: Batches, model: nn.Module, max_samples: Optional[int]) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    device, seen = _device(model), 0
    for batch in loader:
        x, y = batch[0], batch[1]
        if max_samples is not None:
            if seen >= max_samples:
                return
            x, y = x[: max_samples - seen], y[: max_samples - seen]
        seen += len(y)
        yield x.to(device), y.to(device)


def _correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    with torch.no_grad():
        return int((model(x).argmax(dim=1) == y).sum())


def _acc_over(model: nn.Module, loader: Batches, make_input: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
              max_samples: Optional[int]) -> float:
    correct = total = 0
    with eval_mode(model), torch.inference_mode(False):
        for i, (x, y) in enumerate(_batches(loader, model, max_samples)):
            correct += _correct(model, make_input(x, y, i), y)
            total += len(y)
    if total == 0:
        raise ValueError("robustness: the loader yielded no samples")
    return correct / total


def accuracy(model: nn.Module, loader: Batches, *, max_samples: Optional[int] = None) -> float:
    """Clean accuracy of ``model`` on ``loader``.

    Example::

        >>> acc = accuracy(model, datamodule.test_dataloader())
    """
    return _acc_over(model, loader, lambda x, y, i: x, max_samples)


def noise_accuracy(model: nn.Module, loader: Batches, sigma: float, *, seed: int = 0,
                   max_samples: Optional[int] = None) -> float:
    """Accuracy on ``clamp(x + sigma * eps, 0, 1)``, ``eps ~ N(0, I)`` drawn from a generator seeded by ``seed``."""
    if sigma < 0:
        raise ValueError(f"noise_accuracy(...): expected sigma >= 0, got {sigma}.")
    g = torch.Generator().manual_seed(seed)

    def noisy(x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor:
        eps = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
        return (x + sigma * eps).clamp(0.0, 1.0)

    return _acc_over(model, loader, noisy, max_samples)


def _input_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        (g,) = torch.autograd.grad(loss, x)
    return g


def fgsm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """Fast gradient sign attack: ``clamp(x + eps * sign(grad_x CE(model(x), y)), 0, 1)``.

    Example::

        >>> x_adv = fgsm(model.eval(), x, y, eps=0.1)
    """
    if eps < 0:
        raise ValueError(f"fgsm(...): expected eps >= 0, got {eps}.")
    return (x + eps * _input_grad(model, x, y).sign()).clamp(0.0, 1.0).detach()


def pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, *, steps: int = 10,
        alpha: Optional[float] = None, random_start: bool = True, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """L∞ projected gradient descent attack (Madry et al. 2018) within ``eps`` of ``x`` and in ``[0, 1]``.

    Args:
        model: Classifier (use eval mode).
        x, y: Inputs and labels.
        eps: Radius of the L∞ ball.
        steps: Number of signed-gradient steps.
        alpha: Step size; default ``2.5 * eps / steps``.
        random_start: Start from a uniform point of the ball.
        generator: Generator of the random start (CPU).

    Returns:
        The adversarial inputs (detached).
    """
    if eps < 0 or steps < 1:
        raise ValueError(f"pgd(...): expected eps >= 0 and steps >= 1, got eps={eps}, steps={steps}.")
    alpha = 2.5 * eps / steps if alpha is None else alpha
    x0 = x.detach()
    adv = x0
    if random_start and eps > 0:
        noise = torch.rand(x0.shape, generator=generator).to(x0.device, x0.dtype)
        adv = (x0 + eps * (2 * noise - 1)).clamp(0.0, 1.0)
    for _ in range(steps):
        adv = adv + alpha * _input_grad(model, adv, y).sign()
        adv = torch.min(torch.max(adv, x0 - eps), x0 + eps).clamp(0.0, 1.0).detach()
    return adv


def adversarial_accuracy(model: nn.Module, loader: Batches, eps: float, *, attack: str = "fgsm", steps: int = 10,
                         alpha: Optional[float] = None, seed: int = 0, max_samples: Optional[int] = None) -> float:
    """Accuracy under an ``"fgsm"`` or ``"pgd"`` attack of radius ``eps`` (L∞, pixel units)."""
    if attack not in ("fgsm", "pgd"):
        raise ValueError(f"adversarial_accuracy(...): expected attack 'fgsm' or 'pgd', got {attack!r}.")
    g = torch.Generator().manual_seed(seed)

    def attacked(x: torch.Tensor, y: torch.Tensor, i: int) -> torch.Tensor:
        if attack == "fgsm":
            return fgsm(model, x, y, eps)
        return pgd(model, x, y, eps, steps=steps, alpha=alpha, generator=g)

    return _acc_over(model, loader, attacked, max_samples)


def transform_images(x: torch.Tensor, *, angle: float = 0.0, translate: Sequence[float] = (0.0, 0.0)) -> torch.Tensor:
    """Rotate ``(B, C, H, W)`` images by ``angle`` degrees about the center and translate them by
    ``(dx, dy)`` pixels (sub-pixel allowed; +dx: right, +dy: down), bilinear, zero fill.

    A positive angle turns +x towards +y, i.e. clockwise on screen (rows grow downwards).

    Implemented with ``affine_grid``/``grid_sample`` (align_corners=False), so it is differentiable
    and works for any size.
    """
    b, _, h, w = x.shape
    t = math.radians(angle)
    cos, sin = math.cos(t), math.sin(t)
    # output pixel p (normalized coords) samples the input at R^{-1}(p - d); aspect handled by scaling.
    ax, ay = w / 2.0, h / 2.0
    theta = torch.tensor([[cos, sin * ay / ax, -(cos * translate[0] / ax + sin * translate[1] / ax)],
                          [-sin * ax / ay, cos, -(-sin * translate[0] / ay + cos * translate[1] / ay)]],
                         dtype=x.dtype, device=x.device)
    grid = F.affine_grid(theta.expand(b, 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def transform_accuracy(model: nn.Module, loader: Batches, *, angle: float = 0.0,
                       translate: Sequence[float] = (0.0, 0.0), max_samples: Optional[int] = None) -> float:
    """Accuracy on images rotated by ``angle`` degrees and translated by ``translate`` pixels."""
    return _acc_over(model, loader, lambda x, y, i: transform_images(x, angle=angle, translate=translate), max_samples)


def jacobian_frobenius(model: nn.Module, loader: Batches, *, method: str = "auto", n_projections: int = 16,
                       exact_max_dim: int = 1024, max_samples: Optional[int] = 512, max_rows: int = 8192,
                       seed: int = 0) -> Dict[str, float]:
    """Per-sample Frobenius norm of the input-output Jacobian, by clone-mode JVPs (:func:`jvpreg.jvp`).

    Args:
        model: Classifier; evaluated in eval mode (per-sample Jacobians need independent samples).
        loader: Batches ``(x, y)``.
        method: ``"exact"``, ``"hutchinson"`` or ``"auto"`` (exact when ``C H W <= exact_max_dim``).
        n_projections: Gaussian directions per sample for ``"hutchinson"``.
        exact_max_dim: Threshold of ``"auto"``.
        max_samples: Use at most this many samples (``None``: all).
        max_rows: Largest clone batch (rows) per JVP pass; tangents are chunked to fit.
        seed: Seed of the Hutchinson directions.

    Returns:
        ``{"jacobian_fro": mean ||J||_F, "jacobian_fro_sq": mean ||J||_F², "jacobian_fro_exact": 1.0 or 0.0}``.

    Example::

        >>> jacobian_frobenius(model, dm.test_dataloader(), method="exact")["jacobian_fro"]
    """
    import jvpreg

    if method not in ("auto", "exact", "hutchinson"):
        raise ValueError(f"jacobian_frobenius(...): expected method 'auto', 'exact' or 'hutchinson', got {method!r}.")
    g = torch.Generator().manual_seed(seed)
    norms_sq: List[torch.Tensor] = []
    exact = None
    with eval_mode(model), torch.inference_mode(False), torch.no_grad():
        for x, _ in _batches(loader, model, max_samples):
            b, d = len(x), x[0].numel()
            if exact is None:
                exact = method == "exact" or (method == "auto" and d <= exact_max_dim)
            k_total = d if exact else n_projections
            chunk = max(1, min(k_total, max_rows // max(b, 1) - 1))
            acc = torch.zeros(b, dtype=torch.float64, device=x.device)
            for start in range(0, k_total, chunk):
                k = min(chunk, k_total - start)
                if exact:
                    u = torch.zeros(k, d, dtype=x.dtype, device=x.device)
                    u[torch.arange(k), torch.arange(start, start + k)] = 1.0
                    u = u.reshape(k, 1, *x.shape[1:]).expand(k, *x.shape).contiguous()
                else:
                    u = torch.randn((k, *x.shape), generator=g).to(x.device, x.dtype)
                _, ju = jvpreg.jvp(model, (x,), (u,), batched_tangents=True)
                acc += ju.double().flatten(2).pow(2).sum(dim=(0, 2))
            norms_sq.append(acc if exact else acc / k_total)
    if not norms_sq:
        raise ValueError("jacobian_frobenius(...): the loader yielded no samples")
    sq = torch.cat(norms_sq)
    return {"jacobian_fro": float(sq.sqrt().mean()), "jacobian_fro_sq": float(sq.mean()),
            "jacobian_fro_exact": float(bool(exact))}


def evaluate_robustness(model: nn.Module, loader: Batches, *, noise_sigmas: Sequence[float] = (0.1, 0.2, 0.3),
                        fgsm_eps: Sequence[float] = (0.05, 0.1), pgd_eps: Sequence[float] = (0.05,),
                        pgd_steps: int = 10, pgd_alpha: Optional[float] = None,
                        rotations: Sequence[float] = (), translations: Sequence[float] = (),
                        jacobian: Optional[str] = "auto", n_projections: int = 16, jacobian_max_samples: Optional[int] = 512,
                        max_samples: Optional[int] = None, seed: int = 0) -> Dict[str, float]:
    """Clean, noisy, adversarial and transformed accuracy and ``||J||_F`` in one flat dict.

    Args:
        model: Classifier (``nn.Module``); a LightningModule works too.
        loader: Batches ``(x, y)`` with pixels in ``[0, 1]``.
        noise_sigmas: Gaussian noise levels (``noise_acc@<sigma>``).
        fgsm_eps: FGSM radii (``fgsm_acc@<eps>``).
        pgd_eps: PGD radii (``pgd_acc@<eps>``), ``pgd_steps`` steps of size ``pgd_alpha``.
        rotations: Angles in degrees (``rot_acc@<angle>``); each is evaluated at ``+angle`` and
            ``-angle`` and averaged.
        translations: Shifts in pixels (``shift_acc@<t>``); the mean over the 4 shifts ``(±t, 0)``,
            ``(0, ±t)``.
        jacobian: ``None`` to skip, else the ``method`` of :func:`jacobian_frobenius`.
        n_projections, jacobian_max_samples: See :func:`jacobian_frobenius`.
        max_samples: Evaluate on at most this many samples (``None``: all).
        seed: Seed of the noise, PGD starts and Hutchinson directions.

    Returns:
        A dict of floats (keys as above plus ``clean_acc``, ``jacobian_fro``, ``jacobian_fro_sq``, ``n_samples``).

    Example::

        >>> metrics = evaluate_robustness(model, dm.test_dataloader(), noise_sigmas=[0.1, 0.3])
        >>> print(format_table(metrics))
    """
    loader = list(loader) if not isinstance(loader, (list, tuple)) else loader  # re-iterable, fixed order
    n = sum(len(b[1]) for b in loader)
    out: Dict[str, float] = {"n_samples": float(min(n, max_samples) if max_samples else n)}
    out["clean_acc"] = accuracy(model, loader, max_samples=max_samples)
    for s in noise_sigmas:
        out[f"noise_acc@{s:g}"] = noise_accuracy(model, loader, s, seed=seed, max_samples=max_samples)
    for e in fgsm_eps:
        out[f"fgsm_acc@{e:g}"] = adversarial_accuracy(model, loader, e, attack="fgsm", max_samples=max_samples)
    for e in pgd_eps:
        out[f"pgd_acc@{e:g}"] = adversarial_accuracy(model, loader, e, attack="pgd", steps=pgd_steps,
                                                     alpha=pgd_alpha, seed=seed, max_samples=max_samples)
    for a in rotations:
        accs = [transform_accuracy(model, loader, angle=s * a, max_samples=max_samples) for s in (1, -1)]
        out[f"rot_acc@{a:g}"] = sum(accs) / len(accs)
    for t in translations:
        shifts = ((t, 0.0), (-t, 0.0), (0.0, t), (0.0, -t))
        accs = [transform_accuracy(model, loader, translate=sh, max_samples=max_samples) for sh in shifts]
        out[f"shift_acc@{t:g}"] = sum(accs) / len(accs)
    if jacobian is not None:
        out.update(jacobian_frobenius(model, loader, method=jacobian, n_projections=n_projections,
                                      max_samples=jacobian_max_samples, seed=seed))
    return out


def format_table(metrics: Dict[str, float], *, title: str = "metric") -> str:
    """Render a flat metrics dict as a two-column Markdown table."""
    lines = [f"| {title} | value |", "|---|---|"]
    for key, value in metrics.items():
        text = f"{value:.4f}" if isinstance(value, float) and not float(value).is_integer() else f"{value:g}"
        lines.append(f"| {key} | {text} |")
    return "\n".join(lines)
