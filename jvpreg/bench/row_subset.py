"""Row subset vs whole-batch tangents vs double backprop: what a regularized step costs and what it buys.

``python -m jvpreg.bench row_subset [--quick]`` trains one copy of a model per method on the same batches,
round-robin (one step of each method in turn, so load changes on a shared machine hit every method alike):

* ``plain``: task loss only;
* ``clone``: ``+ lam * JacobianFrobenius`` (one Gaussian projection, every row) through the callbacks'
  shared forward (:class:`jvpreg.callbacks.SharedForward`, engine ``"auto"``);
* ``rows50``, ``rows25``: the same with tangents on a random half / quarter of the rows
  (``row_subset=0.5`` / ``0.25``, :mod:`jvpreg.losses.row_subset`);
* ``double_backprop``: Hoffman et al. 2019 with one random unit output projection ``v`` per sample,
  ``lam * C ||vᵀJ||² / B`` (the same expectation ``lam * mean_b ||J_b||_F²`` as the clone penalties).

Reported per method: median wall-clock and CPU time of a training step, the relative variance of the penalty's
parameter gradient at the initial weights (``E||g - E g||² / ||E g||²`` over seeded draws on one batch), and after
training the mean per-sample ``||J||_F`` on test inputs and clean / Gaussian-noise / PGD accuracy
(:mod:`jvpreg.robustness`). Settings: ``digits`` (a ReLU MLP on scikit-learn's 8x8 digits, exact ``||J||_F``) and
``resnet18`` (torchvision ResNet-18, train-mode BatchNorm, synthetic 10-class 16x16 images, Hutchinson ``||J||_F``;
BatchNorm statistics re-estimated on the training set before every evaluation, for every method alike).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..callbacks.shared import SharedForward
from ..losses import JacobianFrobenius
from .. import robustness
from . import report
from .timing import machine_description

METHODS = {"plain": None, "clone": 1.0, "rows50": 0.5, "rows25": 0.25, "double_backprop": None}
DEFAULT_OUT = "experiments/results/row_subset_cpu"


class Method:
    """One method's copy of the model, optimizer and penalty."""

    def __init__(self, name: str, model: nn.Module, lam: float, lr: float, seed: int):
        self.name, self.lam = name, lam
        self.model = copy.deepcopy(model).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.penalty = JacobianFrobenius(1, seed=seed)
        self.shared = SharedForward(self.model) if name in ("clone", "rows50", "rows25") else None
        self.rows = None if METHODS[name] in (None, 1.0) else METHODS[name]
        self.gen = torch.Generator().manual_seed(seed)
        self.wall: List[float] = []
        self.cpu: List[float] = []

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: bool = True) -> torch.Tensor:
        """``task(f(x)) + lam * penalty`` (``task=False``: the penalty alone, weight 1)."""
        lam = self.lam if task else 1.0
        if self.name == "plain":
            return F.cross_entropy(model(x), y)
        if self.shared is not None and model is self.model:
            self.shared.arm([(self.penalty, lam, 1.0)], row_subset=self.rows)
            try:
                out = model(x)
                pen = self.shared.total()
            finally:
                self.shared.disarm()
            return F.cross_entropy(out, y) + pen if task else pen
        # double backprop (Hoffman et al.): C ||v^T J||^2 / B with v uniform on the unit sphere of R^C
        xg = x.clone().requires_grad_()
        out = model(xg)
        c = out.shape[1]
        v = torch.randn(out.shape, generator=self.gen).to(out)
        v = v / v.norm(dim=1, keepdim=True)
        (jv,) = torch.autograd.grad(out, xg, v, create_graph=True)
        pen = lam * c * jv.pow(2).sum() / x.shape[0]
        return F.cross_entropy(out, y) + pen if task else pen

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.model, x, y).backward()
        self.opt.step()
        self.wall.append(time.perf_counter() - w0)
        self.cpu.append(time.process_time() - c0)

    def penalty_gradients(self, x: torch.Tensor, y: torch.Tensor, draws: int) -> torch.Tensor:
        """``(draws, P)`` parameter gradients of the penalty alone at the current weights (buffers restored)."""
        saved = copy.deepcopy(self.model.state_dict())
        params = list(self.model.parameters())
        out = []
        for _ in range(draws):
            g = torch.autograd.grad(self.loss(self.model, x, y, task=False), params, allow_unused=True)
            out.append(torch.cat([(gi if gi is not None else torch.zeros_like(p)).flatten() for gi, p in zip(g, params)]))
        self.model.load_state_dict(saved)
        return torch.stack(out)


