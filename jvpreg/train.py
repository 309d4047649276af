"""``jvpreg-train`` (also ``python -m jvpreg.train``): Hydra + Lightning training with JVP regularizers.

The configs live in the package (``pkg://jvpreg.conf``, see ``jvpreg/conf/train.yaml``), so the
installed entry point finds them from any folder. With no arguments it trains a small CNN on
scikit-learn's bundled digits with Jacobian regularization on the CPU (about a minute), evaluates
the best checkpoint (test accuracy, Gaussian-noise and FGSM/PGD accuracy, ``||J||_F``), prints a
summary with the paths of everything it wrote, and returns ``optimized_metric`` for sweepers.

Examples::

    jvpreg-train
    jvpreg-train model=resnet18 data=synthetic data.in_channels=3 data.size=32 regularizer=stacked
    jvpreg-train -m regularizer.weight=0,0.01,0.1 seed=0,1
    jvpreg-train experiment=digits_tangent_prop logger=csv
    jvpreg-train model=timm model.name=convnext_atto data.resize=32      # any timm model (extra: timm)
    jvpreg-train model=hf                                                # Hugging Face ViT from a config (extra: hf)
    jvpreg-train experiment=digits_meanflow       # a generative model (mean flow), see jvpreg.generative.run

Outputs (``outputs/<task_name>/<date>_<time>/``, or ``multirun/.../<job>/``): ``checkpoints/best.ckpt``,
``csv/metrics.csv``, ``wandb/`` (offline run: upload with ``wandb sync``), ``plots/summary.png``,
``metrics.json``, ``.hydra/`` (the composed config) and ``<task_name>.log``. A multirun also writes
``summary.md``, ``summary.csv`` and ``summary.png`` comparing its jobs in the sweep folder
(:mod:`jvpreg.summarize`).

Implementation choices:

* ``WANDB_MODE=offline`` is set when the user has not set ``WANDB_MODE`` and no ``wandb agent``
  started the run (this machine may have no route to the W&B server; ``wandb sync`` uploads later). Every job ends its W&B run
  (``wandb.finish()``), also on errors, so each job of a multirun is its own run.
* Regularizer callbacks whose ``weight`` is 0 are skipped (identical to plain training, half the
  cost), so ``regularizer.weight=0`` is the no-regularization baseline of a sweep.
* The robustness evaluation runs on global rank 0 only, on the best checkpoint's weights.
* Every checkpoint it opens (``ckpt_path`` to resume or test, the best checkpoint it reloads) is
  unpickled weights-only (:mod:`jvpreg.checkpoints`); ``trust_checkpoint=true`` lifts that for a
  file you trust (it runs code from the file).
* Hydra, wandb and matplotlib are imported here (or lazily), never by ``import jvpreg``.
* timm / Hugging Face models (``model=timm``, ``model=hf*``): the optional package is checked before
  building (``ImportError`` with the ``pip install``), and one eval-mode forward of a zero image
  after building turns "input too small" errors deep inside the model into a ``data.resize`` hint.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import hydra
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

from jvpreg.app_setup import build_callbacks, build_loggers, config_dict, zero_weight

log = logging.getLogger("jvpreg.train")

__all__ = ["SweepSummaryCallback", "main", "train", "build_callbacks", "build_loggers"]


# --------------------------------------------------------------------------- helpers


def _setdefault_wandb_mode() -> None:
    """Offline W&B unless the user chose a mode (``WANDB_MODE=online`` to upload live) or a
    ``wandb agent`` started this run (``WANDB_SWEEP_ID`` set: the agent's run must be online)."""
    if "WANDB_SWEEP_ID" not in os.environ:
        os.environ.setdefault("WANDB_MODE", "offline")


def _model_name(cfg: DictConfig) -> Optional[str]:
    """``model.name``; ``hf_<arch>`` for Hugging Face configs (which have an ``arch`` instead)."""
    name = cfg.model.get("name")
    if name is None and cfg.model.get("arch") is not None:
        return f"hf_{cfg.model.arch}"
    return name


def _external_source(cfg: DictConfig) -> Optional[str]:
    """``"timm"``/``"transformers"`` when the model config builds from that optional package."""
    target = str(cfg.model.get("_target_", ""))
    return {"jvpreg.models.build_timm": "timm", "jvpreg.models.build_hf": "transformers"}.get(target)


def _check_external_input(cfg: DictConfig, net: Any) -> None:
    """One eval-mode forward of a zero image: a timm/HF model too large for the data fails here, with the fix."""
    import torch

    size = cfg.data.get("image_size")
    if size is None:
        return
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    was_training = net.training
    try:
        with torch.no_grad():
            net.eval()(torch.zeros(1, int(cfg.data.in_channels), h, w))
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"jvpreg-train: model={_model_name(cfg)} fails on {cfg.data.in_channels}x{h}x{w} inputs "
                         f"({type(err).__name__}: {str(err).splitlines()[0][:200]}). Fix: resize the data, e.g. "
                         "data.resize=32, or make the model smaller than its default (patch size, stages).") from err
    finally:
        net.train(was_training)


