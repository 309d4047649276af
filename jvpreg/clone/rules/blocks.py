"""The block layout in and out of a rule: the one place where rules split their inputs and stack their outputs.

A rule sees a clone argument as its physical ``(K, *L)`` batch (:mod:`jvpreg.clone.core.tensor` states the layout):
block 0 is the primal ``a``, block ``j >= 1`` is ``z_j = a + s_j u_j``. It reads ``a`` and the differences
``d_j = z_j - a`` with :func:`split` (or, for an argument that may be a constant, :func:`primal` and :func:`tangents`),
or the blocks ``z_j`` themselves for a formula linear in them, and returns
``assemble(out_a, t)`` = ``[out_a; out_a + t_1; ...]``: block 0 is what a plain forward of the primal computes, the
other blocks carry the difference form's tangents ``J d_j``.
"""
from __future__ import annotations

from typing import Any

import torch

from jvpreg.clone.core.tensor import (CloneTensor, block_delta, each_block, is_clone, kept_primal, stack_blocks, tile,
    varies)

__all__ = ["align", "as_batch", "assemble", "count", "each_block", "primal", "split", "stacked", "tangents"]


def count(*xs: Any) -> int:
    """``K``, the number of blocks of the first clone among ``xs``."""
    return next(x.shape[0] for x in xs if is_clone(x))


def split(z: torch.Tensor, *, differences: bool = True, nonfinite: bool = True, kept: bool = False) -> tuple:
    """``(a, d)``: the primal block of a physical ``(K, ...)`` batch and its differences ``d = z[1:] - a``; with
    ``differences=False``, ``(a, z[1:])``, the blocks ``z_j`` themselves, for a formula linear in them (a gather at
    the primal's indices, a product with a constant), which gives ``out_a + t_j`` directly (:func:`assemble`'s
    ``blocks``).

    ``nonfinite=False``: the plain difference, for a formula whose output is NaN wherever the primal is not finite
    (else an infinity shared by every block has difference 0: :func:`jvpreg.clone.core.tensor.block_delta`).
    ``kept``: ``a`` is what the rule's ops keep for backward (:func:`jvpreg.clone.core.tensor.kept_primal`: a copy
    under autograd, not a view that holds every block alive); ``d`` is taken against it."""
    a = kept_primal(z) if kept else z[0]
    if not differences:
        return a, z[1:]
    return a, block_delta(z[1:], a, nonfinite=nonfinite)


def primal(x: Any, *, kept: bool = False, memory_format: torch.memory_format = torch.preserve_format) -> Any:
    """The primal block of a clone argument; any other argument (a constant, a weight, ``None``) as it is.
    ``kept``: a copy under autograd (:func:`split`), in ``memory_format``."""
    if type(x) is not CloneTensor:
        return x
    return kept_primal(x, memory_format) if kept else x[0]


def tangents(x: Any, *, nonfinite: bool = True) -> torch.Tensor | None:
    """The differences ``d`` of a clone argument that carries tangents (:func:`split`); ``None`` for a constant or
    state (zero tangent)."""
    return block_delta(x[1:], x[0], nonfinite=nonfinite) if varies(x) else None


def assemble(out_a: torch.Tensor | None = None, tangent: torch.Tensor | None = None, *,
             blocks: torch.Tensor | None = None, k: int | None = None,
             every_block: torch.Tensor | None = None) -> torch.Tensor:
    """A rule's physical output, in the block layout of its inputs:

    * ``assemble(out_a, t)``: ``[out_a; out_a + t_1; ...]``, ``t`` of shape ``(K-1, *out_a.shape)`` (or broadcasting
      to it);
    * ``assemble(out_a, blocks=r)``: ``[out_a; r_1; ...]``, where the formula gave ``r_j = out_a + t_j`` itself;
    * ``assemble(out_a, k=K)``: ``out_a`` in each of ``K`` blocks (zero tangent: state, or an output that does not
      depend on the batch);
    * ``assemble(every_block=y)``: ``y``, an output one op computed for every block at once (a fused kernel that
      takes its pattern from block 0, an affine map applied to every block), which a split and a stack would only
      copy.

    The stack keeps ``out_a``'s memory layout in every block (:func:`jvpreg.clone.core.tensor.stack_blocks`)."""
    if every_block is not None:
        return every_block
    if blocks is not None:
        return stack_blocks(out_a, blocks)
    if tangent is not None:
        return stack_blocks(out_a, out_a + tangent)
    return tile(out_a, k)


def as_batch(t: torch.Tensor, k: int) -> torch.Tensor:
    """A constant ``t`` seen as a physical batch of ``k`` equal blocks (zero tangent): a view, for ops that read the
    blocks and keep none (:func:`assemble`'s ``k`` form materialises them, for an output)."""
    return t.unsqueeze(0).expand(k, *t.shape)


def stacked(parts: list) -> torch.Tensor:
    """The ``(K-1, ...)`` tangents of a formula computed one tangent at a time: ``torch.stack(parts)``, without its
    copy for the usual single tangent (a view of a fresh tensor)."""
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


def align(flat: list, idx: list) -> list:
    """``flat`` with the clones at positions ``idx`` given singleton dims after the block dim, so that clones and
    constants broadcast by their logical shapes (a ``(K, 3)`` clone against a ``(2, 3)`` one or a ``(2, 3)`` tensor)."""
    nd = 0
    for v in flat:
        if isinstance(v, torch.Tensor):
            nd = max(nd, v.dim() - 1 if type(v) is CloneTensor else v.dim())
    out = list(flat)
    for i in idx:
        p = flat[i]
        ln = p.dim() - 1
        if ln < nd:
            out[i] = p.reshape(p.shape[0], *([1] * (nd - ln)), *p.shape[1:])
    return out