def digits_setting(quick: bool) -> dict:
    from ..data.digits import DigitsDataModule

    dm = DigitsDataModule(batch_size=64)
    train, test = dm.load()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    return {"name": "digits MLP 64-512-512-10 (ReLU)", "key": "digits", "model": model, "train": train.tensors,
            "test": test.tensors, "batch": 64, "epochs": 2 if quick else 30, "lam": 0.01, "lr": 0.05,
            "jacobian": {"method": "exact"}, "noise": 0.3, "pgd": 0.1}


def resnet_setting(quick: bool, size: int = 16, batch: int = 32) -> dict:
    import torchvision

    g = torch.Generator().manual_seed(0)
    templates = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=size, mode="bilinear", align_corners=False)

    def sample(n):
        y = torch.randint(0, 10, (n,), generator=g)
        x = (0.5 + 0.2 * templates[y] + 0.25 * torch.randn(n, 3, size, size, generator=g)).clamp(0, 1)
        return x, y

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    return {"name": f"ResNet-18 (train-mode BatchNorm), synthetic 10-class 3x{size}x{size}", "key": "resnet18",
            "model": model, "train": sample(4 * batch if quick else 24 * batch), "test": sample(64 if quick else 256),
            "batch": batch, "epochs": 1 if quick else 3, "lam": 0.01, "lr": 0.02,
            "jacobian": {"method": "hutchinson", "n_projections": 8, "max_samples": 128}, "noise": 0.2, "pgd": 0.03}


def batches(xy, batch: int, seed: int, shuffle: bool = True):
    """Full batches of ``xy`` (the test set: every sample, in order, in batches of at most ``batch``)."""
    x, y = xy
    if not shuffle:
        return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)]
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(len(y))
    return [(x[order[i:i + batch]], y[order[i:i + batch]]) for i in range(0, len(y) - batch + 1, batch)]


