"""The engine's errors and warnings, in one place so that every floor can raise them.

``UnsupportedOpError``: an op clone mode cannot linearise exactly (the message names the op and how to register a
rule); ``BatchWriteError``: batch data written in place into a tensor made outside the batch; ``CaptureError``: a
forward that cannot be recorded as a plain program (eager clone mode runs instead); the two warnings say when the
slower exact paths run.
"""
from __future__ import annotations


class UnsupportedOpError(NotImplementedError):
    """An op that the clone engine cannot linearise exactly."""


class BatchWriteError(UnsupportedOpError):
    """An in-place write of batch data into a tensor created outside the batch (a plain tensor cannot hold
    the blocks). Every message ends with the commonest case in real models: an inference cache."""

    CACHE_HINT = (" A cache written during the forward is such a tensor (a Hugging Face model's key/value or state "
                  "cache, Mamba's cache_params): call the model with use_cache=False.")

    def __init__(self, message: str):
        super().__init__(message + self.CACHE_HINT)


class JVPFallbackWarning(UserWarning):
    """An op ran through the exact but slower ``torch.func.jvp`` fallback."""


STATE_WRITE_HINT = (" A buffer or statistic updated in the forward (an EMA) takes a value computed from detached batch "
                    "data (h.detach()): its primal value is written, as BatchNorm's running statistics are.")


class CaptureError(RuntimeError):
    """The clone forward cannot be recorded as a plain program (the eager clone mode runs instead)."""


class JVPCaptureWarning(UserWarning):
    """A clone forward runs in eager clone mode because it could not be captured; the message says why."""
