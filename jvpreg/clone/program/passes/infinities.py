"""Which values of a captured program can hold an infinity that does not come from overflow.

The analysis :func:`jvpreg.clone.program.passes.finite_fixes.drop_finite_fixes` builds on. An op's output counts as
finite when its inputs are and the op cannot make an infinity by design (:data:`_FINITE_OPS`; bounded ops such as
``tanh`` and ``softmax``, layer and group norms, a variance's ``rsqrt(var + eps)``, a block read back out of its
rule's ``stack``); a constant too large for a dtype it reaches counts as infinite there (HF's ``finfo(float64).min``
mask turns ``-inf`` in a float32 softmax). Block 0 is followed apart from the tangent blocks where ops keep dim 0
apart (:mod:`jvpreg.clone.program.passes.first_rows`).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Dict, Optional, Sequence

import torch

from jvpreg.clone.program.passes.analysis import aten_op, is_view, written
from jvpreg.clone.program.passes.first_rows import block_read, first_row, stacked_part

__all__ = ["largest_magnitude", "may_be_infinite"]


# Ops whose floating outputs are finite when their tensor inputs and number arguments are (up to
# overflow, where a difference ``inf - inf`` gives NaN: loud, never a wrong finite value; an ``empty``
# tensor is written before it is read). In-place (``relu_``) and out= overloads are covered by their names,
# :mod:`jvpreg.clone.rules.kernels`' operators by their namespace (``jvpreg``: tangents of such ops). Anything else can
# make an infinity that every block shares (``log(0)``, ``1 / 0``, ``masked_fill(m, -inf)``), so its output counts
# as non-finite.
_FINITE_OPS = frozenset("""
    linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution _convolution
    matmul mm bmm addmm addmv addbmm baddbmm mv dot einsum bilinear
    add sub rsub mul neg sum mean addcmul abs sign sgn maximum minimum where masked_fill sqrt square sin cos erf
    atan floor ceil round trunc
    relu threshold threshold_backward clamp clamp_min clamp_max hardtanh hardtanh_backward relu6 leaky_relu
    leaky_relu_backward prelu _prelu_kernel gelu gelu_backward silu sigmoid sigmoid_backward tanh tanh_backward
    hardswish hardswish_backward hardsigmoid hardsigmoid_backward elu elu_backward softplus softplus_backward mish
    batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training
    _native_batch_norm_legit_functional native_batch_norm_backward layer_norm native_layer_norm native_layer_norm_backward
    group_norm native_group_norm_backward
    native_group_norm instance_norm var var_mean softmax _softmax _softmax_backward_data log_softmax _log_softmax
    scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu
    dropout native_dropout feature_dropout
    max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices avg_pool1d avg_pool2d
    avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d
    adaptive_max_pool1d adaptive_max_pool2d upsample_nearest2d upsample_bilinear2d pixel_shuffle
    pixel_unshuffle constant_pad_nd pad embedding gather index_select
    view _unsafe_view reshape permute transpose t select slice unsqueeze squeeze expand expand_as flatten
    unflatten contiguous clone alias detach unbind split split_with_sizes chunk narrow movedim view_as cat
    stack repeat flip roll diagonal tril triu copy to _to_copy type_as lift_fresh_copy
    zeros zeros_like ones ones_like full full_like scalar_tensor arange new_zeros new_ones new_full fill
    bernoulli uniform normal rand rand_like randn randn_like randint randperm
    empty empty_like new_empty empty_strided
""".split())


_BOUNDED_OPS = frozenset("tanh sigmoid atan erf relu6 hardsigmoid softmax _softmax".split())


def _bounded(node: torch.fx.Node) -> bool:
    """``node``'s values lie in a bounded range whatever its input (an infinite input gives a finite value or NaN)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    name = target._schema.name.split("::")[-1]
    if name in ("hardtanh", "clamp"):  # hardtanh's default bounds are -1, 1; clamp needs both bounds
        if node.kwargs:
            return False  # bounds given by keyword: not read here, so not known finite
        bounds = list(node.args[1:3]) + [-1.0, 1.0][len(node.args) - 1:] if name == "hardtanh" else node.args[1:3]
        return len(bounds) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v) for v in bounds)
    return name in _BOUNDED_OPS


def _numbers(args: Any):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _numbers(a)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            yield a