def recalibrate(model: nn.Module, setting: dict) -> None:
    """BatchNorm running statistics re-estimated as the cumulative average over the training set (no gradients):
    after a short run, momentum 0.1 leaves them far from the data's, which would blow up every eval-mode metric."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    with torch.no_grad():
        for x, _ in batches(setting["train"], setting["batch"], 0, shuffle=False):
            model(x)
    for m, mom in zip(norms, saved):
        m.momentum = mom


def evaluate(model: nn.Module, setting: dict, seed: int) -> Dict[str, float]:
    test = batches(setting["test"], 128, 0, shuffle=False)
    jac = robustness.jacobian_frobenius(model, test, seed=seed, **setting["jacobian"])
    return {"jacobian_fro": jac["jacobian_fro"], "clean_acc": robustness.accuracy(model, test),
            f"noise_acc@{setting['noise']}": robustness.noise_accuracy(model, test, setting["noise"]),
            f"pgd_acc@{setting['pgd']}": robustness.adversarial_accuracy(model, test, setting["pgd"], attack="pgd")}


def run_setting(setting: dict, methods: List[str], draws: int, log=print) -> dict:
    ms = {m: Method(m, setting["model"], setting["lam"], setting["lr"], seed=1) for m in methods}
    x0, y0 = batches(setting["train"], setting["batch"], 0)[0]
    variance = {}
    for m in methods:
        if m == "plain":
            continue
        g = ms[m].penalty_gradients(x0, y0, draws)
        mean = g.mean(0)
        variance[m] = {"rel_variance": float((g - mean).pow(2).sum(1).mean() / mean.pow(2).sum()),
                       "mean_norm": float(mean.norm())}
    curve: Dict[str, List[dict]] = {m: [] for m in methods}
    for epoch in range(setting["epochs"]):
        for x, y in batches(setting["train"], setting["batch"], 1000 + epoch):
            for m in methods:
                ms[m].step(x, y)
        if setting["key"] == "digits" or epoch == setting["epochs"] - 1:
            for m in methods:
                recalibrate(ms[m].model, setting)
                j = robustness.jacobian_frobenius(ms[m].model, batches(setting["test"], 128, 0, shuffle=False),
                                                  seed=0, **setting["jacobian"])["jacobian_fro"]
                curve[m].append({"epoch": epoch + 1, "train_s": sum(ms[m].wall), "jacobian_fro": j})
        log(f"  {setting['key']} epoch {epoch + 1}/{setting['epochs']}: " +
            ", ".join(f"{m} {1e3 * statistics.median(ms[m].wall):.1f} ms" for m in methods))
    rows = []
    for m in methods:
        row = {"setting": setting["key"], "method": m, "row_subset": METHODS[m], "steps": len(ms[m].wall),
               "median_step_s": statistics.median(ms[m].wall), "cpu_median_step_s": statistics.median(ms[m].cpu),
               "train_s": sum(ms[m].wall), **variance.get(m, {}), **evaluate(ms[m].model, setting, 0),
               "curve": curve[m]}
        rows.append(row)
    base = {r["method"]: r for r in rows}
    for r in rows:
        for ref in ("plain", "clone", "double_backprop"):
            if ref in base:
                r[f"vs_{ref}"] = r["median_step_s"] / base[ref]["median_step_s"]
                r[f"cpu_vs_{ref}"] = r["cpu_median_step_s"] / base[ref]["cpu_median_step_s"]
        if "plain" in base:
            r["jacobian_reduction"] = base["plain"]["jacobian_fro"] / r["jacobian_fro"]
        if "rel_variance" in r and "plain" in base:  # variance x cost: the estimator's efficiency per unit of time
            r["variance_x_cost"] = r["rel_variance"] * r["vs_plain"]
    return {"setting": setting["name"], "key": setting["key"], "batch": setting["batch"], "epochs": setting["epochs"],
            "lambda": setting["lam"], "lr": setting["lr"], "rows": rows}


def verdicts(result: dict) -> List[str]:
    """Whether a row-subset setting reaches double backprop's ||J||_F at least 1.5x faster (median step)."""
    out = []
    for s in result["settings"]:
        rows = {r["method"]: r for r in s["rows"]}
        db = rows.get("double_backprop")
        if db is None:
            continue
        for m in ("clone", "rows50", "rows25"):
            r = rows.get(m)
            if r is None:
                continue
            faster = db["median_step_s"] / r["median_step_s"]
            cpu_faster = db["cpu_median_step_s"] / r["cpu_median_step_s"]
            same = r["jacobian_fro"] <= 1.1 * db["jacobian_fro"]
            out.append(f"{s['key']}: {m} step {faster:.2f}x faster than double backprop by wall clock ({cpu_faster:.2f}x "
                       f"by CPU time); ||J||_F {r['jacobian_fro']:.2f} vs {db['jacobian_fro']:.2f} "
                       f"({'same effect or stronger (within 10%)' if same else 'weaker effect'}) -> "
                       f"{'MEETS' if same and faster >= 1.5 else 'does not meet'} 'same effect >= 1.5x faster'")
    return out


