"""Figures of a generative run: a sample grid, the quality bars and the loss curves (Agg canvas, no pyplot)."""
from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping

import torch

__all__ = ["loss_curves", "quality_figure", "sample_grid"]


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


def sample_grid(samples: Mapping[str, torch.Tensor], labels: torch.Tensor, path: str, *, per_class: int = 8,
                real: torch.Tensor = None, real_labels: torch.Tensor = None) -> str:
    """One panel per sample set (and real images): rows are classes 0-9, ``per_class`` columns."""
    from matplotlib.figure import Figure

    sets = dict(samples)
    if real is not None:
        sets["real (test)"] = real
    fig = Figure(figsize=(3.2 * len(sets), 3.6), dpi=110)
    axes = fig.subplots(1, len(sets), squeeze=False)[0]
    for ax, (name, x) in zip(axes, sets.items()):
        lab = real_labels if name == "real (test)" else labels
        rows = []
        for c in range(10):
            imgs = x[lab == c][:per_class, 0]
            if len(imgs) < per_class:
                imgs = torch.cat([imgs, torch.zeros(per_class - len(imgs), *imgs.shape[1:])])
            rows.append(torch.cat([torch.nn.functional.pad(i, (1, 1, 1, 1), value=0.5) for i in imgs], dim=1))
        ax.imshow(torch.cat(rows, dim=0).numpy(), cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_yticks([10 * c + 5 for c in range(10)])
        ax.set_yticklabels(range(10), fontsize=7)
        ax.set_xticks([])
    fig.tight_layout()
    return _save(fig, path)


def quality_figure(quality: Mapping[str, Mapping[str, float]], path: str, title: str = "") -> str:
    """Bars of classifier accuracy / confidence / p(label), and nearest-training-image distances, per sample set."""
    from matplotlib.figure import Figure

    names = list(quality)
    fig = Figure(figsize=(10, 3.6), dpi=110)
    ax1, ax2 = fig.subplots(1, 2)
    width = 0.27
    for j, key in enumerate(("acc", "confidence", "p_label")):
        vals = [quality[n][key] for n in names]
        ax1.bar([i + (j - 1) * width for i in range(len(names))], vals, width, label=key)
        for i, v in enumerate(vals):
            ax1.text(i + (j - 1) * width, v + 0.01, f"{v:.2f}", ha="center", fontsize=6)
    ax1.set_xticks(range(len(names)))
    ax1.set_xticklabels(names, fontsize=8)
    ax1.set_ylim(0, 1.1)
    ax1.legend(fontsize=7, loc="lower right")
    ax1.set_title("digits classifier (logistic regression) on samples", fontsize=9)
    vals = [quality[n]["nn_dist"] for n in names]
    ax2.bar(range(len(names)), vals, color="tab:gray")
    for i, v in enumerate(vals):
        ax2.text(i, v + 0.02, f"{v:.2f}", ha="center", fontsize=7)
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, fontsize=8)
    ax2.set_title("mean L2 distance to the nearest training image", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def loss_curves(history: List[Dict[str, float]], path: str) -> str:
    """Train and validation loss (adaptive-weighted) and ``mean ||Δ||²`` per epoch."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), dpi=110)
    ax1, ax2 = fig.subplots(1, 2)
    epochs = [h["epoch"] + 1 for h in history]
    for ax, keys in ((ax1, ("train/loss_epoch", "val/loss")), (ax2, ("train/mse", "val/mse"))):
        for k in keys:
            if not any(k in h for h in history):
                continue
            xs, ys = epochs, [h.get(k, math.nan) for h in history]
            if k.startswith("val/"):  # validation runs every n epochs; the rows between repeat its last value
                keep = [i for i, y in enumerate(ys) if i == 0 or y != ys[i - 1]]
                xs, ys = [xs[i] for i in keep], [ys[i] for i in keep]
            ax.plot(xs, ys, "o-" if k.startswith("val/") else "-", ms=3, label=k)
        ax.set_xlabel("epoch")
        ax.legend(fontsize=8)
        ax.ticklabel_format(axis="y", useOffset=False, style="plain") if ax is ax1 else None
    ax1.set_title("adaptive-weighted loss (p = 1: ||Δ||²/(||Δ||² + c), near 1 by construction)", fontsize=8)
    ax2.set_title("mean ||u - sg(u_tgt)||²", fontsize=9)
    ax2.set_yscale("log")
    fig.tight_layout()
    return _save(fig, path)
