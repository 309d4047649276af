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

Every process that sets up a callback under an initialised process group destroys it at exit
(:func:`destroy_process_group_at_exit`): Lightning's launchers leave it to the interpreter's teardown, where gloo's
threads can drop tensors after Python is gone and the worker aborts (SIGABRT, "terminate called without an active
exception") once its work is done.
"""
from __future__ import annotations

import atexit
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from torch import nn

from ..losses.base import JVPPenalty, Term
from ..losses.sharded import is_sharded

__all__ = ["check_monitor_strategy", "check_strategy", "destroy_process_group_at_exit", "end_worker_process",
           "fsdp2_strategy", "fully_shard_blocks", "has_weight_directions", "is_fully_sharded", "unsharded_copy"]

_REFUSED = {
    "DeepSpeedStrategy": "DeepSpeed partitions and gathers parameters inside its own engine, which jvpreg does not "
                         "hook. Use strategy=ModelParallelStrategy() with fully_shard in configure_model (FSDP2), "
                         "strategy='fsdp', or strategy='ddp'.",
    "XLAFSDPStrategy": "XLA's FSDP is not supported. Use strategy='ddp' on XLA devices, or FSDP2 on GPUs.",
}


_AT_EXIT = [False]  # registered in this process


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, while Python is still alive (once per process;
    nothing when no group is initialised).

    A gloo worker that exits with its group alive can abort after its work is done: gloo's threads still hold
    tensors when the interpreter tears down, and freeing them there kills the process (SIGABRT, "terminate called
    without an active exception"; pytorch/pytorch#179291 proposed the same handler inside torch). Lightning's
    spawn launcher reports that as a failed fit."""
    if _AT_EXIT[0] or not dist.is_available() or not dist.is_initialized():
        return
    atexit.register(_destroy_process_group)
    _AT_EXIT[0] = True


def _destroy_process_group() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - at exit, a failed teardown must not turn a finished run into a failure
        pass


def end_worker_process() -> None:
    """On a worker (global rank > 0 of an initialised group) that finished its work: destroy the group, flush the
    output and end the process now, without interpreter teardown (``os._exit(0)``); nothing otherwise.

    The abort :func:`destroy_process_group_at_exit` guards against can still strike in the teardown under load (a
    CI dry run: the app's rank 1 aborted after ``trainer.test()``, and Lightning's launcher killed rank 0, which
    was still evaluating robustness). A worker writes no results (rank 0 writes the metrics and checkpoints)."""
    import os
    import sys

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        return
    _destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


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


_SHARDED = ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy", "XLAFSDPStrategy")


def check_monitor_strategy(strategy: Any, where: str) -> None:
    """``JacobianMonitor`` refuses sharded strategies: its power iteration stops after a data-dependent
    number of forwards on each rank's own batch, and under sharding every forward is a collective that
    all ranks must join (a hang)."""
    found = sorted(_names(strategy).intersection(_SHARDED))
    if found:
        raise NotImplementedError(
            f"{where}: not implemented for {type(strategy).__name__}: the power iteration stops after a "
            "data-dependent number of forwards per rank, and every forward of a sharded network is a collective "
            "all ranks must join. Monitor a DDP run, or analyse a checkpoint with jvpreg.analysis in one process.")


# --------------------------------------------------------------------------- FSDP2 for the app


def fsdp2_strategy(devices: int, num_nodes: int = 1, **kwargs: Any):
    """``ModelParallelStrategy`` for pure FSDP2 over ``devices * num_nodes`` processes (no tensor parallelism).

    Lightning's ``"auto"`` sizes make a node's devices one tensor-parallel group; data parallelism over
    every process needs ``data_parallel_size = devices * num_nodes``. ``save_distributed_checkpoint``
    defaults to ``False``: one checkpoint file, which ``jvpreg-eval`` reads.

    Example::

        >>> trainer = Trainer(accelerator="gpu", devices=4, num_nodes=2, strategy=fsdp2_strategy(4, 2))
    """
    from pytorch_lightning.strategies import ModelParallelStrategy

    where = "fsdp2_strategy(devices, num_nodes)"
    for name, value in (("devices", devices), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: expected {name} to be an int >= 1 (the count, not 'auto' or a list), "
                             f"got {value!r}.")
    kwargs.setdefault("save_distributed_checkpoint", False)
    return ModelParallelStrategy(data_parallel_size=devices * num_nodes, tensor_parallel_size=1, **kwargs)


def fully_shard_blocks(net: nn.Module, mesh: Any = None, **kwargs: Any) -> nn.Module:
    """FSDP2 with one group per child of ``net`` that holds parameters, then ``net`` itself (in place).

    One all-gather per child in forward (and one in backward for the children, which reshard after
    forward), whatever the number of tangent blocks in the batch. ``kwargs`` go to ``fully_shard``
    (``mp_policy``, ``reshard_after_forward``, ...).
    """
    from torch.distributed.fsdp import fully_shard

    for child in net.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)
    return net


def unsharded_copy(net: nn.Module, build: Callable[[], nn.Module]) -> Optional[nn.Module]:
    """A plain copy of a ``fully_shard``-ed ``net`` with its full weights on CPU, on rank 0 (``None`` elsewhere).

    A collective: every rank must call it. ``build()`` makes an unsharded network of the same architecture.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    copy = build()
    copy.load_state_dict(state)
    return copy


def is_fully_sharded(net: nn.Module) -> bool:
    """True when some parameter of ``net`` is sharded (a ``DTensor``)."""
    return any(is_sharded(p) for p in net.parameters())
