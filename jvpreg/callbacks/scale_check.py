"""A regularizer's first steps, checked: a penalty that is non-finite or dwarfs the task loss warns once.

A penalty summed over every output element of a dense model (a segmentation network's Jacobian
Frobenius norm over all pixels) can start at ``1e6`` against a task loss of ``1``; with a weight tuned
for a classifier the run diverges within a few steps. :class:`ScaleCheck` compares, on each of the
first :data:`CHECK_STEPS` regularized steps of a fit, the weighted penalty with the task loss (one host
read per checked step: none after), and warns with a :class:`PenaltyScaleWarning` before the optimizer
step uses the penalty when it is non-finite or more than :data:`RATIO` times the task loss, with a
scale that suits the output (``reduction="mean"`` for :class:`~jvpreg.losses.JacobianFrobenius`) and a
weight. After those steps a non-finite penalty is recorded in a device-side flag (no host read) that
is read once per training epoch and at the end of the fit. Each kind of warning is given once per
callback and fit.

It warns rather than raises: under fp16 AMP a non-finite step is skipped by the GradScaler and training
goes on, which an exception would break. ``warnings.simplefilter("error", PenaltyScaleWarning)`` turns the
warning into an exception raised inside ``training_step``, i.e. before the optimizer step.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

__all__ = ["CHECK_STEPS", "RATIO", "PenaltyScaleWarning", "ScaleCheck"]

#: Regularized steps of a fit whose penalty and task loss are read on the host and compared.
CHECK_STEPS = 3

#: A weighted penalty more than this many times the task loss warns.
RATIO = 100.0

#: The share of the task loss the suggested weight gives the penalty.
SUGGESTED_SHARE = 0.1


class PenaltyScaleWarning(UserWarning):
    """A JVP regularizer's penalty is non-finite, or outweighs the task loss by orders of magnitude."""


def _round(x: float) -> str:
    return f"{x:.1g}"


class ScaleCheck:
    """The check of one regularizer callback (see the module docstring); reset by :meth:`reset` at each fit.

    Args:
        steps: regularized steps checked on the host.
        ratio: weighted penalty / task loss above which it warns.

    Example::

        >>> check = ScaleCheck()
        >>> check.observe("JacobianRegularizer(weight=0.01)", penalty, 0.01, task_loss, step=0, output_size=4096,
        ...               reduction_hint="reduction='mean'")
    """

    def __init__(self, steps: int = CHECK_STEPS, ratio: float = RATIO):
        self.steps = steps
        self.ratio = ratio
        self.reset()

    def reset(self) -> None:
        """Start a fit: check the next ``steps`` regularized steps again, warn again."""
        self.checked = 0
        self.warned_scale = False
        self.warned_nonfinite = False
        self._nonfinite: Optional[torch.Tensor] = None
        self._who = ""
        self._hint: Optional[str] = None

    @property
    def checking(self) -> bool:
        """Whether the next call of :meth:`observe` reads values on the host."""
        return self.checked < self.steps

    def observe(self, who: str, penalty: torch.Tensor, weight: float, task_loss: Optional[torch.Tensor], *,
                step: int, output_size: Optional[int] = None, reduction_hint: Optional[str] = None) -> None:
        """Check one regularized step's (unweighted) ``penalty`` against ``task_loss``.

        Args:
            who: the callback as it should be named, e.g. ``"JacobianRegularizer(name='jacobian', weight=0.01)"``.
            penalty: the scalar penalty tensor of this step.
            weight: its weight at this step.
            task_loss: the loss ``training_step`` returned before the penalties (``None``: unknown).
            step: the optimizer step, for the message.
            output_size: output elements per sample that the penalty sums over, when it sums over them.
            reduction_hint: the argument that averages over them instead, e.g. ``"reduction='mean'"``.
        """
        self._who, self._hint = who, reduction_hint
        if not self.checking:
            if not self.warned_nonfinite:  # device-side: read in flush()
                bad = ~torch.isfinite(penalty.detach())
                self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad
            return
        self.checked += 1
        if task_loss is None:
            p, t = float(penalty.detach().float()), math.nan  # one host read
        else:
            p, t = torch.stack([penalty.detach().float(), task_loss.detach().float().reshape(())]).tolist()
        if not math.isfinite(p):
            self._warn_nonfinite(who, f"is {p} at step {step}" + ("" if math.isnan(t) else f" (task loss {t:.3g})"))
            return
        weighted = p * weight
        if self.warned_scale or not (math.isfinite(t) and t != 0.0) or weighted <= self.ratio * abs(t):
            return
        self.warned_scale = True
        target = SUGGESTED_SHARE * abs(t)
        advice = f"lower the weight to about {_round(target / p)}"
        if output_size and output_size > 1 and reduction_hint:
            advice = (f"the penalty sums over the {output_size} output elements of each sample: {reduction_hint} "
                      f"averages over them instead, and then a weight of about {_round(target * output_size / p)} "
                      f"gives it {SUGGESTED_SHARE:g}x the task loss; or {advice}")
        else:
            advice = f"{advice} (it then gives the penalty {SUGGESTED_SHARE:g}x the task loss)"
        warnings.warn(PenaltyScaleWarning(
            f"{who}: at step {step} the penalty is {p:.3g} against a task loss of {t:.3g}: weighted "
            f"({weighted:.3g}) it is {weighted / abs(t):.3g}x the task loss (more than {self.ratio:g}x), so its "
            f"gradients dominate and training may diverge. Fix: {advice}."), stacklevel=2)

    def flush(self) -> None:
        """Read the device-side non-finite flag (one host read) and warn if it was set since the last read."""
        flag, self._nonfinite = self._nonfinite, None
        if flag is not None and not self.warned_nonfinite and bool(flag):
            self._warn_nonfinite(self._who, f"became non-finite after the first {self.steps} steps")

    def _warn_nonfinite(self, who: str, what: str) -> None:
        if self.warned_nonfinite:
            return
        self.warned_nonfinite = True
        warnings.warn(PenaltyScaleWarning(
            f"{who}: the penalty {what}, so the loss the optimizer steps on is non-finite and the weights will "
            "become NaN (under fp16 AMP the GradScaler skips such steps). Fix: a penalty that grew to inf: lower "
            "the weight or the learning rate, or clip gradients (Trainer(gradient_clip_val=...))"
            + (f", or average it over the output ({self._hint})" if self._hint else "")
            + "; a nan from the first step: look for an operation whose derivative is infinite at its input "
              "(sqrt or x ** p with p < 1 at 0). To stop the run instead: "
              "warnings.simplefilter('error', PenaltyScaleWarning)."), stacklevel=3)
