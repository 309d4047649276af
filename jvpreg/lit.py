"""The LightningModule trained by ``jvpreg-train``: a plain image classifier, and a metrics recorder.

:class:`ImageClassifier` knows nothing about JVP penalties: the regularizers are Lightning callbacks
(:mod:`jvpreg.callbacks`) that hook the forward of its ``net`` inside ``training_step`` and add
their penalty to the loss it returns, so the same callbacks attach to any other LightningModule.

Logged metrics: ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``, ``val/acc_best`` (best
``val/acc`` so far, the default metric of sweeps and checkpointing), ``test/loss``, ``test/acc``.
Validation and test metrics are synchronized across processes (``sync_dist=True``).

Implementation choices: the optimizer and the optional scheduler are given as factories
(``functools.partial`` or a Hydra ``_partial_: true`` config) taking the parameters / the optimizer;
the composed run configuration (``run_config``, a plain dict) is stored in every checkpoint under
``"jvpreg_config"`` so that ``jvpreg-eval`` can rebuild the network and the data without the
original command line.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from pytorch_lightning import Callback, LightningModule
from torch import nn

from .callbacks.strategies import destroy_process_group_at_exit, fully_shard_blocks, is_fully_sharded

__all__ = ["ImageClassifier", "MetricsHistory"]

CONFIG_KEY = "jvpreg_config"


class ImageClassifier(LightningModule):
    """Cross-entropy training of ``net`` on ``(x, y)`` batches.

    Args:
        net: The network, ``(B, C, H, W) -> (B, num_classes)`` logits.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``; default Adam with lr 1e-3.
        scheduler: Optional ``scheduler(optimizer) -> LRScheduler`` (stepped every epoch).
        label_smoothing: Cross-entropy label smoothing in ``[0, 1)``.
        run_config: Plain-dict run configuration stored in checkpoints (see the module docstring).

    Raises:
        TypeError: ``net`` is not an ``nn.Module`` or a factory is not callable.
        ValueError: ``label_smoothing`` outside ``[0, 1)``.

    Example::

        >>> lit = ImageClassifier(build_model("small_cnn", in_channels=1, num_classes=10, image_size=8))
        >>> Trainer(max_epochs=5, callbacks=[JacobianRegularizer(weight=0.01, module="net")]).fit(lit, dm)
    """

    def __init__(self, net: nn.Module, optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
                 scheduler: Optional[Callable[..., Any]] = None, *, label_smoothing: float = 0.0,
                 run_config: Optional[Dict[str, Any]] = None):
        super().__init__()
        where = "ImageClassifier(...)"
        if not isinstance(net, nn.Module):
            raise TypeError(f"{where}: expected net to be an nn.Module, got {type(net).__name__}.")
        for name, f in (("optimizer", optimizer), ("scheduler", scheduler)):
            if f is not None and not callable(f):
                raise TypeError(f"{where}: expected {name} to be None or a callable factory "
                                f"(e.g. functools.partial(torch.optim.Adam, lr=1e-3)), got {type(f).__name__}.")
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"{where}: expected label_smoothing in [0, 1), got {label_smoothing!r}.")
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.label_smoothing = float(label_smoothing)
        self.run_config = run_config
        self.best_val_acc = -math.inf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of ``net(x)``."""
        return self.net(x)

    # -- steps ------------------------------------------------------------------------------
    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch[0], batch[1]
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing if stage == "train" else 0.0)
        acc = (logits.argmax(dim=1) == y).float().mean()
        sync = stage != "train"
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=stage != "test",
                 sync_dist=sync, batch_size=len(y))
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=stage != "train", sync_dist=sync,
                 batch_size=len(y))
        return loss

    def setup(self, stage: str) -> None:
        destroy_process_group_at_exit()  # a spawned DDP worker otherwise tears gloo down with the interpreter

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        acc = self.trainer.callback_metrics.get("val/acc")
        if acc is not None:
            self.best_val_acc = max(self.best_val_acc, float(acc))
            self.log("val/acc_best", self.best_val_acc, prog_bar=True, sync_dist=False)

    # -- sharding ---------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (``trainer=fsdp``): FSDP2 over the data-parallel mesh, one group
        per child block of ``net`` (:func:`jvpreg.callbacks.strategies.fully_shard_blocks`). Else nothing."""
        mesh = getattr(self, "_device_mesh", None)  # set by ModelParallelStrategy only
        if mesh is None or is_fully_sharded(self.net):  # configure_model runs again for test/validate
            return

        fully_shard_blocks(self.net, mesh["data_parallel"])

    # -- optimization -----------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        factory = self.optimizer_factory or (lambda params: torch.optim.Adam(params, lr=1e-3))
        optimizer = factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer),
                                                          "interval": "epoch"}}

    # -- checkpoints ------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["jvpreg_best_val_acc"] = self.best_val_acc
        if self.run_config is not None:
            checkpoint[CONFIG_KEY] = self.run_config

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.best_val_acc = checkpoint.get("jvpreg_best_val_acc", -math.inf)
        if self.run_config is None:  # keep the current run's config when resuming with new overrides
            self.run_config = checkpoint.get(CONFIG_KEY)


class MetricsHistory(Callback):
    """Keeps every epoch's scalar metrics in memory (``history``: a list of dicts), for plots.

    Independent of the loggers (works with ``logger=none``). Records ``trainer.callback_metrics``
    at the end of each training epoch (after that epoch's validation), plus ``epoch``.
    """

    def __init__(self) -> None:
        self.history: List[Dict[str, float]] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: LightningModule) -> None:
        row = {"epoch": float(trainer.current_epoch)}
        for key, value in trainer.callback_metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                row[key] = float(value)
            elif isinstance(value, (int, float)):
                row[key] = float(value)
        self.history.append(row)

    def state_dict(self) -> Dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # Only when resuming (empty history): `trainer.test(ckpt_path="best")` also restores callback
        # states, and must not roll the history of this run back to the best epoch.
        if not self.history:
            self.history = list(state_dict.get("history", []))