def _makes_infinity(node: torch.fx.Node) -> bool:
    """``node`` may turn finite inputs into an infinity (by design, not by overflow; a constant too large for its output
    dtype is handled in :func:`may_be_infinite`)."""
    target = node.target
    if target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    if target.namespace == "jvpreg":
        return False
    name = target._schema.name.split("::")[-1].rstrip("_")
    args = list(node.args) + list(node.kwargs.values())
    if any(not math.isfinite(v) for v in _numbers(args)):
        return True
    if name in ("rsqrt", "reciprocal") and _positive(node.args[0]):
        return False  # 1 / sqrt(var + eps), BatchNorm's and LayerNorm's invstd
    if name in ("div", "pow"):  # finite for a number divisor != 0, a number exponent >= 0
        other = node.args[1] if len(node.args) > 1 else None
        ok = (lambda v: v != 0) if name == "div" else (lambda v: v >= 0)
        return not (isinstance(other, (int, float)) and ok(other) and not node.kwargs.get("rounding_mode"))
    return name not in _FINITE_OPS


_VARIANCES = ("var", "var_mean")


def _max_finite(val: Any) -> Optional[float]:
    """The largest finite magnitude of a floating tensor's dtype (``None`` for anything else)."""
    if isinstance(val, torch.Tensor) and val.is_floating_point():
        return float(torch.finfo(val.dtype).max)
    return None


def largest_magnitude(t: torch.Tensor) -> float:
    """The largest finite magnitude among the entries of a floating tensor (0 for anything else)."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
        return 0.0
    if t.is_meta:  # no values: any magnitude
        return math.inf
    a = t.detach().abs()
    return float(torch.where(torch.isfinite(a), a, 0).max())


def _positive(node: Any) -> bool:
    """``node`` is ``v + c`` with ``v`` a variance (>= 0 or NaN) and ``c`` a positive number: never 0."""
    if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.add.Tensor and len(node.args) == 2):
        return False
    v, c = node.args
    if not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 and isinstance(v, torch.fx.Node)):
        return False
    if v.target is operator.getitem and v.args[1] == 0:
        v = v.args[0]  # var_mean(...)[0]
    return isinstance(v.target, torch._ops.OpOverload) and v.target._schema.name.split("::")[-1] in _VARIANCES


def _floating(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    if isinstance(val, (list, tuple)):
        return any(map(_floating, val))
    return True  # unknown: assume it can hold an infinity


def may_be_infinite(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool],
                    input_magnitudes: Sequence[float] = ()) -> Dict[torch.fx.Node, bool]:
    """For each node: can its value hold an infinity that does not come from overflow? ``{}`` when an
    in-place write could put one into a tensor already marked finite (the analysis then gives up; a write into
    a tensor already counted as possibly infinite, such as BatchNorm's running statistics, changes nothing).

    A constant too large for a dtype it reaches makes an infinity by design, not by chance: HF's ``finfo(float64).min``
    attention mask of a float64 model, cast to float32 for the softmax, is ``-inf`` there. So the largest constant
    magnitude that can flow into each node is carried along (numbers in the arguments, ``get_attr`` tensors,
    ``input_magnitudes[i]`` for placeholder ``i``: parameters and buffers as captured; the call's data counts as 0, its
    overflow being loud), and a floating output whose dtype cannot hold it counts as possibly infinite.

    Where no op may write an infinity in place, a second pass follows block 0 on its own
    (:func:`jvpreg.clone.program.passes.first_rows.first_row`): a clone's primal block is computed from primal blocks
    only, so it can be finite where the tangent blocks of the same tensor may not be (a tangent direction read on a
    device, whose finiteness is not known)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inf = _infinities(gm, finite_inputs, input_magnitudes, order, None)
    if not inf or any(inf[n] and _read_writes(n, order) for n in gm.graph.nodes if n.op == "call_function"):
        return inf
    return _infinities(gm, finite_inputs, input_magnitudes, order, {})


def _infinities(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool], input_magnitudes: Sequence[float],
                order: Dict[torch.fx.Node, int],
                rows: Optional[Dict[torch.fx.Node, bool]]) -> Dict[torch.fx.Node, bool]:
    """:func:`may_be_infinite`'s pass (``order``: each node's position); ``rows``: ``{}`` to follow the first row
    along dim 0 too (filled in)."""
    inf: Dict[torch.fx.Node, bool] = {}
    big: Dict[torch.fx.Node, float] = {}
    i = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inf[node] = not (i < len(finite_inputs) and finite_inputs[i])
            big[node] = input_magnitudes[i] if i < len(input_magnitudes) else 0.0
            i += 1
        elif node.op == "get_attr":
            val = getattr(gm, node.target, None)
            inf[node] = not (isinstance(val, torch.Tensor) and not val.is_meta and bool(torch.isfinite(val).all()))
            big[node] = largest_magnitude(val)
        elif node.op == "call_function":
            if "val" in node.meta and not _floating(node.meta["val"]):
                inf[node], big[node] = False, 0.0
            elif (part := stacked_part(node)) is not None:  # block i of stack([b_0, b_1, ...]): b_i's
                inf[node], big[node] = inf.get(part, True), big.get(part, 0.0)
            elif _bounded(node):
                inf[node], big[node] = False, 0.0
            else:
                inputs = node.all_input_nodes
                numbers = [abs(v) for v in _numbers(list(node.args) + list(node.kwargs.values()))
                           if isinstance(v, float) and math.isfinite(v)]  # float constants: ints are sizes and dims
                big[node] = max([big.get(n, 0.0) for n in inputs] + numbers, default=0.0)
                val = node.meta.get("val")
                vals = val if isinstance(val, (list, tuple)) else [val]
                ranges = [m for m in map(_max_finite, vals) if m is not None]
                too_big = bool(ranges) and big[node] > min(ranges)
                inf[node] = too_big or not _normalised(node, inf) and (_makes_infinity(node)
                                                                      or any(inf.get(n, True) for n in inputs))
                if inf[node] and rows is not None and not too_big and not _makes_infinity(node):
                    first = block_read(node)
                    if first is not None and first[1] == 0:  # block 0 of a tensor: its first row
                        inf[node] = rows.get(first[0], True)
                if inf[node] and any(not inf.get(w, True) for w in _read_writes(node, order)):
                    return {}
            if rows is not None:
                row = first_row(node, inf, rows) if inf[node] and not _makes_infinity(node) else None
                rows[node] = inf[node] and (row is None or row)
        if rows is not None and node.op in ("placeholder", "get_attr"):
            rows[node] = inf[node]
    return inf


