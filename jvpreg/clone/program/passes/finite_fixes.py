"""The non-finite fix of the difference form dropped where the primal block provably holds no infinity."""
from __future__ import annotations

from typing import Sequence

import torch

from jvpreg.clone.program.passes.analysis import may_write
from jvpreg.clone.program.passes.infinities import may_be_infinite

__all__ = ["drop_finite_fixes"]

_MASKED_FILL = torch.ops.aten.masked_fill.Scalar
_SUB, _ISNAN = torch.ops.aten.sub.Tensor, torch.ops.aten.isnan.default
_EQ, _AND = torch.ops.aten.eq.Tensor, torch.ops.aten.__and__.Tensor


def _nonfinite_fix(node: torch.fx.Node):
    """``(d, a)`` if ``node`` is :func:`jvpreg.clone.core.tensor.block_delta`'s fix, ``masked_fill(d, isnan(d) & (z == a),
    0)`` or, with gradients disabled, ``masked_fill(d, z == a, 0)``, with ``d = z - a``; else ``None``."""
    if node.target is not _MASKED_FILL or len(node.args) != 3 or node.args[2] != 0 or node.kwargs:
        return None
    d, m = node.args[0], node.args[1]
    if not (isinstance(d, torch.fx.Node) and d.target is _SUB and len(d.args) == 2 and not d.kwargs):
        return None
    isnan = None
    if isinstance(m, torch.fx.Node) and m.target is _AND and len(m.args) == 2:
        isnan, eq = m.args
        if not (isinstance(isnan, torch.fx.Node) and isnan.target is _ISNAN and isnan.args[0] is d):
            return None
    else:
        eq = m
    if not (isinstance(eq, torch.fx.Node) and eq.target is _EQ and tuple(eq.args) == tuple(d.args)):
        return None
    if set(d.users) != {isnan, node} - {None} or any(may_write(u) for u in node.users):
        return None  # ``d`` would alias what the fill returns: an in-place write to it would reach d's readers
    return d, d.args[1]


def drop_finite_fixes(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool],
                      input_magnitudes: Sequence[float] = ()) -> None:
    """``masked_fill(z - a, isnan(z - a) & (z == a), 0)`` -> ``z - a`` where ``a`` holds no infinity.

    The fix turns ``inf - inf`` into 0 where every block holds the same infinity (a ``-inf`` mask);
    with a finite primal ``a``, ``z == a`` and ``isnan(z - a)`` never hold together, so the masked
    fill changes nothing: four kernels per smooth op saved. ``a`` is finite when every input it depends on is
    (:func:`jvpreg.clone.program.passes.infinities.may_be_infinite`): a parameter or buffer as it was at capture
    (one that turns non-finite later gives NaN where the fix would give 0), a call's tensors as the guard checked
    them, no op on the way that makes infinities by design.
    """
    inf = None
    for node in list(gm.graph.nodes):
        match = _nonfinite_fix(node) if node.op == "call_function" else None
        if match is None:
            continue
        if inf is None:
            inf = may_be_infinite(gm, finite_inputs, input_magnitudes)
        d, a = match
        if inf and isinstance(a, torch.fx.Node) and not inf.get(a, True):
            node.replace_all_uses_with(d)
            gm.graph.erase_node(node)
