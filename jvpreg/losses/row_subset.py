"""Row subset: carry tangents on ``b`` random rows of a batch of ``B``, so a step costs ``B + b`` rows, not ``2B``.

Clone mode stacks blocks of one shape, so a tangent block cannot have fewer rows than the primal block.
The subset therefore runs as its own primal: the model is called twice, first as the clone forward
``[x_S; x_S + s u]`` of the ``b`` subset rows, then plainly on the ``B - b`` other rows, and the two
outputs are put back in the batch's order (one output, as a plain forward returns it).

Unbiasedness: ``S`` is uniform among the ``b``-subsets and every penalty is a mean over the rows it
scores, so ``E_S[(1/b) sum_{i in S} p_i] = (1/B) sum_i p_i`` (the ``B/b`` rescaling of a sum).

Batch coupling (implementation choice). Models whose rows do not interact (MLPs, convnets in eval
mode or with GroupNorm/LayerNorm, transformers without cross-sample ops) return exactly the plain
forward. Train-mode BatchNorm normalizes each call by its own statistics (ghost batch norm with the
two groups ``S`` and the other rows; the penalty is the Jacobian of the ``b``-row batch) and its running
statistics take two momentum updates per step. Tensor arguments of the call whose first dimension is
``B`` (masks, timesteps, targets) are split with the input.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import torch
from torch.utils import _pytree as pytree

__all__ = ["check_rows", "draw", "merge", "split", "subset_size"]

Rows = Union[int, float, None]


def check_rows(where: str, rows: Any) -> Rows:
    """``rows`` as ``None`` (every row), a fraction in ``(0, 1]`` or a row count ``>= 1``, else an error naming it."""
    if rows is None:
        return None
    if isinstance(rows, bool) or not isinstance(rows, (int, float)):
        raise TypeError(f"{where}: expected row_subset to be None, a fraction in (0, 1] (float) or a row count >= 1 "
                        f"(int), got {type(rows).__name__} {rows!r}.")
    if isinstance(rows, int):
        if rows < 1:
            raise ValueError(f"{where}: expected row_subset to be a row count >= 1 (int) or a fraction in (0, 1] "
                             f"(float), got {rows!r}.")
        return rows
    if not (math.isfinite(rows) and 0.0 < rows <= 1.0):
        raise ValueError(f"{where}: expected row_subset to be a fraction in (0, 1] (float) or a row count >= 1 "
                         f"(int), got {rows!r}; pass an int for a number of rows.")
    return float(rows)


def subset_size(rows: Rows, batch: int) -> int:
    """``b``: ``ceil(f B)`` for a fraction ``f``, ``min(n, B)`` for a count ``n``, ``B`` for ``None``."""
    if rows is None:
        return batch
    if isinstance(rows, float):
        return max(1, min(batch, math.ceil(rows * batch - 1e-9)))
    return min(rows, batch)


def draw(batch: int, b: int, generator: Optional[torch.Generator], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(S, R)``: ``b`` rows drawn uniformly without replacement, and the others (both sorted)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    perm = torch.randperm(batch, generator=generator, device=gen_device)
    return perm[:b].sort().values.to(device), perm[b:].sort().values.to(device)


def split(tree: Any, batch: int, index: torch.Tensor) -> Any:
    """``tree`` with every tensor whose first dimension is ``batch`` restricted to the rows ``index``."""
    def take(v):
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch:
            return v.index_select(0, index.to(v.device))
        return v
    return pytree.tree_map(take, tree)


def merge(out_s: Any, out_r: Any, s: torch.Tensor, r: torch.Tensor) -> Any:
    """One output in the batch's order from the subset's ``out_s`` (rows ``s``) and the others' ``out_r`` (rows ``r``).

    Tensors with ``len(s)`` leading rows are interleaved back (differentiably); other leaves come from ``out_s``.
    """
    if out_r is None:
        return out_s
    order = torch.argsort(torch.cat([s, r]))
    leaves_s, spec = pytree.tree_flatten(out_s)
    leaves_r, spec_r = pytree.tree_flatten(out_r)
    if spec != spec_r:
        raise ValueError(f"row_subset: the model returned outputs of different structure for the subset ({spec}) and "
                         f"the other rows ({spec_r}); use row_subset=None for this model.")
    b = s.numel()
    merged = []
    for ls, lr in zip(leaves_s, leaves_r):
        if isinstance(ls, torch.Tensor) and ls.dim() and ls.shape[0] == b and isinstance(lr, torch.Tensor):
            merged.append(torch.cat([ls, lr]).index_select(0, order.to(ls.device)))
        else:
            merged.append(ls)
    return pytree.tree_unflatten(merged, spec)
