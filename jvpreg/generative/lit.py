"""``MeanFlowModule``: a LightningModule training ``u(z, r, t, y)`` with :class:`jvpreg.losses.MeanFlowLoss`.

Data ``x`` in ``[0, 1]`` (the digits datamodule) is mapped to ``[-1, 1]`` for the flow and back for samples.
Logged: ``train/loss`` (adaptive-weighted), ``train/mse`` (``mean ||Δ||²``), ``val/loss``, ``val/mse`` (the
validation loss draws its times and noise from a generator reset every epoch, so epochs are comparable).
Implementation choice: an exponential moving average of the weights (``ema_decay``; 0 disables it) is kept in
``ema`` and used for sampling, as generative models usually are.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from pytorch_lightning import LightningModule
from torch import nn

from ..losses.meanflow import MeanFlowLoss
from .sample import sample

__all__ = ["MeanFlowModule"]


class MeanFlowModule(LightningModule):
    """Mean-flow training of ``net`` on ``(x, y)`` batches.

    Args:
        net: ``u(z, r, t, y=None)``.
        loss: the :class:`MeanFlowLoss` (default: ``MeanFlowLoss()``).
        optimizer: ``optimizer(params) -> Optimizer`` (default AdamW, lr 1e-3).
        ema_decay: decay of the weights' moving average in ``[0, 1)`` (0: none).
        conditional: pass the labels to the model.

    Example::

        >>> lit = MeanFlowModule(DiT(1, 8), MeanFlowLoss(label_dropout=0.1))
        >>> Trainer(max_epochs=100).fit(lit, DigitsDataModule())
        >>> x = lit.sample(torch.randn(10, 1, 8, 8), steps=1, labels=torch.arange(10))
    """

    def __init__(self, net: nn.Module, loss: Optional[MeanFlowLoss] = None,
                 optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None, *, ema_decay: float = 0.999,
                 conditional: bool = True, run_config: Optional[dict] = None) -> None:
        super().__init__()
        where = "MeanFlowModule(...)"
        if not isinstance(net, nn.Module):
            raise TypeError(f"{where}: expected net to be an nn.Module, got {type(net).__name__}.")
        if loss is not None and not isinstance(loss, MeanFlowLoss):
            raise TypeError(f"{where}: expected loss to be a MeanFlowLoss, got {type(loss).__name__}.")
        if not isinstance(ema_decay, (int, float)) or not 0.0 <= float(ema_decay) < 1.0:
            raise ValueError(f"{where}: expected ema_decay in [0, 1), got {ema_decay!r}.")
        self.net = net
        self.loss_fn = loss if loss is not None else MeanFlowLoss()
        self.val_loss_fn = copy.deepcopy(self.loss_fn)
        self.val_loss_fn.seed = 0
        self.val_loss_fn.label_dropout = 0.0
        self.optimizer_factory = optimizer
        self.ema_decay = float(ema_decay)
        self.ema = copy.deepcopy(net).requires_grad_(False) if self.ema_decay else None
        self.conditional = bool(conditional)
        self.run_config = run_config

    def _loss(self, batch: Any, fn: MeanFlowLoss):
        x, y = batch[0] * 2 - 1, batch[1]
        return fn(self.net, x, y if self.conditional else None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self._loss(batch, self.loss_fn)
        n = len(batch[0])
        self.log("train/loss", out.loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=n)
        self.log("train/mse", out.mse, on_step=False, on_epoch=True, batch_size=n)
        return out.loss

    def on_validation_epoch_start(self) -> None:
        self.val_loss_fn._generator = None  # the same times and noise every epoch

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        with torch.enable_grad():  # the clone engine and the references need autograd on
            out = self._loss(batch, self.val_loss_fn)
        n = len(batch[0])
        self.log("val/loss", out.loss.detach(), on_epoch=True, prog_bar=True, batch_size=n)
        self.log("val/mse", out.mse, on_epoch=True, batch_size=n)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is None:
            return
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.net.parameters()):
                e.lerp_(p, 1.0 - self.ema_decay)
            for e, b in zip(self.ema.buffers(), self.net.buffers()):
                e.copy_(b)

    def sampler(self) -> nn.Module:
        """The network samples come from: the moving average, else ``net``."""
        return self.ema if self.ema is not None else self.net

    def sample(self, noise: torch.Tensor, steps: int = 1, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Images in ``[0, 1]`` (clamped) from ``noise`` in ``steps`` jumps (:func:`jvpreg.generative.sample`)."""
        net = self.sampler()
        was = net.training
        net.eval()
        try:
            z = sample(net, noise, steps, labels if self.conditional else None, time_order=self.loss_fn.time_order,
                       label_key=self.loss_fn.label_key)
        finally:
            net.train(was)
        return ((z + 1) / 2).clamp(0, 1)

    def configure_optimizers(self) -> Any:
        factory = self.optimizer_factory or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        return factory(self.net.parameters())

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.run_config is not None:
            checkpoint["jvpreg_config"] = self.run_config
