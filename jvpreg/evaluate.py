"""``jvpreg-eval`` (also ``python -m jvpreg.evaluate``): robustness report of a ``jvpreg-train`` checkpoint.

Reloads the network and the data from the run configuration stored in the checkpoint (key
``"jvpreg_config"``, written by :class:`jvpreg.lit.ImageClassifier`), then reports clean accuracy,
accuracy under Gaussian noise of several σ, FGSM and PGD accuracy at several L∞ radii, optionally
rotated/translated accuracy, and the mean Frobenius norm of the input-output Jacobian (exact with
clone-mode JVPs for small inputs, Hutchinson otherwise; :mod:`jvpreg.robustness`). Prints a
Markdown table and writes a JSON file (``output_json``).

Examples::

    jvpreg-eval ckpt_path=outputs/train/2025-01-01_12-00-00/checkpoints/best.ckpt
    jvpreg-eval ckpt_path=... robustness.pgd_eps=[0.05,0.1] robustness.pgd_steps=40 split=val
    jvpreg-eval ckpt_path=... data=digits data.resize=16      # evaluate on another data config

Implementation choice: a ``data=`` group on the command line replaces the checkpoint's data config;
otherwise the checkpoint's (resolved) data config is used, with ``batch_size``/``data_dir`` overrides.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Optional, Tuple

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("jvpreg.evaluate")

__all__ = ["evaluate", "load_checkpoint", "main"]


def load_checkpoint(ckpt_path: str, *, map_location: str = "cpu") -> Tuple[Any, Dict[str, Any]]:
    """Rebuild the :class:`~jvpreg.lit.ImageClassifier` of a ``jvpreg-train`` checkpoint.

    Args:
        ckpt_path: Path of a ``.ckpt`` written by ``jvpreg-train``.
        map_location: Device to load the tensors on.

    Returns:
        ``(lit, run_config)``: the module with the checkpoint's weights (eval mode) and the run
        configuration stored in it (a plain dict).

    Raises:
        FileNotFoundError: No file at ``ckpt_path``.
        ValueError: The checkpoint holds no jvpreg run configuration.
    """
    import torch
    from hydra.utils import instantiate

    from jvpreg.lit import CONFIG_KEY, ImageClassifier

    path = os.path.expanduser(str(ckpt_path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"jvpreg-eval: no checkpoint at ckpt_path={ckpt_path!r} "
                                f"(jvpreg-train prints the path of its best checkpoint).")
    ckpt = torch.load(path, map_location=map_location, weights_only=False)
    run_config = ckpt.get(CONFIG_KEY)
    if not run_config:
        raise ValueError(f"jvpreg-eval: {path} has no {CONFIG_KEY!r} entry: it was not written by jvpreg-train. "
                         "Load it yourself and call jvpreg.robustness.evaluate_robustness(model, loader).")
    net = instantiate(OmegaConf.create(run_config["model"]))
    lit = ImageClassifier(net, run_config=run_config)
    lit.load_state_dict(ckpt["state_dict"])
    return lit.eval(), run_config


def evaluate(cfg: DictConfig) -> Dict[str, Any]:
    """Run the evaluation described by ``cfg`` (see ``jvpreg/conf/eval.yaml``); returns the report dict."""
    import torch
    from hydra.utils import instantiate

    from jvpreg.robustness import evaluate_robustness, format_table

    t0 = time.perf_counter()
    lit, run_config = load_checkpoint(cfg.ckpt_path)
    device = torch.device(str(cfg.get("device") or "cpu"))
    lit.to(device)
    if cfg.get("data") is not None:
        data_cfg = cfg.data
        source = "command line"
    else:
        data_cfg = OmegaConf.create(run_config["data"])
        source = "checkpoint"
        if cfg.get("batch_size"):
            data_cfg.batch_size = data_cfg.eval_batch_size = int(cfg.batch_size)
        if cfg.get("data_dir") and "data_dir" in data_cfg:
            data_cfg.data_dir = str(cfg.data_dir)
    datamodule = instantiate(data_cfg)
    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    datamodule.setup("test")
    split = str(cfg.get("split", "test"))
    if split not in ("test", "val"):
        raise ValueError(f"jvpreg-eval: expected split=test or split=val, got {split!r}.")
    loader = datamodule.test_dataloader() if split == "test" else datamodule.val_dataloader()
    rob = cfg.robustness
    metrics = evaluate_robustness(
        lit.net, loader, noise_sigmas=list(rob.noise_sigmas), fgsm_eps=list(rob.fgsm_eps), pgd_eps=list(rob.pgd_eps),
        pgd_steps=int(rob.pgd_steps), rotations=list(rob.get("rotations", [])),
        translations=list(rob.get("translations", [])), jacobian=rob.get("jacobian", "auto"),
        n_projections=int(rob.get("n_projections", 16)), jacobian_max_samples=rob.get("jacobian_max_samples", 512),
        max_samples=rob.get("max_samples"), seed=int(cfg.get("seed") or 0))
    report = {
        "ckpt_path": os.path.abspath(str(cfg.ckpt_path)),
        "model": run_config.get("model", {}).get("name"),
        "data": data_cfg.get("_target_"),
        "data_source": source,
        "split": split,
        "metrics": metrics,
        "elapsed_s": time.perf_counter() - t0,
    }
    table = format_table(metrics)
    print(f"\njvpreg-eval: {report['ckpt_path']}\nmodel={report['model']} data={report['data']} split={split}\n")
    print(table)
    out = cfg.get("output_json")
    if out:
        out = os.path.abspath(str(out))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nJSON: {out}")
        report["output_json"] = out
    return report


@hydra.main(version_base="1.3", config_path="pkg://jvpreg.conf", config_name="eval")
def _hydra_main(cfg: DictConfig) -> Optional[float]:
    report = evaluate(cfg)
    return float(report["metrics"]["clean_acc"])


def main() -> Any:
    """Console entry point ``jvpreg-eval`` (Hydra parses ``sys.argv``)."""
    return _hydra_main()


if __name__ == "__main__":
    main()
