"""Parameter clones under FSDP2 (``fully_shard``): swap the *unsharded* weight, inside the forward.

A weight-space direction ``U`` replaces a parameter ``W`` by the clone ``[W; W + s U_1; ...]`` for one
forward (docs/design.md §1, "swapped layer weight"). Under FSDP2 a managed parameter is a sharded
``DTensor`` between forwards: the pre-forward hook of the ``fully_shard``-ed module that manages it
all-gathers the group and registers the unsharded tensors on the submodules, its post-forward hook
registers the shards again. So the clone is built from the unsharded ``W`` after FSDP's pre-forward
(FSDP prepends its pre-hook; ours is appended) and removed before its post-forward (ours is
prepended). Its gradient reaches the unsharded ``W``, which FSDP reduce-scatters as for any use of
``W``; the one all-gather of the group serves every block. The clone is kept for backward like any
activation: ``(k + 1)`` times the perturbed weights' size.

The scale ``s`` is chosen before the forward, from the local shard of ``W`` and the matching rows of
``U`` (no collective). It only sets rounding (api module docstring), never the JVP's value.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator, List, Tuple

import torch
from torch import nn

from ..clone import clone_of, is_clone, swapped_tensors

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    DTensor, Replicate, Shard = (), (), ()
try:  # torch >= 2.6; older FSDP2 lived in torch.distributed._composable.fsdp
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover
    try:
        from torch.distributed._composable.fsdp import FSDPModule
    except ImportError:
        FSDPModule = ()

__all__ = ["check_sharding", "check_swappable", "is_sharded", "may_be_sharded", "managing_module", "scale_pair", "swapped_unsharded"]

_CHECKED: "weakref.WeakKeyDictionary[nn.Module, frozenset]" = weakref.WeakKeyDictionary()


def is_sharded(p: torch.Tensor) -> bool:
    """True for a ``DTensor`` parameter (sharded by FSDP2 or another ``torch.distributed.tensor`` plan)."""
    return bool(DTensor) and isinstance(p, DTensor)


def may_be_sharded() -> bool:
    """Whether a ``DTensor`` parameter can exist in this process: its device mesh needs an initialised process group
    (so a single process that never initialised one skips the walk over the named parameters)."""
    return bool(DTensor) and torch.distributed.is_available() and torch.distributed.is_initialized()


def managing_module(model: nn.Module, name: str) -> Tuple[str, nn.Module]:
    """``(path, module)`` whose forward sees parameter ``name`` unsharded: the ``fully_shard``-ed module
    that manages it, else ``model`` itself (its manager is then an ancestor of ``model``).

    ``fully_shard`` of a module takes the parameters its ``fully_shard``-ed descendants have not taken,
    so the manager is the longest prefix of ``name`` whose module is an ``FSDPModule``.
    """
    parts = name.split(".")[:-1]
    for n in range(len(parts), 0, -1):
        path = ".".join(parts[:n])
        mod = model.get_submodule(path)
        if FSDPModule and isinstance(mod, FSDPModule):
            return path, mod
    return "", model


def check_sharding(model: nn.Module, named: Dict[str, torch.Tensor], where: str) -> None:
    """Refuse ``DTensor`` parameters whose placements FSDP2 does not produce (tensor parallelism).

    FSDP2 shards a parameter once, on dim 0 (``Shard(0)``; ``Replicate`` on HSDP's replica dim).
    Other placements mean tensor-parallel layers, whose hooks turn activations into ``DTensor``\\ s,
    which clone batches are not: NotImplementedError. (A tensor-parallel layer whose weights happen to
    look like FSDP2's fails in its first hook instead, naming ``DTensor.from_local``.) The check runs
    once per model and set of sharded names.
    """
    names = frozenset(n for n, p in named.items() if is_sharded(p))
    if not names or _CHECKED.get(model) == names:
        return
    for name in sorted(names):
        pl = named[name].placements
        shards = [q for q in pl if isinstance(q, Shard)]
        if not (all(isinstance(q, (Shard, Replicate)) for q in pl) and len(shards) <= 1
                and all(q.dim == 0 for q in shards)):
            raise NotImplementedError(
                f"{where}: parameter {name!r} is a DTensor with placements {tuple(pl)} that fully_shard (FSDP2) "
                "does not produce (tensor parallelism?); clone mode is only implemented for plain and "
                "FSDP2-sharded parameters. Use FSDP2 without tensor parallelism (e.g. ModelParallelStrategy("
                "data_parallel_size=<world size>, tensor_parallel_size=1)), or DDP.")
    _CHECKED[model] = names


def check_swappable(name: str, p: torch.Tensor, where: str) -> None:
    """Refuse a weight direction on a parameter flattened by FSDP1 (``FullyShardedDataParallel``).

    FSDP1 writes its original parameters back into its flat parameter before each forward and
    re-registers views of it inside its own ``forward``: a swapped clone would be written back (an
    error) or replaced. NotImplementedError naming FSDP2 as the fix.
    """
    if getattr(p, "_fsdp_flattened", False):
        raise NotImplementedError(
            f"{where}: parameter {name!r} belongs to a FullyShardedDataParallel (FSDP1) flat parameter; weight-space "
            "directions are only implemented for plain and FSDP2 (fully_shard) parameters. Shard with "
            "torch.distributed.fsdp.fully_shard (Lightning: ModelParallelStrategy), or use input directions only.")


def scale_pair(p: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(value, directions)`` standing for ``(p, u)`` in the scale choice: a sharded ``p``'s local shard
    with the rows of ``u`` (``(k, *p.shape)``) that shard covers (FSDP2's ``Shard(d)``: ``torch.chunk``)."""
    if not is_sharded(p):
        return p, u
    local = p.to_local()
    k = u.shape[0]
    mesh, placements = p.device_mesh, p.placements
    if mesh.ndim == 1 and isinstance(placements[0], Shard):
        chunks = u.chunk(mesh.size(), dim=placements[0].dim + 1)
        rank = mesh.get_local_rank()
        if rank < len(chunks) and tuple(chunks[rank].shape[1:]) == tuple(local.shape):
            return local, chunks[rank]
    flat = u.reshape(k, -1)[:, : local.numel()]  # other layouts: a same-size sample of u's entries
    return local.reshape(-1)[: flat.shape[1]], flat


@contextlib.contextmanager
def swapped_unsharded(model: nn.Module, directions: Dict[str, torch.Tensor], scales: torch.Tensor,
                      where: str = "jvpreg.losses") -> Iterator[None]:
    """Context in which every forward of ``model`` sees ``[W; W + s_1 U_1; ...]`` for the sharded ``W``
    named in ``directions`` (``{name: (k, *W.shape)}``), built from the unsharded ``W`` of each call.

    Raises:
        NotImplementedError: a ``DTensor`` parameter still sharded inside the forward (no FSDP2 manager).
        RuntimeError: on exit, a managing module that was never called (its weights stayed unperturbed).
    """
    groups: Dict[str, Tuple[nn.Module, List[Tuple[nn.Module, str, torch.Tensor]]]] = {}
    for name, u in directions.items():
        path, manager = managing_module(model, name)
        owner_path, _, leaf = name.rpartition(".")
        groups.setdefault(path, (manager, []))[1].append((model.get_submodule(owner_path), leaf, u))

    handles: list = []
    saved = {path: contextlib.ExitStack() for path in groups}  # the swaps of each managing module, undone on exit
    clones: Dict[int, torch.Tensor] = {}  # id(unsharded W) -> its clone, one per context
    called = set()

    def swap(path: str) -> None:
        manager, items = groups[path]
        replace = {}
        for owner, leaf, u in items:
            w = owner._parameters[leaf]
            if is_clone(w):
                continue  # swapped already (nested call)
            if is_sharded(w):
                raise NotImplementedError(
                    f"{where}: parameter {leaf!r} of {type(owner).__name__} is still a sharded DTensor when "
                    f"{type(manager).__name__} runs: no fully_shard-ed module around this forward unshards it "
                    "(tensor parallelism, or a fully_shard-ed ancestor whose forward is not running). Weight "
                    "directions need FSDP2 alone, with the regularized module called inside its manager's forward.")
            if id(w) not in clones:
                clones[id(w)] = clone_of(w, u.to(device=w.device, dtype=w.dtype), scales)
            replace[w] = clones[id(w)]
        saved[path].enter_context(swapped_tensors(manager, replace))  # tied uses included
        called.add(path)

    def restore(path: str) -> None:
        saved[path].close()

    for path, (manager, items) in groups.items():
        handles.append(manager.register_forward_pre_hook(lambda m, a, k, path=path: swap(path), with_kwargs=True))
        handles.append(manager.register_forward_hook(lambda m, a, o, path=path: restore(path), prepend=True,
                                                     always_call=True))
        if not any(is_sharded(owner._parameters[leaf]) for owner, leaf, _ in items):
            swap(path)  # unsharded already: entered from a hook that runs after FSDP's pre-forward
    try:
        yield
    finally:
        for path in groups:
            restore(path)
        for h in handles:
            h.remove()
    missed = sorted(p or "<the regularized module>" for p in groups if p not in called)
    if missed:
        raise RuntimeError(f"{where}: the fully_shard-ed module(s) {', '.join(missed)} managing the perturbed "
                           "parameters were not called during the forward, so their weight directions were not "
                           "applied. Call those modules (not their parameters) in forward.")
