"""``JacobianMonitor``: log the input-output Jacobian's spectrum and Frobenius norm during training.

Every ``every_n_epochs`` validation epochs, on one fixed batch (the first batch of the first
validation dataloader, cached the first time it is seen, or a tensor given by the user), the
callback computes per-sample

* the top-``k`` singular values (:func:`jvpreg.analysis.top_singular_values`: block power
  iteration with clone JVPs + batched VJPs, warm-started from the previous call's vectors), and
* a Hutchinson / Hutch++ estimate of ``‖J‖_F`` with its standard error
  (:func:`jvpreg.analysis.frobenius_norm`),

and logs their means over the batch with ``pl_module.log``:

``jacobian/sigma_1 … jacobian/sigma_k``, ``jacobian/cond_k`` (mean of ``σ_1/σ_k``),
``jacobian/fro`` (mean ``‖J‖_F``), ``jacobian/fro_stderr`` (standard error of that mean,
``sqrt(Σ se_i²)/B``), ``jacobian/residual`` (largest Ritz residual) and ``jacobian/converged``.

A spectrum plot (matplotlib, Agg canvas, no pyplot state) is written to
``<plot_dir or trainer.log_dir or default_root_dir>/jacobian_spectrum_epoch<NNN>.png`` on global
rank zero and, for every ``WandbLogger`` among the trainer's loggers, logged as the image
``jacobian/spectrum`` (wandb is only imported there, by the logger).

Implementation choices: the computation runs in eval mode (per-sample Jacobians need samples to
be independent; every submodule's previous mode is restored), outside Lightning's inference mode
and with grad enabled (the VJPs need a graph); parameters' ``.grad`` are never touched. At most
``max_samples`` rows of the batch are used. The random start/query vectors come from a generator
seeded with ``seed`` + the number of computations so far, so a resumed run draws the same ones.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Dict, Optional, Union

import torch
from pytorch_lightning import Callback

from jvpreg.analysis import ENGINES, METHODS, frobenius_norm, top_singular_values
from jvpreg.losses.base import select_output

from .strategies import check_monitor_strategy, destroy_process_group_at_exit

__all__ = ["JacobianMonitor"]

_INPUT_KEYS = ("x", "input", "inputs", "image", "images", "data")


def _default_input(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    if isinstance(batch, dict):
        for key in _INPUT_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
    raise TypeError(
        f"JacobianMonitor: cannot find the model input in a validation batch of type {type(batch).__name__} "
        f"(looked for a tensor, the first element of a tuple/list, or one of the keys {_INPUT_KEYS}). "
        "Pass input_fn=lambda batch: ... to JacobianMonitor.")


class JacobianMonitor(Callback):
    """Log top-k singular values and the Frobenius norm of the model's input Jacobian.

    Args:
        k: number of singular values to track (default 5).
        every_n_epochs: compute at every n-th validation epoch (sanity checks excluded; default 1).
        n_samples: query vectors of the Frobenius estimator (``>= 2``; ``>= 4`` for Hutch++; default 32).
        fro_method: ``"hutchinson"`` (default) or ``"hutch++"``.
        max_samples: use at most this many rows of the batch (default 8; ``None``: all).
        batch: optional fixed input tensor ``(B, *in_shape)``; default: the first batch of the first
            validation dataloader (cached). Never modified.
        input_fn: ``batch -> input tensor`` for validation batches that are not a tensor, a
            ``(x, y)`` tuple/list or a dict with one of the keys ``x, input, inputs, image, images, data``.
        forward_fn: ``(pl_module, x) -> output`` (default ``pl_module(x)``), e.g. to call a submodule.
        output_key: the tensor of the output to analyse when it is a tuple, dict or object: an index,
            a key or an attribute name (``"logits"`` of a Hugging Face ``ModelOutput``), as in the
            regularizers.
        tol, max_iter, oversample: passed to :func:`~jvpreg.analysis.top_singular_values`
            (defaults ``1e-4``, ``50``, ``4``).
        engine: ``"clone"`` (default) or ``"torch.func"``.
        plot: write the spectrum PNG (and log it to W&B loggers) (default True).
        plot_dir: directory for the PNGs (default ``trainer.log_dir``, else ``trainer.default_root_dir``).
        seed: seed of the random start / query vectors (default 0).

    Raises:
        TypeError / ValueError: at construction, for any invalid argument (the message names it).

    Example::

        >>> from jvpreg.callbacks.monitor import JacobianMonitor
        >>> trainer = pl.Trainer(max_epochs=5, callbacks=[JacobianMonitor(k=5, every_n_epochs=1)])
        >>> trainer.fit(model, datamodule=dm)        # logs jacobian/sigma_1 ... jacobian/fro
    """

    def __init__(self, k: int = 5, every_n_epochs: int = 1, *, n_samples: int = 32, fro_method: str = "hutchinson",
                 max_samples: Optional[int] = 8, batch: Optional[torch.Tensor] = None,
                 input_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                 forward_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
                 output_key: Union[int, str, None] = None, tol: float = 1e-4,
                 max_iter: int = 50, oversample: int = 4, engine: str = "clone", plot: bool = True,
                 plot_dir: Optional[str | os.PathLike] = None, seed: int = 0) -> None:
        super().__init__()
        self.k = self._int("k", k, 1)
        self.every_n_epochs = self._int("every_n_epochs", every_n_epochs, 1)
        self.n_samples = self._int("n_samples", n_samples, 2)
        if fro_method not in METHODS:
            raise ValueError(f"JacobianMonitor(fro_method=...): expected one of {METHODS}, got {fro_method!r}.")
        if fro_method == "hutch++" and n_samples < 4:
            raise ValueError(f"JacobianMonitor(n_samples=...): fro_method='hutch++' needs n_samples >= 4, "
                             f"got {n_samples}.")
        self.fro_method = fro_method
        self.max_samples = None if max_samples is None else self._int("max_samples", max_samples, 1)
        if batch is not None:
            if not isinstance(batch, torch.Tensor) or batch.dim() < 1 or batch.shape[0] < 1 \
                    or not batch.is_floating_point():
                got = (f"a {batch.dtype} tensor of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor)
                       else type(batch).__name__)
                raise TypeError(f"JacobianMonitor(batch=...): expected a floating-point tensor of shape "
                                f"(B, *in_shape) with B >= 1, got {got}.")
        self.batch = batch
        for name, fn in (("input_fn", input_fn), ("forward_fn", forward_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"JacobianMonitor({name}=...): expected a callable or None, got {type(fn).__name__}.")
        self.input_fn = input_fn
        self.forward_fn = forward_fn
        if output_key is not None and (isinstance(output_key, bool) or not isinstance(output_key, (int, str))):
            raise TypeError(f"JacobianMonitor(output_key=...): expected None, an int (index) or a str (key or "
                            f"attribute of the output, e.g. 'logits'), got {output_key!r}.")
        self.output_key = output_key
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0 <= tol < math.inf):
            raise ValueError(f"JacobianMonitor(tol=...): expected a finite number >= 0, got {tol!r}.")
        self.tol = float(tol)
        self.max_iter = self._int("max_iter", max_iter, 1)
        self.oversample = self._int("oversample", oversample, 0)
        if engine not in ENGINES:
            raise ValueError(f"JacobianMonitor(engine=...): expected one of {ENGINES}, got {engine!r}.")
        self.engine = engine
        if not isinstance(plot, bool):
            raise TypeError(f"JacobianMonitor(plot=...): expected a bool, got {type(plot).__name__}.")
        self.plot = plot
        if plot_dir is not None and not isinstance(plot_dir, (str, os.PathLike)):
            raise TypeError(f"JacobianMonitor(plot_dir=...): expected a path or None, got {type(plot_dir).__name__}.")
        self.plot_dir = None if plot_dir is None else os.fspath(plot_dir)
        self.seed = self._int("seed", seed, 0)

        self._cached: Optional[torch.Tensor] = None
        self._batch_index: Optional[int] = None
        self._val_epochs = 0
        self._n_computed = 0
        self._last_epoch = -1
        self._warm: Optional[torch.Tensor] = None
        self.last_metrics: Dict[str, float] = {}
        self.last_plot_path: Optional[str] = None

    @staticmethod
    def _int(name: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"JacobianMonitor({name}=...): expected an int >= {minimum}, got {value!r}.")
        return value

    @property
    def state_key(self) -> str:
        return self._generate_state_key(k=self.k, every_n_epochs=self.every_n_epochs, fro_method=self.fro_method)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer, pl_module, stage: str) -> None:
        check_monitor_strategy(trainer.strategy, "JacobianMonitor")
        destroy_process_group_at_exit()
        if stage == "fit" and self.batch is None and not trainer.limit_val_batches:
            warnings.warn("JacobianMonitor: validation is disabled (limit_val_batches=0), so the monitor never "
                          "runs. Enable validation or run it on your own batch with JacobianMonitor(batch=...) "
                          "and a validation loop.", UserWarning, stacklevel=2)

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self.batch is not None or self._cached is not None or trainer.sanity_checking:
            return
        if dataloader_idx != 0 or batch_idx != 0:
            return
        x = (self.input_fn or _default_input)(batch)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
            raise TypeError(f"JacobianMonitor: the model input taken from the validation batch must be a "
                            f"floating-point tensor (B, *in_shape), got "
                            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else (x.dtype, tuple(x.shape))}.")
        if self.max_samples is not None:
            x = x[: self.max_samples]
        with torch.inference_mode(False):
            self._cached = x.detach().clone()  # a normal (non-inference) tensor, usable by autograd
        self._batch_index = batch_idx

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._val_epochs += 1
        if self._val_epochs % self.every_n_epochs:
            return
        x = self._input()
        if x is None:
            return
        metrics, values = self._compute(pl_module, x.to(pl_module.device))
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=True)
        self.last_metrics = metrics
        self._last_epoch = trainer.current_epoch
        self._n_computed += 1
        if self.plot and trainer.is_global_zero:
            self.last_plot_path = self._save_plot(trainer, values)
            self._log_image(trainer, self.last_plot_path)

    # ------------------------------------------------------------------ work
    def _input(self) -> Optional[torch.Tensor]:
        if self.batch is not None:
            x = self.batch if self.max_samples is None else self.batch[: self.max_samples]
            with torch.inference_mode(False):
                return x.detach().clone()
        return self._cached

    def _compute(self, pl_module, x: torch.Tensor):
        forward_fn = self.forward_fn

        def model(z: torch.Tensor) -> torch.Tensor:
            out = forward_fn(pl_module, z) if forward_fn is not None else pl_module(z)
            return out if self.output_key is None else select_output(out, self.output_key, "JacobianMonitor")

        modes = {m: m.training for m in pl_module.modules()}
        pl_module.eval()
        gen = torch.Generator(device=x.device).manual_seed(self.seed + self._n_computed)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                init = self._warm if self._warm is not None and self._warm.shape[0] == x.shape[0] else None
                res = top_singular_values(model, x, self.k, tol=self.tol, max_iter=self.max_iter,
                                          oversample=self.oversample, generator=gen, engine=self.engine,
                                          init=init)
                fro = frobenius_norm(model, x, n_samples=self.n_samples, method=self.fro_method, generator=gen,
                                     engine=self.engine)
        finally:
            for m, mode in modes.items():
                m.training = mode
        self._warm = res.right.detach() if res.right is not None else None
        values = res.values.detach().double().cpu()
        B = values.shape[0]
        metrics = {f"jacobian/sigma_{i + 1}": float(values[:, i].mean()) for i in range(self.k)}
        tiny = torch.finfo(torch.float64).tiny
        metrics["jacobian/cond_k"] = float((values[:, 0] / values[:, -1].clamp_min(tiny)).mean())
        metrics["jacobian/fro"] = float(fro.value.double().mean())
        metrics["jacobian/fro_stderr"] = float(fro.stderr.double().pow(2).sum().sqrt() / B)
        metrics["jacobian/residual"] = float(res.residual.double().max())
        metrics["jacobian/converged"] = float(res.converged)
        return metrics, values

    def _plot_dir(self, trainer) -> str:
        return self.plot_dir or trainer.log_dir or trainer.default_root_dir

    def _save_plot(self, trainer, values: torch.Tensor) -> str:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        directory = self._plot_dir(trainer)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"jacobian_spectrum_epoch{trainer.current_epoch:03d}.png")
        fig = Figure(figsize=(5, 3.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        idx = list(range(1, values.shape[1] + 1))
        for row in values:
            ax.plot(idx, row.tolist(), color="0.7", linewidth=0.8, marker=".")
        ax.plot(idx, values.mean(0).tolist(), color="C0", linewidth=2, marker="o", label="mean over samples")
        if bool((values > 0).all()):
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("index i")
        ax.set_ylabel("singular value σ_i of J_f(x)")
        ax.set_title(f"Jacobian spectrum, epoch {trainer.current_epoch}")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path)
        return path

    def _log_image(self, trainer, path: str) -> None:
        from pytorch_lightning.loggers import WandbLogger  # does not import wandb itself

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="jacobian/spectrum", images=[path], step=trainer.global_step)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        return {"val_epochs_seen": self._val_epochs, "n_computed": self._n_computed,
                "batch_index": self._batch_index, "last_epoch": self._last_epoch}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._val_epochs = int(state_dict["val_epochs_seen"])
        self._n_computed = int(state_dict["n_computed"])
        self._batch_index = state_dict.get("batch_index")
        self._last_epoch = int(state_dict.get("last_epoch", -1))