def _check_model_size(cfg: DictConfig) -> None:
    """Fail early, with the fix, when the data is smaller than the model's minimum input."""
    from jvpreg.models.registry import MIN_IMAGE_SIZE

    if _external_source(cfg) is not None:
        return  # checked by a forward after building (_check_external_input)
    name = str(cfg.model.get("name", "")).strip().lower().replace("-", "_")
    need = {"lenet5": 12, **MIN_IMAGE_SIZE}.get(name)
    size = cfg.data.get("image_size")
    if need is None or size is None:
        return
    side = min(size) if isinstance(size, (list, tuple)) or OmegaConf.is_list(size) else int(size)
    if side < need:
        raise ValueError(f"jvpreg-train: model={name} needs inputs of at least {need}x{need}, but the data gives "
                         f"{side}x{side}. Fix: resize in the datamodule with data.resize={need} (or larger), "
                         f"or pick a model for small images (small_cnn, mlp, rnn, lenet5 with data.resize=16).")


def _finish_wandb() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def _sync_csv_header(loggers: List[Any]) -> None:
    """Teach each CSVLogger's writer the header of its existing ``metrics.csv``.

    Work-around for Lightning 2.x: a fresh CSV writer (a ``ddp_spawn`` child of ``trainer.test``,
    or the main process after a spawned ``fit``) appending new keys to an existing file rewrites it
    with only its own keys and fails ("dict contains fields not in fieldnames"). Called in the main
    process before ``test``; spawned children receive the primed writer by pickling.
    """
    import csv

    for lg in loggers:
        if type(lg).__name__ != "CSVLogger":
            continue
        exp = lg.experiment
        path = getattr(exp, "metrics_file_path", None)  # a no-op stub on ranks > 0
        if isinstance(path, str) and os.path.isfile(path):
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            exp.metrics_keys = sorted(set(exp.metrics_keys) | set(header))


def _best_checkpoint(trainer: Any) -> Optional[str]:
    cb = getattr(trainer, "checkpoint_callback", None)
    path = getattr(cb, "best_model_path", "") if cb is not None else ""
    return path or None


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


# --------------------------------------------------------------------------- plot


