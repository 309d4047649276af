"""``python -m jvpreg.train experiment=digits_meanflow``: train a mean-flow model, sample, score, plot.

Selected by ``jvpreg.train`` when the config has a ``generative`` node. Writes to the run folder:
``samples.png`` (1-step and 2-step class-conditional samples next to real test digits), ``quality.png`` and
``quality.json`` (:func:`jvpreg.generative.digits_quality`), ``loss_curves.png``, ``metrics.json``, the CSV and
W&B (offline) logs, and ``checkpoints/``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Tuple

import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from jvpreg.app_setup import build_callbacks, build_loggers, config_dict
from jvpreg.checkpoints import lightning_loading
from jvpreg.lit import MetricsHistory

from .lit import MeanFlowModule
from .plots import loss_curves, quality_figure, sample_grid
from .quality import digits_quality

log = logging.getLogger("jvpreg.generative")

__all__ = ["train_generative"]


def train_generative(cfg: DictConfig) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Train ``cfg.model`` with ``cfg.generative.loss`` on ``cfg.data`` and score its samples: ``(result, objects)``."""
    t0 = time.perf_counter()
    gen = cfg.generative
    out_dir = os.path.abspath(str(cfg.paths.output_dir))
    os.makedirs(out_dir, exist_ok=True)
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True)
    datamodule = instantiate(cfg.data)
    net = instantiate(cfg.model)
    loss = instantiate(gen.loss)
    run_config = config_dict(cfg)
    lit = MeanFlowModule(net, loss, optimizer=instantiate(cfg.optimizer) if cfg.get("optimizer") else None,
                         ema_decay=float(gen.get("ema_decay", 0.999)), conditional=bool(gen.get("conditional", True)),
                         run_config=run_config)
    history = MetricsHistory()
    loggers = build_loggers(cfg)
    trainer = instantiate(cfg.trainer, callbacks=build_callbacks(cfg) + [history], logger=loggers or False)
    for lg in loggers:
        lg.log_hyperparams(run_config)
    t_fit = time.perf_counter()
    # resume (ckpt_path=...) read as jvpreg-train reads it: weights only, unless trust_checkpoint=true
    with lightning_loading(cfg.get("ckpt_path"), what="jvpreg-train", trust=bool(cfg.get("trust_checkpoint"))) as wo:
        trainer.fit(lit, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=wo)
    fit_s = time.perf_counter() - t_fit

    # samples from fixed noise, per_class of each label, 1 and 2 steps (and more if configured)
    (train_x, train_y), (test_x, test_y) = (ds.tensors for ds in datamodule.load())
    n = int(gen.get("samples_per_class", 100))
    g = torch.Generator().manual_seed(1234)
    labels = torch.arange(10).repeat_interleave(n)
    noise = torch.randn((len(labels), *train_x.shape[1:]), generator=g)
    steps = [int(s) for s in gen.get("sample_steps", [1, 2])]
    samples = {f"{s} step{'s' if s > 1 else ''}": lit.sample(noise, s, labels) for s in steps}
    quality = digits_quality(samples, labels, train_x, train_y, test_x, test_y)
    paths = {"output_dir": out_dir,
             "samples": sample_grid(samples, labels, os.path.join(out_dir, "samples.png"), real=test_x,
                                    real_labels=test_y),
             "quality": quality_figure(quality, os.path.join(out_dir, "quality.png"),
                                       title=f"{n} samples per class, EMA weights, {trainer.current_epoch} epochs"),
             "loss_curves": loss_curves(history.history, os.path.join(out_dir, "loss_curves.png")),
             "metrics_json": os.path.join(out_dir, "metrics.json")}
    with open(os.path.join(out_dir, "quality.json"), "w") as f:
        json.dump(quality, f, indent=2)
    flat = {f"gen/{name.replace(' ', '_')}/{k}": v for name, q in quality.items() for k, v in q.items()}
    for lg in loggers:
        lg.log_metrics(flat, step=trainer.global_step)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics.update(flat)
    result = {"metrics": metrics, "quality": quality, "paths": paths, "history": history.history,
              "elapsed_s": time.perf_counter() - t0, "fit_s": fit_s, "steps": trainer.global_step,
              "model": cfg.model.get("name"), "loss": repr(loss), "seed": cfg.get("seed")}
    with open(paths["metrics_json"], "w") as f:
        json.dump(result, f, indent=2, default=str)
    lines = [f"jvpreg mean-flow run ({result['elapsed_s']:.0f} s, fit {fit_s:.0f} s, {trainer.global_step} steps)"]
    for name, q in quality.items():
        lines.append(f"  {name:<10} classifier acc {q['acc']:.3f}  confidence {q['confidence']:.3f}  "
                     f"p(label) {q['p_label']:.3f}  nearest-train L2 {q['nn_dist']:.3f}")
    lines += [f"  {k:<12} {v}" for k, v in paths.items()]
    print("\n".join(lines), flush=True)
    return result, {"trainer": trainer, "lit": lit, "datamodule": datamodule}
