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
    jvpreg-eval ckpt_path=... model=mlp                       # build this model config, not the stored one

Implementation choice: a ``data=`` (``model=``) group on the command line replaces the checkpoint's data
(model) config; otherwise the checkpoint's (resolved) config is used, with ``batch_size``/``data_dir`` overrides.

Security (:mod:`jvpreg.checkpoints`): the file is unpickled weights-only, and a stored model or data config
may only name jvpreg's model builders and datamodules, so opening a checkpoint someone sent runs no code
from it. ``trust_checkpoint=true`` lifts both checks for a file you trust (it runs code from the file).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("jvpreg.evaluate")

__all__ = ["evaluate", "load_checkpoint", "main"]


def load_checkpoint(ckpt_path: str, *, map_location: str = "cpu", model_config: Optional[Mapping[str, Any]] = None,
                    trust: bool = False) -> Tuple[Any, Dict[str, Any]]:
    """Rebuild the :class:`~jvpreg.lit.ImageClassifier` of a ``jvpreg-train`` checkpoint, running no code from it.

    The file is unpickled weights-only and the network is built from ``model_config`` or else from the stored
    model config, which may only name jvpreg's model builders (:mod:`jvpreg.checkpoints`).

    Args:
        ckpt_path: Path of a ``.ckpt`` written by ``jvpreg-train``.
        map_location: Device to load the tensors on.
        model_config: A model config (``_target_`` and arguments, resolved) to build instead of the stored one.
        trust: Open a file you trust with ``weights_only=False`` and build any stored config: runs code from it.

    Returns:
        ``(lit, run_config)``: the module with the checkpoint's weights (eval mode) and the run
        configuration stored in it (a plain dict).

    Raises:
        FileNotFoundError: No file at ``ckpt_path``.
        jvpreg.checkpoints.UnsafeCheckpointError: The file or its stored model config needs code to run.
        ValueError: The file is not a readable checkpoint, or holds no jvpreg run configuration.
    """
    ckpt, run_config = _read(ckpt_path, trust=trust, map_location=map_location)
    return _build(ckpt, run_config, str(ckpt_path), model_config=model_config, trust=trust), run_config


def _read(ckpt_path: str, *, trust: bool, map_location: str = "cpu") -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(checkpoint, run_config)`` of a jvpreg-train checkpoint, unpickled weights-only unless ``trust``."""
    from jvpreg.checkpoints import read_checkpoint
    from jvpreg.lit import CONFIG_KEY

    path = os.path.expanduser(str(ckpt_path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"jvpreg-eval: no checkpoint at ckpt_path={ckpt_path!r} "
                                f"(jvpreg-train prints the path of its best checkpoint).")
    ckpt = read_checkpoint(path, what="jvpreg-eval", trust=trust, map_location=map_location)
    run_config = ckpt.get(CONFIG_KEY)
    if not run_config or not isinstance(run_config, Mapping) or "state_dict" not in ckpt:
        raise ValueError(f"jvpreg-eval: {path} has no {CONFIG_KEY!r} entry: it was not written by jvpreg-train. "
                         "Load it yourself and call jvpreg.robustness.evaluate_robustness(model, loader).")
    return ckpt, dict(run_config)


def _build(ckpt: Dict[str, Any], run_config: Dict[str, Any], path: str, *,
           model_config: Optional[Mapping[str, Any]], trust: bool) -> Any:
    """The eval-mode ImageClassifier: ``model_config`` (or the checked stored one) with the checkpoint's weights."""
    from hydra.utils import instantiate

    from jvpreg.checkpoints import MODEL_TARGETS, check_stored_config
    from jvpreg.lit import ImageClassifier

    if model_config is None:
        model_config = run_config.get("model")
        if not trust:
            check_stored_config(model_config, key="model", allowed=MODEL_TARGETS, path=path, what="jvpreg-eval")
    net = instantiate(OmegaConf.create(dict(model_config)))
    lit = ImageClassifier(net, run_config=run_config)
    lit.load_state_dict(ckpt["state_dict"])
    return lit.eval()


def _command_line_model(cfg: DictConfig, data_cfg: DictConfig) -> Optional[Dict[str, Any]]:
    """``cfg.model`` resolved against the data config in use (model configs read ``${data.*}``), or None."""
    if cfg.get("model") is None:
        return None
    root = OmegaConf.create({"data": OmegaConf.to_container(data_cfg, resolve=True),
                             "model": OmegaConf.to_container(cfg.model, resolve=False)})
    return OmegaConf.to_container(root.model, resolve=True)  # type: ignore[return-value]


def evaluate(cfg: DictConfig) -> Dict[str, Any]:
    """Run the evaluation described by ``cfg`` (see ``jvpreg/conf/eval.yaml``); returns the report dict."""
    import torch
    from hydra.utils import instantiate

    from jvpreg.checkpoints import DATA_TARGETS, check_stored_config
    from jvpreg.robustness import evaluate_robustness, format_table

    t0 = time.perf_counter()
    trust = bool(cfg.get("trust_checkpoint", False))
    path = os.path.expanduser(str(cfg.ckpt_path))
    ckpt, run_config = _read(cfg.ckpt_path, trust=trust)
    if cfg.get("data") is not None:
        data_cfg = cfg.data
        source = "command line"
    else:
        if not trust:
            check_stored_config(run_config.get("data"), key="data", allowed=DATA_TARGETS, path=path,
                                what="jvpreg-eval")
        data_cfg = OmegaConf.create(run_config["data"])
        source = "checkpoint"
        if cfg.get("batch_size"):
            data_cfg.batch_size = data_cfg.eval_batch_size = int(cfg.batch_size)
        if cfg.get("data_dir") and "data_dir" in data_cfg:
            data_cfg.data_dir = str(cfg.data_dir)
    model_config = _command_line_model(cfg, data_cfg)
    lit = _build(ckpt, run_config, path, model_config=model_config, trust=trust)
    del ckpt
    device = torch.device(str(cfg.get("device") or "cpu"))
    lit.to(device)
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
        "model": (model_config or run_config.get("model") or {}).get("name"),
        "model_source": "checkpoint" if model_config is None else "command line",
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
