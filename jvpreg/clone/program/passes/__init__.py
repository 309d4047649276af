"""Graph passes over a captured clone program (:mod:`jvpreg.clone.program.capture`): fewer ops, same values.

Every pass rewrites a ``torch.fx`` graph of aten ops recorded from the eager clone forward into one that computes
the same tensors with the same gradients. :func:`optimize` runs them in order:

* repeated pure ops shared, unused ones dropped (:mod:`.cleanup`);
* the non-finite fix of :func:`jvpreg.clone.core.tensor.block_delta` dropped where the primal block provably holds
  no infinity (:mod:`.finite_fixes`, on the analysis of :mod:`.infinities` and :mod:`.first_rows`);
* broadcasts instead of ``expand``, reshape and permute chains folded, no-op casts dropped, the contiguous operand
  first (:mod:`.layout`);
* an in-place rule's write-back ``copy_`` dropped where nothing else sees the old tensor (:mod:`.write_backs`);
* block reads moved to the block and, under autograd, read through one ``split`` or ``unbind`` (:mod:`.block_reads`);
* each rule's output ``[a; a + t]`` as one ``stack``, one tangent's block squeezed (:mod:`.block_stacks`);
* a BatchNorm whose output only a relu reads fused with it (:mod:`.batch_norm_relu`).

What the passes know about reads, writes and aliases is in :mod:`.analysis` (the value guards use it too);
:func:`largest_magnitude` is what the capture tells :func:`optimize` of the parameters and buffers.
"""
from __future__ import annotations

from typing import Sequence

import torch

from jvpreg.clone.program.passes.batch_norm_relu import fuse_batch_norm_relu
from jvpreg.clone.program.passes.block_reads import (hoist_selects, select_through_slices, split_block_reads,
                                                     squeeze_single_selects, unbind_full_selects)
from jvpreg.clone.program.passes.block_stacks import sink_unsqueezes, squeeze_single_blocks, stack_unsqueezed_cats
from jvpreg.clone.program.passes.cleanup import drop_dead, share_repeated_ops
from jvpreg.clone.program.passes.finite_fixes import drop_finite_fixes
from jvpreg.clone.program.passes.infinities import largest_magnitude
from jvpreg.clone.program.passes.layout import (contiguous_first, drop_broadcast_expands, drop_noop_casts,
                                                fold_permutes, fold_reshapes)
from jvpreg.clone.program.passes.write_backs import drop_copies_back

__all__ = ["optimize", "largest_magnitude"]


def optimize(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool] = (),
             input_magnitudes: Sequence[float] = ()) -> None:
    """Run every pass on a captured program, in place, then recompile it.

    ``finite_inputs[i]``: placeholder ``i`` holds finite values only (its primal block, for a clone), which
    :func:`.finite_fixes.drop_finite_fixes` builds on; ``input_magnitudes[i]``: the largest finite magnitude in
    placeholder ``i`` (parameters and buffers; 0 for the call's data).
    """
    graph = gm.graph
    share_repeated_ops(graph)
    drop_finite_fixes(gm, finite_inputs, input_magnitudes)
    drop_dead(graph)  # the fixes' isnan/eq/and: the next passes want single-use nodes
    drop_broadcast_expands(graph)
    fold_reshapes(graph)
    fold_permutes(graph)
    drop_noop_casts(graph)
    drop_copies_back(graph)
    hoist_selects(graph)
    select_through_slices(graph)
    sink_unsqueezes(graph)
    squeeze_single_blocks(graph)
    sink_unsqueezes(graph)
    stack_unsqueezed_cats(graph)
    contiguous_first(graph)
    split_block_reads(graph)
    unbind_full_selects(graph)
    squeeze_single_selects(graph)
    fuse_batch_norm_relu(graph)
    drop_dead(graph)
    gm.recompile()