def markdown(result: dict) -> str:
    lines = ["# Row subset: cost and effect of a regularized step (CPU)", "",
             "Each method trains its own copy of the model on the same batches, one step of each method in turn. "
             "`clone`: JacobianFrobenius (1 Gaussian projection) on every row; `rows50` / `rows25`: on a random half / "
             "quarter of the rows (`row_subset`); `double_backprop`: one random unit output projection per sample "
             "(Hoffman et al.), same expectation. Relative variance: `E||g - E g||² / ||E g||²` of the penalty's "
             "parameter gradient at the initial weights on one batch; `variance x cost` multiplies it by the step's "
             "cost in plain steps (lower: more regularization signal per second).", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['cpu_cores']} cores shared with other jobs, "
             f"torch {result['machine']['torch']} ({result['threads']} thread); load average at start "
             f"{result['load_average_start']}, at end {result['load_average_end']}. Wall-clock medians are noisy on "
             "this shared machine; CPU time per step is shown beside them.", ""]
    for s in result["settings"]:
        metric_keys = [k for k in s["rows"][0] if k.startswith(("noise_acc", "pgd_acc"))]
        lines += [f"## {s['setting']} (B={s['batch']}, {s['epochs']} epochs, lambda={s['lambda']})", "",
                  "| method | step (ms) | vs plain | vs double backprop | CPU step (ms) | CPU vs double backprop | "
                  "grad rel. variance | variance x cost | train time (s) | ‖J‖_F | ‖J‖_F reduction | clean acc | "
                  + " | ".join(metric_keys) + " |",
                  "|---|" + "---:|" * (11 + len(metric_keys))]
        for r in s["rows"]:
            def f(key, fmt="{:.2f}"):
                return fmt.format(r[key]) if key in r else ""
            lines.append(f"| {r['method']} | {1e3 * r['median_step_s']:.1f} | {f('vs_plain', '{:.2f}x')} | "
                         f"{f('vs_double_backprop', '{:.2f}x')} | {1e3 * r['cpu_median_step_s']:.1f} | "
                         f"{f('cpu_vs_double_backprop', '{:.2f}x')} | {f('rel_variance', '{:.3g}')} | "
                         f"{f('variance_x_cost', '{:.3g}')} | {r['train_s']:.1f} | {r['jacobian_fro']:.2f} | "
                         f"{f('jacobian_reduction', '{:.2f}x')} | {r['clean_acc']:.3f} | "
                         + " | ".join(f"{r[k]:.3f}" for k in metric_keys) + " |")
        lines.append("")
    lines += ["Verdicts (median wall-clock step; 'same effect' = ‖J‖_F within 10% of double backprop's or lower):", ""]
    lines += [f"- {v}" for v in result["verdicts"]]
    if result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    plt = report.pyplot()
    settings = result["settings"]
    fig, axes = plt.subplots(1, 2 * len(settings), figsize=(6 * len(settings) + 4, 4))
    for i, s in enumerate(settings):
        ax = axes[2 * i]
        names = [r["method"] for r in s["rows"]]
        ax.bar(names, [1e3 * r["median_step_s"] for r in s["rows"]], color="tab:blue", alpha=0.7, label="wall")
        ax.plot(names, [1e3 * r["cpu_median_step_s"] for r in s["rows"]], "ko", label="CPU time")
        ax.set_ylabel("median step (ms)")
        ax.set_title(f"{s['key']}: step cost", fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.legend(fontsize=7)
        ax = axes[2 * i + 1]
        for r in s["rows"]:
            c = r["curve"]
            ax.plot([p["train_s"] for p in c], [p["jacobian_fro"] for p in c], "o-", ms=3, label=r["method"])
        ax.set_xlabel("training wall-clock (s)")
        ax.set_ylabel("test mean ‖J‖_F")
        ax.set_yscale("log")
        ax.set_title(f"{s['key']}: ‖J‖_F vs time", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jvpreg.bench row_subset", description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="digits,resnet18", help="comma-separated subset of digits, resnet18")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--draws", type=int, default=20, help="penalty-gradient draws for the variance")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    parser.add_argument("--resnet-size", type=int, default=16, help="side of the ResNet-18 setting's images")
    parser.add_argument("--resnet-batch", type=int, default=32, help="batch of the ResNet-18 setting")
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output path without extension ('' to skip writing)")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        parser.error(f"unknown method(s) {bad}; expected a subset of {list(METHODS)}")
    makers = {"digits": digits_setting,
              "resnet18": lambda quick: resnet_setting(quick, args.resnet_size, args.resnet_batch)}
    keys = [k for k in args.settings.split(",") if k]
    if any(k not in makers for k in keys):
        parser.error(f"--settings: expected a subset of {list(makers)}, got {keys}")
    torch.set_num_threads(args.threads)
    load0 = [round(v, 2) for v in os.getloadavg()]
    t0 = time.perf_counter()
    settings = [run_setting(makers[k](args.quick), methods, args.draws) for k in keys]
    result = {"command": report.command_line("python -m jvpreg.bench row_subset",
                                             sys.argv[1:] if argv is None else argv).strip(),
              "machine": machine_description("cpu"), "threads": torch.get_num_threads(), "load_average_start": load0,
              "load_average_end": [round(v, 2) for v in os.getloadavg()], "wall_s": time.perf_counter() - t0,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "notes": list(args.note), "settings": settings}
    result["verdicts"] = verdicts(result)
    md = markdown(result)
    print(md)
    if args.out:
        paths = report.write_results(args.out, md, result)
        plot(result, args.out + ".png")
        print("wrote " + " and ".join(map(str, paths)) + f" and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
