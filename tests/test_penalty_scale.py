"""PenaltyScaleWarning: a regularizer warns once, before the optimizer step, when its penalty is non-finite or
dwarfs the task loss in the first steps (jvpreg.callbacks.scale_check), and JacobianFrobenius(reduction="mean")."""
from __future__ import annotations

import logging
import math
import os
import warnings

os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from jvpreg.callbacks import JacobianRegularizer, JVPRegularizer, PenaltyScaleWarning
from jvpreg.callbacks.scale_check import CHECK_STEPS, ScaleCheck
from jvpreg.losses import JacobianFrobenius

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class Segmenter(pl.LightningModule):
    """Per-pixel classification (a dense output of 4 x 8 x 8 = 256 elements per sample); records its task losses."""

    def __init__(self, net: nn.Module, lr: float = 0.01, nan_at_step: int | None = None):
        super().__init__()
        self.net, self.lr, self.nan_at_step = net, lr, nan_at_step
        self.task_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == self.nan_at_step:
            with torch.no_grad():
                self.net[0].weight[0, 0, 0, 0] = math.nan
        out = self.net(x)
        loss = F.cross_entropy(out, y)  # per pixel for a dense output
        self.task_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dense_net(scale=1.0):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 4, 3, padding=1))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(scale)
    return net


def classifier():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))


def loader(dense=True, n=16, batch=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 4, (n, 8, 8), generator=g) if dense else torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def fit(lit, callbacks, max_steps=1, dense=True):
    trainer = pl.Trainer(callbacks=list(callbacks), accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=max_steps,
                         num_sanity_val_steps=0)
    trainer.fit(lit, loader(dense))
    return trainer


def scale_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, PenaltyScaleWarning)]


def test_dense_output_warns_once_with_the_numbers_and_the_mean_reduction():
    lit = Segmenter(dense_net(scale=3.0))
    reg = JacobianRegularizer(weight=1.0, module="net", seed=0)
    penalties, record_penalty = [], reg._record
    reg._record = lambda module, value, *args: (penalties.append(value.item()), record_penalty(module, value, *args))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(lit, [reg], max_steps=2 * CHECK_STEPS)
    msgs = scale_warnings(record)
    assert len(msgs) == 1, msgs  # once, not on every checked step
    p, t = penalties[0], lit.task_losses[0].item()  # step 0: the penalty the callback added, the module's task loss
    assert p > 100 * t
    assert msgs[0] == (
        f"JacobianRegularizer(name='jacobian_frobenius', weight=1): at step 0 the penalty is {p:.3g} against a "
        f"task loss of {t:.3g}: weighted ({p:.3g}) it is {p / t:.3g}x the task loss (more than 100x), "
        "so its gradients dominate and training may diverge. Fix: the penalty sums over the 256 output elements of "
        "each sample: JacobianRegularizer(..., reduction='mean') averages over them instead, and then a weight of "
        f"about {0.1 * t * 256 / p:.1g} gives it 0.1x the task loss; or lower the weight to about {0.1 * t / p:.1g}.")


def test_the_suggested_mean_reduction_and_weight_do_not_warn():
    lit = Segmenter(dense_net(scale=3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PenaltyScaleWarning)
        fit(lit, [JacobianRegularizer(weight=1.0, module="net", seed=0, reduction="mean")], max_steps=CHECK_STEPS)


def test_a_classifier_with_a_usual_weight_does_not_warn():
    lit = Segmenter(classifier())
    with warnings.catch_warnings():
        warnings.simplefilter("error", PenaltyScaleWarning)
        fit(lit, [JacobianRegularizer(weight=0.01, module="net", seed=0)], max_steps=2 * CHECK_STEPS, dense=False)


class SqrtNet(nn.Module):
    """Finite output, NaN Jacobian-vector product: d sqrt(r)/dr is infinite where relu(r) = 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        return torch.sqrt(torch.relu(self.conv(x)))


NAN_AT_STEP_0 = (r"JacobianRegularizer\(name='jacobian_frobenius', weight=0\.01\): the penalty is nan at step 0 "
                 r"\(task loss [\d.]+\), so the loss the optimizer steps on is non-finite[\s\S]*reduction='mean'"
                 r"[\s\S]*sqrt")


def test_a_nan_penalty_warns_before_the_optimizer_step_uses_it():
    lit = Segmenter(SqrtNet())
    before = [p.detach().clone() for p in lit.parameters()]
    reg = JacobianRegularizer(weight=0.01, module="net", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PenaltyScaleWarning)  # raised inside training_step: no optimizer step ran
        with pytest.raises(PenaltyScaleWarning, match=NAN_AT_STEP_0):
            fit(lit, [reg])
    assert math.isfinite(lit.task_losses[0].item())
    assert all(torch.equal(a, b) for a, b in zip(before, lit.parameters()))


def test_a_penalty_that_becomes_nan_later_is_reported_at_the_epoch_end():
    lit = Segmenter(dense_net(), nan_at_step=CHECK_STEPS + 1)
    reg = JVPRegularizer(JacobianFrobenius(seed=0, reduction="mean"), weight=0.01, module="net")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(lit, [reg], max_steps=CHECK_STEPS + 2)
    msgs = scale_warnings(record)
    assert len(msgs) == 1 and msgs[0].startswith("JVPRegularizer(name='jacobian_frobenius', weight=0.01): the penalty "
                                                 f"became non-finite after the first {CHECK_STEPS} steps"), msgs
    assert "average the penalty" not in msgs[0]  # already averaged: no reduction hint


def test_after_the_checked_steps_nothing_is_read_on_the_host():
    check = ScaleCheck()
    check.checked = CHECK_STEPS
    meta = torch.tensor(1.0, device="meta")
    check.observe("X", meta, 1.0, meta, step=5)  # a value read raises on meta
    assert check._nonfinite is not None and check._nonfinite.device.type == "meta"


def test_mean_reduction_divides_by_the_output_elements_per_sample():
    jvp = torch.randn(2, 3, 4, 5, 5, dtype=torch.float64)
    total = JacobianFrobenius().penalty(jvp, None)
    mean = JacobianFrobenius(reduction="mean").penalty(jvp, None)
    torch.testing.assert_close(mean, total / 100)
    torch.testing.assert_close(total, jvp.pow(2).sum() / 6)
    with pytest.raises(ValueError, match=r"reduction"):
        JacobianFrobenius(reduction="avg")


def test_reduction_keeps_the_state_key_of_existing_configurations():
    assert JacobianRegularizer(0.01).state_key == JacobianRegularizer(0.01, reduction="sum").state_key
    assert JacobianRegularizer(0.01).state_key != JacobianRegularizer(0.01, reduction="mean").state_key
