"""What every run of the Hydra app builds from its config: the callbacks (regularizers included), the loggers, and the
run config as a plain dict. Shared by the classifier run (:mod:`jvpreg.train`) and the generative one
(:mod:`jvpreg.generative.run`)."""
from __future__ import annotations

import importlib.util
import logging
from typing import Any, Dict, List, Optional

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("jvpreg.train")  # the app's logger

__all__ = ["build_callbacks", "build_loggers", "config_dict", "zero_weight"]


def zero_weight(value: Any) -> bool:
    """Whether a config entry's ``weight`` is 0 (a regularizer then is skipped: plain training)."""
    try:
        return float(value) == 0.0
    except (TypeError, ValueError):
        return False


def _instantiate_named(group: Optional[DictConfig], what: str, *, skip_zero_weight: bool = False) -> List[Any]:
    """Instantiate every ``{name: {_target_: ...}}`` entry of a config group (skips nulls).

    With ``skip_zero_weight``, entries whose ``weight`` is 0 are skipped (and logged).
    """
    out: List[Any] = []
    if not group:
        return out
    if not isinstance(group, DictConfig):
        raise TypeError(f"jvpreg-train: expected the {what} config to be a mapping of name -> config, got {group!r}")
    for name, conf in group.items():
        if conf is None:
            continue
        if not isinstance(conf, DictConfig) or "_target_" not in conf:
            raise TypeError(f"jvpreg-train: {what}.{name} must be a config with a _target_, got {conf!r}")
        if skip_zero_weight and zero_weight(conf.get("weight")):
            log.info("%s.%s has weight 0: skipped (plain training)", what, name)
            continue
        out.append(instantiate(conf))
    return out


def build_callbacks(cfg: DictConfig) -> List[Any]:
    """The callbacks of ``cfg.callbacks`` and the regularizers of ``cfg.regularizer.callbacks``.

    Regularizers with ``weight == 0`` are skipped (plain training). Lightning callbacks are built
    first, then the regularizers, so several regularizers share one clone forward.
    """
    callbacks = _instantiate_named(cfg.get("callbacks"), "callbacks")
    reg = cfg.get("regularizer")
    if isinstance(reg, DictConfig):
        callbacks += _instantiate_named(reg.get("callbacks"), "regularizer.callbacks", skip_zero_weight=True)
    return callbacks


def _check_logger_available(conf: DictConfig) -> None:
    target = str(conf.get("_target_", ""))
    if target.endswith("TensorBoardLogger"):
        if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
            raise ImportError("jvpreg-train: logger=tensorboard needs the tensorboard package, which is not "
                              "installed. Fix: pip install tensorboard (or choose logger=csv / logger=wandb).")


def build_loggers(cfg: DictConfig) -> List[Any]:
    """The loggers of ``cfg.logger`` (``{}``/``null``: none). Checks optional packages first."""
    group = cfg.get("logger")
    if group:
        for conf in group.values():
            if conf is not None:
                _check_logger_available(conf)
    return _instantiate_named(group, "logger")


def config_dict(cfg: DictConfig) -> Dict[str, Any]:
    """The resolved run config as a plain dict (without the ``hydra`` node), for loggers and checkpoints."""
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    container.pop("hydra", None)  # type: ignore[union-attr]
    return container  # type: ignore[return-value]
