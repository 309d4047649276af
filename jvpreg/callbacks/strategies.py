"""Which Lightning strategies the regularizer callbacks run under, checked once at ``setup``.

* Single device, DDP (all variants): supported; gradients of the one graph are all-reduced as usual.
* ``ModelParallelStrategy`` with FSDP2 (``fully_shard`` in ``configure_model``): supported. The
  clone batch rides through FSDP2's hooks (one all-gather per group serves every block), weight
  directions are cloned from the unsharded weights inside the forward (:mod:`jvpreg.losses.sharded`).
  Tensor parallelism is refused at the first step (:func:`jvpreg.losses.sharded.check_sharding`):
  its layers turn activations into ``DTensor``\\ s, which clone batches are not.
* ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``): input directions are supported (the
  clone batch is an ordinary input to FSDP1's forward, its backward hooks fire on the clone
  outputs). Weight directions are refused: FSDP1 re-registers views of its flat parameter inside
  its own ``forward``, after any hook could swap a weight, so a swapped weight would be silently
  replaced. Use ``ModelParallelStrategy`` (FSDP2) for weight directions.
* DeepSpeed and XLA's FSDP: refused (untested; DeepSpeed partitions parameters in its own engine).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..losses.base import JVPPenalty, Term

__all__ = ["check_strategy", "has_weight_directions"]

_REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed partitions and gathers parameters inside its own engine, which jvpreg does not "
                         "hook. Use strategy=ModelParallelStrategy() with fully_shard in configure_model (FSDP2), "
                         "strategy='fsdp', or strategy='ddp'.",
    "XLAFSDPStrategy": "XLA's FSDP is not supported. Use strategy='ddp' on XLA devices, or FSDP2 on GPUs.",
}


def has_weight_directions(penalty: JVPPenalty) -> bool:
    """True when ``penalty`` overrides :meth:`JVPPenalty.param_directions` (weight-space tangents)."""
    return type(penalty).param_directions is not JVPPenalty.param_directions


def _names(strategy: Any) -> set:
    return {c.__name__ for c in type(strategy).__mro__}


def check_strategy(strategy: Any, terms: Sequence[Term], where: str) -> None:
    """Raise ``NotImplementedError`` (naming the fix) for a strategy the penalties ``terms`` cannot run under."""
    names = _names(strategy)
    got = type(strategy).__name__
    for refused, fix in _REFUSED.items():
        if refused in names:
            raise NotImplementedError(f"{where}: not implemented for {got}. {fix}")
    if "FSDPStrategy" in names:
        weighted = [type(p).__name__ for p, _, _ in terms if has_weight_directions(p)]
        if weighted:
            raise NotImplementedError(
                f"{where}: weight-space directions ({', '.join(weighted)}) are not implemented for FSDPStrategy "
                "(FSDP1 re-registers its flat parameter's views inside its forward, so a swapped weight would be "
                "silently replaced). Use strategy=ModelParallelStrategy() with fully_shard in configure_model (FSDP2), "
                "or input-direction penalties only.")
