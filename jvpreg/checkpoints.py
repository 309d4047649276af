"""Opening checkpoints without running code from them.

A ``.ckpt`` file is a pickle: ``torch.load(weights_only=False)`` calls whatever the file names, and a
run configuration rebuilt with ``hydra.utils.instantiate`` calls whatever its ``_target_`` names. So
every checkpoint jvpreg opens (``jvpreg-eval``, the best-checkpoint reload after training, a resumed or
test-only ``jvpreg-train``) is read here:

* :func:`read_checkpoint` unpickles with ``weights_only=True`` (tensors, containers, numbers, strings
  and torch's own allowlist, plus :data:`SAFE_GLOBALS`); anything else is an
  :class:`UnsafeCheckpointError` that names the file and the refused globals.
* :func:`lightning_loading` is the same rule for the loads Lightning does itself
  (``trainer.fit(ckpt_path=...)``, ``trainer.test(ckpt_path=...)``): it checks the file first, for the
  clear error, and gives the ``weights_only`` flag to pass to Lightning, which then loads it with torch's
  weights-only unpickler too.
* :func:`check_stored_config` lets a stored model or data config name only what jvpreg builds: the model
  builders of :mod:`jvpreg.models` (registry, timm, Hugging Face) and the datamodules of :mod:`jvpreg.data`.

``trust=True`` (the apps' ``trust_checkpoint=true``) is the explicit opt-in for a file the user trusts:
``weights_only=False`` and no config check, i.e. code from the file may run.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any, Dict, FrozenSet, List, Tuple

__all__ = ["DATA_TARGETS", "MODEL_TARGETS", "REFUSED_KEYS", "SAFE_GLOBALS", "TRUST_HINT", "UnsafeCheckpointError",
           "check_stored_config", "lightning_loading", "read_checkpoint"]

#: Globals a jvpreg checkpoint needs beyond torch's weights-only allowlist. None: checkpoints of
#: ``jvpreg-train`` (every regularizer, the JacobianMonitor, EarlyStopping, Adam/SGD, LR schedulers, MLP to
#: UNet) hold only tensors, ``OrderedDict``, dicts, lists and plain values, all in torch's own allowlist.
SAFE_GLOBALS: Tuple[Any, ...] = ()

#: ``_target_`` spellings a stored model config may use: jvpreg's registry, timm and Hugging Face builders.
MODEL_TARGETS: FrozenSet[str] = frozenset({
    "jvpreg.models.build_model", "jvpreg.models.registry.build_model",
    "jvpreg.models.build_timm", "jvpreg.models.external.build_timm",
    "jvpreg.models.build_hf", "jvpreg.models.external.build_hf",
})

#: ``_target_`` spellings a stored data config may use: the datamodules of :mod:`jvpreg.data`.
DATA_TARGETS: FrozenSet[str] = frozenset(
    spelling
    for cls, module in (("DigitsDataModule", "digits"), ("SyntheticDataModule", "synthetic"),
                        ("MNISTDataModule", "vision"), ("FashionMNISTDataModule", "vision"),
                        ("CIFAR10DataModule", "vision"))
    for spelling in (f"jvpreg.data.{cls}", f"jvpreg.data.{module}.{cls}"))

#: Keys that make a model builder fetch and run code from elsewhere (Hugging Face remote code, a timm
#: weight file or pretrained-config overlay): refused anywhere in a stored config.
REFUSED_KEYS: FrozenSet[str] = frozenset({"trust_remote_code", "checkpoint_path", "pretrained_cfg",
                                          "pretrained_cfg_overlay"})

#: The opt-in named by every refusal.
TRUST_HINT = ("If you trust this file (trusting it runs code from it), opt in with trust_checkpoint=true "
              "(Python: trust=True).")


class UnsafeCheckpointError(ValueError):
    """A checkpoint that needs code to run to be opened: refused unless the user trusts the file."""


def _unsafe_globals(path: str) -> List[str]:
    """The globals of ``path``'s pickle outside torch's allowlist, found without unpickling ([] if unknown)."""
    import torch

    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - only for the message; the weights-only load already refused the file
        return []


def _unreadable(what: str, path: str, err: BaseException) -> ValueError:
    first = str(err).splitlines()[0][:200] if str(err) else "no detail"
    return ValueError(f"{what}: {path} is not a readable torch checkpoint ({type(err).__name__}: {first}): truncated, "
                      "or not written by torch.save. Expected a .ckpt written by jvpreg-train.")


def read_checkpoint(path: str, *, what: str, trust: bool = False, map_location: Any = "cpu",
                    mmap: bool = False) -> Dict[str, Any]:
    """``torch.load(path, weights_only=not trust)`` with :data:`SAFE_GLOBALS`, and errors that say what to do.

    Args:
        path: the checkpoint file.
        what: the caller, for messages (e.g. ``"jvpreg-eval"``).
        trust: unpickle with ``weights_only=False``: runs code from the file. Only for a file you trust.
        map_location: device to load the tensors on.
        mmap: map the tensors' storage from the file instead of reading it (zip checkpoints only; for
            checking a file that something else loads next).

    Returns:
        The checkpoint's top-level mapping.

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeCheckpointError: the file holds globals outside the allowlist (a pickle payload, or another
            program's classes); the message names them and the opt-in.
        ValueError: the file is not a readable ``torch.save`` mapping (truncated, another format).

    Example::

        >>> ckpt = read_checkpoint("outputs/train/run/checkpoints/best.ckpt", what="my script")
        >>> ckpt["state_dict"].keys()
    """
    import torch

    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no checkpoint at {path!r}.")
    mmap = bool(mmap) and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            ckpt = torch.load(path, map_location=map_location, weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = [] if trust else _unsafe_globals(path)
        detail = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "nsupported" in line), "")
        if trust or not (found or detail):
            raise _unreadable(what, path, err) from err
        refused = f"the globals {', '.join(found)}" if found else f"an object torch refuses to unpickle ({detail})"
        raise UnsafeCheckpointError(
            f"{what}: refused to open {path}: it holds {refused}, which only unpickling with code execution "
            f"can rebuild (jvpreg checkpoints hold tensors and plain values only). {TRUST_HINT}") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:
        raise _unreadable(what, path, err) from err
    if not isinstance(ckpt, Mapping):
        raise ValueError(f"{what}: {path} holds a {type(ckpt).__name__}, not a checkpoint mapping. Expected a .ckpt "
                         "written by jvpreg-train.")
    return dict(ckpt)


@contextlib.contextmanager
def lightning_loading(ckpt_path: Any, *, what: str, trust: bool = False) -> Iterator[bool]:
    """Check ``ckpt_path`` as :func:`read_checkpoint` does, then yield Lightning's ``weights_only`` flag.

    Lightning's own ``torch.load`` (``trainer.fit/test(ckpt_path=..., weights_only=...)``) runs inside the
    block with :data:`SAFE_GLOBALS` allowed. ``ckpt_path`` values that are not files (``None``, ``"last"``,
    ``"best"``, ``"hpc"``) are left to Lightning, which still loads them weights-only.

    Args:
        ckpt_path: what is given to Lightning as ``ckpt_path``.
        what: the caller, for messages.
        trust: the user's opt-in: ``weights_only=False``, no check.

    Yields:
        ``not trust``: the ``weights_only`` argument for Lightning.

    Raises:
        UnsafeCheckpointError, ValueError: as :func:`read_checkpoint`.

    Example::

        >>> with lightning_loading(cfg.ckpt_path, what="jvpreg-train") as weights_only:
        ...     trainer.fit(lit, datamodule=dm, ckpt_path=cfg.ckpt_path, weights_only=weights_only)
    """
    import torch

    if not trust and ckpt_path is not None and os.path.isfile(os.path.expanduser(str(ckpt_path))):
        read_checkpoint(ckpt_path, what=what, mmap=True)
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        yield not trust


def _walk(node: Any, where: str) -> Iterator[Tuple[str, str, Any]]:
    """``(location, key, value)`` for every mapping entry in a nested config of dicts and lists."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            loc = f"{where}.{key}"
            yield loc, str(key), value
            yield from _walk(value, loc)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _walk(value, f"{where}[{i}]")


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def check_stored_config(config: Any, *, key: str, allowed: FrozenSet[str], path: str, what: str) -> None:
    """Refuse a stored config that would call anything but ``allowed`` when instantiated.

    Every ``_target_`` in the tree must be one of ``allowed`` (compared as text: nothing is imported), the
    root must have one, no key may be one of :data:`REFUSED_KEYS`, and no string may hold an interpolation
    (``${...}``: jvpreg stores resolved configs; a resolver is code).

    Args:
        config: the stored config (plain dicts and lists), e.g. ``run_config["model"]``.
        key: its name in the run config, for messages (``"model"``).
        allowed: the ``_target_`` spellings it may use (:data:`MODEL_TARGETS`, :data:`DATA_TARGETS`).
        path: the checkpoint file, for messages.
        what: the caller, for messages.

    Raises:
        UnsafeCheckpointError: the config names something else; the message says where, what is allowed,
            and how to pass the config on the command line instead (``model=...``) or opt in.

    Example::

        >>> check_stored_config(run_config["model"], key="model", allowed=MODEL_TARGETS, path=p, what="jvpreg-eval")
    """
    fix = (f"Fix: choose the {key} on the command line ({key}=<config>, which replaces the stored one), "
           f"or: {TRUST_HINT}")
    if not isinstance(config, Mapping) or "_target_" not in config:
        raise UnsafeCheckpointError(f"{what}: the {key} config stored in {path} is not a config with a _target_ "
                                    f"(got {type(config).__name__}). {fix}")
    for loc, name, value in _walk(config, key):
        if name == "_target_" and value not in allowed:
            raise UnsafeCheckpointError(
                f"{what}: the {key} config stored in {path} names {loc}={value!r}, which jvpreg does not build "
                f"(allowed: {', '.join(sorted(allowed))}). Instantiating it could run any code. {fix}")
        if name in REFUSED_KEYS:
            raise UnsafeCheckpointError(f"{what}: the {key} config stored in {path} sets {loc}, which makes the "
                                        f"builder fetch or run code from elsewhere. {fix}")
    for text in _strings(config):
        if "${" in text:
            raise UnsafeCheckpointError(f"{what}: the {key} config stored in {path} holds an interpolation "
                                        f"{text[:80]!r}; jvpreg stores resolved configs. {fix}")