def save_plot(history: List[Dict[str, float]], robustness: Dict[str, float], path: str, *, title: str = "") -> str:
    """Training curves (losses, penalties, accuracies) and robustness bars in one PNG; returns ``path``."""
    from matplotlib.figure import Figure  # Agg canvas, no pyplot state

    fig = Figure(figsize=(14, 4), dpi=110)
    ax_loss, ax_acc, ax_rob = fig.subplots(1, 3)
    epochs = [h["epoch"] + 1 for h in history]

    def series(key: str) -> List[float]:
        return [h.get(key, math.nan) for h in history]

    train_loss = "train/loss_epoch" if any("train/loss_epoch" in h for h in history) else "train/loss"
    for key, style, label in ((train_loss, "-", "train loss (CE)"), ("val/loss", "--", "val loss (CE)")):
        if any(key in h for h in history):
            ax_loss.plot(epochs, series(key), style, label=label)
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("cross-entropy")
    penalties = sorted({k for h in history for k in h if k.startswith("train/") and not k.endswith(("_weight", "_step"))
                        and k not in ("train/loss", "train/loss_epoch", "train/acc")})
    if penalties:
        tw = ax_loss.twinx()
        for k in penalties:
            tw.plot(epochs, series(k), ":", label=f"{k[6:]} (penalty)")
        tw.set_yscale("log")
        tw.set_ylabel("penalty (last step of the epoch)")
        tw.legend(loc="center right", fontsize=8)
    if ax_loss.lines:
        ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.set_title("losses")
    for key, style in (("train/acc", "-"), ("val/acc", "-o")):
        if any(key in h for h in history):
            ax_acc.plot(epochs, series(key), style, ms=3, label=key)
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy")
    if ax_acc.lines:
        ax_acc.legend(loc="lower right", fontsize=8)
    ax_acc.set_title("accuracy")
    bars = {k.replace("_acc", ""): v for k, v in robustness.items() if k.endswith("_acc") or "_acc@" in k}
    if bars:
        ax_rob.bar(range(len(bars)), list(bars.values()), color="tab:blue")
        ax_rob.set_xticks(range(len(bars)))
        ax_rob.set_xticklabels(list(bars), rotation=30, ha="right", fontsize=8)
        ax_rob.set_ylim(0, 1.05)
        for i, v in enumerate(bars.values()):
            ax_rob.text(i, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
    jf = robustness.get("jacobian_fro")
    ax_rob.set_title("test accuracy, best checkpoint" + (f"  (mean ||J||_F = {jf:.3g})" if jf is not None else ""),
                     fontsize=10)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------- training


def train(cfg: DictConfig) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Train and evaluate as configured; returns ``(metrics, objects)``.

    ``metrics`` holds the final scalars (``test/acc``, ``val/acc_best``, robustness results, ...)
    and the output paths; ``objects`` the trainer, LightningModule, datamodule and callbacks.
    Usable without the Hydra app: compose a config with ``hydra.compose`` (set ``paths.output_dir``).
    """
    import pytorch_lightning as pl
    import torch
    from hydra.utils import instantiate

    from jvpreg.callbacks.strategies import is_fully_sharded, unsharded_copy
    from jvpreg.checkpoints import lightning_loading, read_checkpoint
    from jvpreg.lit import ImageClassifier, MetricsHistory
    from jvpreg.robustness import evaluate_robustness

    _setdefault_wandb_mode()
    t0 = time.perf_counter()
    out_dir = os.path.abspath(str(cfg.paths.output_dir))
    os.makedirs(out_dir, exist_ok=True)
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True)

    log.info("data: %s", cfg.data._target_)
    datamodule = instantiate(cfg.data)
    _check_model_size(cfg)
    log.info("model: %s", _model_name(cfg))
    source = _external_source(cfg)
    if source is not None:
        from jvpreg.models.external import require

        require(source, f"model={_model_name(cfg)}")
    net = instantiate(cfg.model)
    if source is not None:
        _check_external_input(cfg, net)
    if cfg.get("compile"):  # in place: checkpoints keep their keys; the callbacks use the compiled clone engine
        if not isinstance(cfg.compile, (bool, DictConfig)):
            raise ValueError(f"compile={cfg.compile!r}: expected true/false or torch.compile's arguments, e.g. "
                             "compile='{mode: max-autotune}'.")
        net.compile(**(OmegaConf.to_container(cfg.compile) if isinstance(cfg.compile, DictConfig) else {}))
    run_config = config_dict(cfg)
    lit = ImageClassifier(net, optimizer=instantiate(cfg.optimizer) if cfg.get("optimizer") else None,
                          scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
                          label_smoothing=float(cfg.get("label_smoothing", 0.0)), run_config=run_config)

    history = MetricsHistory()
    callbacks = build_callbacks(cfg) + [history]
    loggers = build_loggers(cfg)
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers if loggers else False)
    for lg in loggers:
        lg.log_hyperparams(run_config)

    metrics: Dict[str, Any] = {}
    trust = bool(cfg.get("trust_checkpoint", False))
    if cfg.get("train", True):
        with lightning_loading(cfg.get("ckpt_path"), what="jvpreg-train", trust=trust) as weights_only:
            trainer.fit(lit, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=weights_only)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
    best = _best_checkpoint(trainer)
    if not cfg.get("train", True):
        best = cfg.get("ckpt_path")
    _sync_csv_header(loggers)
    if cfg.get("test", True) and not trainer.fast_dev_run:
        with lightning_loading(best, what="jvpreg-train", trust=trust) as weights_only:
            test_out = trainer.test(lit, datamodule=datamodule, ckpt_path=best, verbose=False,
                                    weights_only=weights_only)
        if test_out:
            metrics.update({k: float(v) for k, v in test_out[0].items()})
    elif cfg.get("test", True):  # fast_dev_run: one test batch on the current weights
        trainer.test(lit, datamodule=datamodule, verbose=False)

    rob_cfg = cfg.get("robustness") or {}
    robustness: Dict[str, float] = {}
    plot_path = None
    eval_lit = lit
    if rob_cfg.get("enabled", True) and not trainer.fast_dev_run and is_fully_sharded(lit.net):
        # FSDP2: rank 0 evaluates an unsharded copy (gathering it is a collective: every rank calls)
        full = unsharded_copy(lit.net, lambda: instantiate(cfg.model))
        eval_lit = lit if full is None else ImageClassifier(full)
    if trainer.is_global_zero and rob_cfg.get("enabled", True) and not trainer.fast_dev_run:
        if best:
            state = read_checkpoint(best, what="jvpreg-train", trust=trust)["state_dict"]
            eval_lit.load_state_dict(state)
        eval_lit.to(trainer.strategy.root_device)
        datamodule.setup("test")
        robustness = evaluate_robustness(
            eval_lit.net, datamodule.test_dataloader(), noise_sigmas=list(rob_cfg.get("noise_sigmas", [])),
            fgsm_eps=list(rob_cfg.get("fgsm_eps", [])), pgd_eps=list(rob_cfg.get("pgd_eps", [])),
            pgd_steps=int(rob_cfg.get("pgd_steps", 10)), rotations=list(rob_cfg.get("rotations", [])),
            translations=list(rob_cfg.get("translations", [])), jacobian=rob_cfg.get("jacobian", "auto"),
            n_projections=int(rob_cfg.get("n_projections", 16)),
            jacobian_max_samples=rob_cfg.get("jacobian_max_samples", 512),
            max_samples=rob_cfg.get("max_samples"), seed=int(cfg.get("seed") or 0))
        _sync_csv_header(loggers)
        for lg in loggers:
            lg.log_metrics({f"robustness/{k}": v for k, v in robustness.items()}, step=trainer.global_step)
        if rob_cfg.get("plot", True):
            title = (f"model={_model_name(cfg)} data={cfg.data._target_.rsplit('.', 1)[-1]} "
                     f"regularizer={_reg_summary(cfg)} seed={cfg.get('seed')}")
            plot_path = save_plot(history.history, robustness, os.path.join(out_dir, "plots", "summary.png"),
                                  title=title)

    elapsed = time.perf_counter() - t0
    metrics.update({f"robustness/{k}": v for k, v in robustness.items()})
    paths = {"output_dir": out_dir, "best_checkpoint": best, "plot": plot_path,
             "metrics_json": os.path.join(out_dir, "metrics.json")}
    for lg in loggers:
        name = type(lg).__name__
        if name == "CSVLogger":
            paths["csv"] = os.path.join(lg.log_dir, "metrics.csv")
        elif name == "WandbLogger":
            run = getattr(lg, "experiment", None)
            paths["wandb"] = getattr(run, "dir", None) and os.path.dirname(run.dir)
        elif name == "TensorBoardLogger":
            paths["tensorboard"] = lg.log_dir
    result = {"metrics": metrics, "paths": paths, "history": history.history, "elapsed_s": elapsed,
              "regularizer": _reg_summary(cfg), "model": _model_name(cfg), "seed": cfg.get("seed")}
    if trainer.is_global_zero:
        with open(paths["metrics_json"], "w") as f:
            json.dump(result, f, indent=2, default=str)
        _print_summary(result)
    objects = {"trainer": trainer, "lit": lit, "datamodule": datamodule, "callbacks": callbacks, "loggers": loggers}
    return result, objects


def _reg_summary(cfg: DictConfig) -> str:
    reg = cfg.get("regularizer") or {}
    names = [k for k, v in (reg.get("callbacks") or {}).items() if v is not None and not zero_weight(v.get("weight"))]
    if not names:
        return "none"
    return "+".join(f"{k}(w={float(reg.callbacks[k].weight):g})" for k in names)


def _print_summary(result: Dict[str, Any]) -> None:
    m, p = result["metrics"], result["paths"]
    lines = ["", "=" * 72, f"jvpreg-train: model={result['model']} regularizer={result['regularizer']} "
             f"seed={result['seed']} ({result['elapsed_s']:.0f} s)"]
    if "test/acc" in m:
        lines.append(f"  {'test accuracy':<34} {m['test/acc']:.4f}")
    for k, v in m.items():
        if k.startswith("robustness/") and k != "robustness/n_samples" and "exact" not in k:
            label = k[len("robustness/"):]
            label = {"clean_acc": "clean accuracy (best ckpt)", "jacobian_fro": "mean ||J||_F (logits wrt input)",
                     "jacobian_fro_sq": "mean ||J||_F^2"}.get(label, label.replace("noise_acc@", "Gaussian noise acc, sigma=")
                                                                   .replace("fgsm_acc@", "FGSM acc, eps=")
                                                                   .replace("pgd_acc@", "PGD acc, eps=")
                                                                   .replace("rot_acc@", "rotated acc, deg=")
                                                                   .replace("shift_acc@", "shifted acc, px="))
            lines.append(f"  {label:<34} {_fmt(v)}")
    lines.append("Outputs:")
    for key in ("output_dir", "best_checkpoint", "csv", "wandb", "tensorboard", "plot", "metrics_json"):
        if p.get(key):
            lines.append(f"  {key:<16} {p[key]}")
    if p.get("wandb") and os.environ.get("WANDB_MODE", "offline") == "offline":
        lines.append(f"  (W&B offline run: upload later with `wandb sync {p['wandb']}`)")
    if p.get("best_checkpoint"):
        lines.append(f"  evaluate again:  jvpreg-eval ckpt_path={p['best_checkpoint']}")
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------- sweep summary


class SweepSummaryCallback(HydraCallback):
    """Hydra callback: summarises the multirun's jobs in its sweep folder when the multirun ends.

    Writes ``summary.md``, ``summary.csv`` and ``summary.png`` (:func:`jvpreg.summarize.summarize_sweep`).
    Registered in ``jvpreg/conf/hydra/default.yaml`` (``hydra.callbacks.sweep_summary``); remove it
    with ``~hydra.callbacks.sweep_summary``. A summary that cannot be written is logged as an error
    and does not fail the multirun (the jobs' results are on disk; ``jvpreg-summarize <dir>`` retries).

    Args:
        plot: also write ``summary.png``.

    Example::

        # jvpreg/conf/hydra/default.yaml
        callbacks:
          sweep_summary:
            _target_: jvpreg.train.SweepSummaryCallback
    """

    def __init__(self, plot: bool = True) -> None:
        if not isinstance(plot, bool):
            raise TypeError(f"SweepSummaryCallback(plot): expected a bool, got {plot!r}.")
        self.plot = plot

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from jvpreg.summarize import summarize_sweep

        sweep_dir = config.hydra.sweep.dir
        try:
            s = summarize_sweep(sweep_dir, plot=self.plot)
        except Exception:  # noqa: BLE001 - reported, never fatal for a finished sweep
            log.exception("could not summarise the sweep in %s (the jobs' results are there; retry with "
                          "jvpreg-summarize %s)", sweep_dir, sweep_dir)
            return
        print(f"\njvpreg: sweep summary ({len(s.jobs)} jobs): {s.paths['md']}\n"
              + "\n".join(f"  {k:<4} {v}" for k, v in s.paths.items() if k != "md"), flush=True)


# --------------------------------------------------------------------------- entry point


def _objective(cfg: DictConfig, result: Dict[str, Any]) -> Optional[float]:
    name = cfg.get("optimized_metric")
    if not name:
        return None
    metrics = result["metrics"]
    value = metrics.get(name, metrics.get(f"robustness/{name}"))
    if value is None:
        log.warning("optimized_metric=%r was not computed; available: %s", name, ", ".join(sorted(metrics)))
        return None
    return float(value)


@hydra.main(version_base="1.3", config_path="pkg://jvpreg.conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> Optional[float]:
    _setdefault_wandb_mode()
    try:
        if cfg.get("generative"):  # a generative objective (experiment=digits_meanflow): jvpreg.generative.run
            from jvpreg.generative.run import train_generative  # here: a classifier run needs none of it

            result, _ = train_generative(cfg)
        else:
            result, _ = train(cfg)
        return _objective(cfg, result)
    finally:
        _finish_wandb()  # each job of a multirun is its own W&B run


#: command-line choice prefix -> (Hydra plugin module, pip package) it needs
PLUGINS = {
    "hparams_search=": ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
    "launcher=slurm": ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
}


def check_plugins(argv: List[str]) -> None:
    """Fail with the install command when a chosen config needs a Hydra plugin that is missing.

    (Hydra itself only says it "Could not find 'hydra/sweeper/optuna'".)
    """
    import importlib.util

    for arg in argv:
        for prefix, (module, package) in PLUGINS.items():
            if arg.lstrip("+~").startswith(prefix) and not arg.endswith("=null"):
                try:
                    found = importlib.util.find_spec(module) is not None
                except ModuleNotFoundError:
                    found = False
                if not found:
                    raise SystemExit(f"jvpreg: {arg!r} needs the Hydra plugin {package!r}, which is not installed. "
                                     f"Fix: pip install {package}")


def main() -> Any:
    """Console entry point ``jvpreg-train`` (Hydra parses ``sys.argv``)."""
    _setdefault_wandb_mode()
    check_plugins(sys.argv[1:])
    result = _hydra_main()
    from jvpreg.callbacks.strategies import end_worker_process

    end_worker_process()  # a DDP/FSDP worker rank that finished: no interpreter teardown (its gloo abort, under load)
    return result


if __name__ == "__main__":
    main()