#: layer and group norms -> where their weight and bias are; the ``native_`` ones return (output, mean, rstd)
_NATIVE_NORMS = {op: where for op, where in ((aten_op("native_layer_norm"), slice(2, 4)),
                                              (aten_op("native_group_norm"), slice(1, 3))) if op is not None}


_NORMS = {op: slice(2, 4) for op in (aten_op("layer_norm"), aten_op("group_norm")) if op is not None}


#: batch norms: normalised by the batch's statistics in training mode (their ``training`` flag at position 5)
_BATCH_NORMS = {op: native for op, native in ((aten_op("batch_norm"), False), (aten_op("native_batch_norm"), True),
                                              (aten_op("_native_batch_norm_legit"), True)) if op is not None}


def _normalised(node: torch.fx.Node, inf: Dict[torch.fx.Node, bool]) -> bool:
    """``node`` is the output of a layer or group norm, or of a batch norm in training mode, with a finite weight and
    bias: never infinite (an infinite entry makes the statistics it is in, and so what they normalise, NaN; finite
    entries are bounded by sqrt(N) |w| + |b|)."""
    if node.target is operator.getitem:
        norm, index = node.args
        target = getattr(norm, "target", None)
        where = _NATIVE_NORMS.get(target) if index == 0 else None
        if index == 0 and _BATCH_NORMS.get(target) is True and len(norm.args) > 5 and norm.args[5] is True:
            where = slice(1, 3)
    else:
        norm, where = node, _NORMS.get(node.target)
        if _BATCH_NORMS.get(node.target) is False and len(node.args) > 5 and node.args[5] is True:
            where = slice(1, 3)
    return where is not None and not any(isinstance(a, torch.fx.Node) and inf.get(a, True) for a in norm.args[where])


def _read_writes(node: torch.fx.Node, order: Dict[torch.fx.Node, int]) -> list:
    """The tensors ``node`` writes into that the program may read afterwards: not those, themselves no view, whose
    other users all come before ``node`` and make no alias (BatchNorm's running statistics, read by the batch norm and
    then updated in place: the write reaches no reader of this call)."""
    return [w for w in written(node)
            if is_view(w) or any(u is not node and (order[u] > order[node] or is_view(u)) for u in w.users)]
