"""Which code path a tensor's device takes: the host's, where reading a value is free, or an accelerator's.

On the CPU the engine reads values for nothing: the scales from the norms of ``x`` and ``u``
(:func:`jvpreg.clone.api.host_scales`), whether a call's inputs are finite (a captured program then drops its
non-finite fixes), whether a difference of blocks holds a NaN; and it runs jvpreg's CPU operators (train-mode
BatchNorm written into one output). On an accelerator every read would wait for the device, so the scales are
kernels inside the program, the non-finite fixes stay wherever an infinity can reach them
(:mod:`jvpreg.clone.program.passes`), BatchNorm's primal block takes the device's own kernel and its tangent's backward
the form with fewer, larger kernels (:func:`jvpreg.clone.rules.batch_norm.few_launches`).

:func:`accelerator_path` makes CPU tensors take the accelerator's path, so that its exactness can be checked in
float64 on a machine without one (``tests/clone/test_accelerator_path.py``, ``scripts/model_zoo_sweep.py``):
everything but the device's own kernels runs as it would there. ``meta`` tensors take it too, always
(``scripts/op_counts.py`` counts its kernels there).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

__all__ = ["accelerator_path", "on_host", "simulated"]

# the setting of accelerator_path, scoped by its block like torch.no_grad (a context variable: the block's own thread
# and tasks), read outside clone forwards too: the scales are chosen before one starts
_SIMULATED = contextvars.ContextVar("jvpreg_accelerator_path", default=False)


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the host's path: a CPU tensor, outside :func:`accelerator_path`."""
    return t.device.type == "cpu" and not _SIMULATED.get()


def simulated() -> bool:
    """Inside :func:`accelerator_path` (part of a captured program's guard: each path records its own)."""
    return _SIMULATED.get()


@contextlib.contextmanager
def accelerator_path() -> Iterator[None]:
    """Inside, CPU tensors take an accelerator's code path (no value read by the host, device-side scales, the
    non-finite fixes kept, the accelerator's BatchNorm forms): the same numbers up to rounding, checked on the CPU.

    Example::

        >>> with jvpreg.clone.core.device_paths.accelerator_path():
        ...     y, t = jvpreg.jvp(model, (x,), (u,), engine="captured")  # the program a GPU would replay
    """
    token = _SIMULATED.set(True)
    try:
        yield
    finally:
        _SIMULATED.reset(token)
