"""Graph passes over a captured clone program (:mod:`jvpreg.clone.program.capture`): fewer ops, same values.

Every pass rewrites a ``torch.fx`` graph of aten ops recorded from the eager clone forward into one
that computes the same tensors with the same gradients:

* common-subexpression and dead-code elimination (:func:`optimize`);
* the non-finite fix of :func:`jvpreg.clone.core.tensor.block_delta` dropped where the primal block provably
  holds no infinity (:func:`_drop_finite_fixes`): ``masked_fill(z - a, isnan(z - a) & (z == a), 0)`` (``z == a``
  alone with gradients disabled) is
  ``z - a`` when ``a`` is finite (no input that may hold one, no op that makes one by design on the way;
  bounded ops such as ``tanh`` and ``softmax``, layer and group norms, a variance's ``rsqrt(var + eps)`` and a
  block read back out of its rule's ``stack`` count as finite; a cast to a narrower dtype does not: HF's
  ``finfo(float64).min`` mask turns ``-inf`` in a float32 softmax). Block 0 is followed apart from the tangent
  blocks through ops that keep dim 0 apart (:func:`_first_row`): on a device, where the data's finiteness is not
  read, a transformer's smooth ops read layer-normed rows and keep no fix;
* ``op(h, expand(a))`` -> ``op(h, a)`` for pointwise ops (:func:`_drop_broadcast_expands`);
* reshape and permute chains folded (:func:`_fold_reshapes`, :func:`_fold_permutes`); casts to the dtype a
  tensor already has dropped (:func:`_drop_noop_casts`);
* block reads moved to the block: ``select(op(x, y), 0, i)`` -> ``op(select(x, 0, i), y)``
  (:func:`_hoist_selects`), ``select(slice(x))`` -> ``select(x)`` (:func:`_select_through_slices`);
* each rule's output ``[a; a + t]`` as one ``stack``: ``op(b, unsqueeze(c, 0))`` -> ``unsqueeze(op(b, c), 0)``
  (:func:`_sink_unsqueezes`), then ``cat([unsqueeze(a, 0), ...])`` -> ``stack`` (:func:`_stack_unsqueezed_cats`);
* ``add``/``mul`` with the contiguous operand first, so the result is contiguous (:func:`_contiguous_first`);
* an in-place rule's write-back ``copy_(x, f(x))`` replaced by ``f(x)`` where nothing else sees ``x``
  (:func:`_drop_copies_back`);
* one tangent's ``(1, *S)`` block against an ``S``-shaped primal squeezed, so no gradient is reduced over the
  leading 1 (:func:`_squeeze_single_blocks`); ``select`` of a size-1 dim as ``squeeze`` (:func:`_squeeze_single_selects`);
* under autograd, a tensor's primal block and tangent blocks read through one ``split`` (:func:`_split_block_reads`),
  and every entry of a dim read one by one through one ``unbind`` (:func:`_unbind_full_selects`);
* BatchNorm whose output only a relu reads, as one operator that applies the relu in place
  (:func:`_fuse_batch_norm_relu`).

The last four are about the backward: a ``select`` or a ``slice`` of a tensor has a backward that fills a zero
tensor of its full size, a ``copy_`` one that gives the old value a zero gradient, a broadcast one that reduces.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from jvpreg.clone.rules import kernels  # noqa: F401  (registers the operators)

__all__ = ["largest_magnitude", "optimize"]


def _aten(name: str, overload: str = "default") -> Any:
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


#: Ops whose schema does not mark the running statistics they update in training mode as written
#: (``native_batch_norm(..., Tensor? running_mean, Tensor? running_var, bool training, ...)``): op -> the
#: positions of ``running_mean``, ``running_var`` and of the flag that says whether they are updated.
_HIDDEN_WRITES = {op: (3, 4, 5) for op in (_aten("native_batch_norm"), _aten("batch_norm"), _aten("_batch_norm_impl_index"),
                                            _aten("cudnn_batch_norm"), _aten("miopen_batch_norm"),
                                            _aten("instance_norm")) if op is not None}

#: In-place ops that change a tensor's autograd metadata, not its values (``torch.tensor(...)`` in a forward records
#: ``detach_`` of the lifted constant): no write for the passes and guards that follow values.
_METADATA_ONLY = frozenset(op for op in (_aten("detach_"),) if op is not None)


def _pure(target: Any) -> bool:
    """An op whose result depends only on its arguments (no mutation, no randomness)."""
    if not isinstance(target, torch._ops.OpOverload):
        return target is operator.getitem
    schema = target._schema
    return (not schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
            and target not in _HIDDEN_WRITES)


def optimize(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool] = (),
             input_magnitudes: Sequence[float] = ()) -> None:
    """Run every pass on a captured program, in place, then recompile it.

    Common-subexpression elimination first: the clone rules read block 0 of the same tensor many
    times (``h[0]``); the eager engine cannot share those reads across rules, the program can.
    Conservative: the table of known values is dropped at every mutating or non-aten node, and
    random ops are never merged. ``finite_inputs[i]``: placeholder ``i`` holds finite values only (its
    primal block, for a clone), which :func:`_drop_finite_fixes` builds on; ``input_magnitudes[i]``: the largest
    finite magnitude in placeholder ``i`` (parameters and buffers; 0 for the call's data).
    """
    graph = gm.graph
    seen: Dict[Any, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if not _pure(node.target):
            seen.clear()
            continue
        try:
            key = (node.target, tuple(node.args), tuple(sorted(node.kwargs.items())))
            hash(key)
        except TypeError:
            continue
        prev = seen.get(key)
        if prev is None:
            seen[key] = node
        else:
            node.replace_all_uses_with(prev)
            graph.erase_node(node)
    _drop_finite_fixes(gm, finite_inputs, input_magnitudes)
    _drop_dead(graph)  # the fixes' isnan/eq/and: the next passes want single-use nodes
    _drop_broadcast_expands(graph)
    _fold_reshapes(graph)
    _fold_permutes(graph)
    _drop_noop_casts(graph)
    _drop_copies_back(graph)
    _hoist_selects(graph)
    _select_through_slices(graph)
    _sink_unsqueezes(graph)
    _squeeze_single_blocks(graph)
    _sink_unsqueezes(graph)
    _stack_unsqueezed_cats(graph)
    _contiguous_first(graph)
    _split_block_reads(graph)
    _unbind_full_selects(graph)
    _squeeze_single_selects(graph)
    _fuse_batch_norm_relu(graph)
    _drop_dead(graph)
    gm.recompile()


_COMMUTING = (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)


def _contiguous_first(graph: torch.fx.Graph) -> None:
    """``add(h, c)`` -> ``add(c, h)`` (and ``mul``) when ``h`` is a strided view and ``c`` a contiguous tensor of
    the same shape and dtype: the result takes its first operand's memory layout, so it is contiguous and the
    next kernels (LayerNorm, linear) need no copy. Same values: both ops commute exactly.

    (A transposed attention output plus the residual: the layout a plain forward's fused attention avoids.)"""
    for node in graph.nodes:
        if node.target not in _COMMUTING or len(node.args) != 2 or node.kwargs:
            continue
        h, c = node.args
        hv, cv = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (h, c))
        if not (isinstance(hv, torch.Tensor) and isinstance(cv, torch.Tensor)):
            continue
        # only a view with its last dim innermost (batch/sequence dims swapped): a channels-last tensor keeps
        # its layout, which the plain forward's kernels (BatchNorm's statistics included) follow
        if hv.shape == cv.shape and hv.dtype == cv.dtype and not hv.is_contiguous() and cv.is_contiguous() \
                and hv.dim() > 0 and hv.stride(-1) == 1:
            node.args = (c, h)


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Erase unused pure ops (grad-mode switches and writes stay)."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and _pure(node.target):
            graph.erase_node(node)


_EXPANDS = (torch.ops.aten.expand.default, torch.ops.aten.expand_as.default)


def _shape(node: Any):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _drop_broadcast_expands(graph: torch.fx.Graph) -> None:
    """``op(h, expand(a, h.shape))`` -> ``op(h, a)`` for pointwise ops: broadcasting does the expansion
    (same values, same gradients) without a call; rules expand block 0 to reuse fused kernels."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _EXPANDS:
            continue
        full = _shape(node)
        for user in list(node.users):
            t = user.target
            if (user.op != "call_function" or not isinstance(t, torch._ops.OpOverload)
                    or torch.Tag.pointwise not in t.tags or t._schema.is_mutable or _shape(user) != full):
                continue
            others = [a for a in user.args if isinstance(a, torch.fx.Node) and a is not node]
            if any(_shape(a) == full for a in others):
                user.replace_input_with(node, node.args[0])


_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default)


def _contiguous(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _fold_reshapes(graph: torch.fx.Graph) -> None:
    """``reshape(reshape(x, s1), s2)`` -> ``reshape(x, s2)``, and -> ``x`` when ``s2`` is ``x``'s shape.

    Rules flatten the block dim into the batch for a kernel and split it back (``(K, B, ...)`` ->
    ``(K*B, ...)`` -> ``(K, B, ...)``); consecutive layers then reshape back and forth. Only for
    contiguous sources, where every reshape is a view: the same values, gradients and aliasing.
    """
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        src = node.args[0]
        while isinstance(src, torch.fx.Node) and src.target in _RESHAPES and _contiguous(src.args[0]):
            src = src.args[0]
        if not _contiguous(src):
            continue
        if _shape(src) == _shape(node) and src.op != "placeholder":
            node.replace_all_uses_with(src)
            graph.erase_node(node)
        elif src is not node.args[0]:
            node.args = (src, *node.args[1:])




_PERMUTE = torch.ops.aten.permute.default


def _fold_permutes(graph: torch.fx.Graph) -> None:
    """``permute(permute(x, p), q)`` -> ``permute(x, [p[i] for i in q])``, and -> ``x`` for the identity
    (rules move the block dim and back around attention and normalisations): one view instead of two."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _PERMUTE or node.kwargs:
            continue
        src, q = node.args
        if not (isinstance(src, torch.fx.Node) and src.target is _PERMUTE and not src.kwargs):
            continue
        n = len(q)
        p = [d % n for d in src.args[1]]
        dims = [p[d % n] for d in q]
        if dims == list(range(n)) and src.args[0].op != "placeholder":
            node.replace_all_uses_with(src.args[0])
            graph.erase_node(node)
        else:
            node.args = (src.args[0], dims)


_TO_DTYPE = torch.ops.aten.to.dtype


def _drop_noop_casts(graph: torch.fx.Graph) -> None:
    """``to(x, dtype)`` -> ``x`` when ``x`` has that dtype: ``to`` returns ``x`` itself then (same aliasing);
    rules cast tangents to the primal's dtype for the autocast case."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _TO_DTYPE or node.kwargs or len(node.args) != 2:
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype == node.args[1]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


_SELECT, _SLICE = torch.ops.aten.select.int, torch.ops.aten.slice.Tensor


def _select_through_slices(graph: torch.fx.Graph) -> None:
    """``select(slice(x, d, start, end), d, i)`` -> ``select(x, d, start + i)`` (a block of ``x[1:]``: the same
    view of ``x``)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or len(node.args) != 3:
            continue
        src, dim, i = node.args
        if not (isinstance(src, torch.fx.Node) and src.target is _SLICE and not src.kwargs) or src.args[1:2] != (dim,):
            continue
        start = src.args[2] if len(src.args) > 2 else 0
        step = src.args[4] if len(src.args) > 4 else 1
        size = _shape(src)
        if not (isinstance(start, int) and start >= 0 and step == 1 and isinstance(i, int) and size
                and 0 <= i < size[dim]):
            continue
        node.args = (src.args[0], dim, start + i)


_BINARY = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor)


def _sink_unsqueezes(graph: torch.fx.Graph) -> None:
    """``op(b, unsqueeze(c, 0))`` -> ``unsqueeze(op(b, c), 0)`` for add/sub/mul/div when ``b`` broadcasts to ``c``'s
    shape: the same values (the leading 1 only broadcasts), one call moved, and chains of such ops end in
    one unsqueeze that :func:`_stack_unsqueezed_cats` folds into the rule's output stack."""
    shapes: Dict[torch.fx.Node, Any] = {}

    def shape(n):
        return shapes[n] if n in shapes else _shape(n)

    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _BINARY or node.kwargs or len(node.args) != 2:
            continue
        pos = [i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.target is _UNSQUEEZE
               and tuple(a.args[1:]) == (0,) and len(a.users) == 1]
        if len(pos) == 2:  # op(unsqueeze(c1, 0), unsqueeze(c2, 0)) -> unsqueeze(op(c1, c2), 0): broadcasting adds
            _sink_both(graph, node, shape, shapes)  # the same leading 1
            continue
        if len(pos) != 1:
            continue
        unsq = node.args[pos[0]]
        c, other = unsq.args[0], node.args[1 - pos[0]]
        inner = shape(c)
        if inner is None or shape(node) != (1, *inner):
            continue
        if isinstance(other, torch.fx.Node):
            o = shape(other)
            if o is None or len(o) > len(inner):
                continue
        elif not isinstance(other, (int, float)):
            continue
        args = list(node.args)
        args[pos[0]] = c
        _unsqueezed_op(graph, node, tuple(args), inner, shapes)
        graph.erase_node(unsq)



def _unsqueezed_op(graph: torch.fx.Graph, node: torch.fx.Node, args: tuple, inner: tuple,
                   shapes: Dict[torch.fx.Node, Any]) -> None:
    """Replace ``node`` by ``unsqueeze(node.target(*args), 0)``, whose inner result has shape ``inner``."""
    with graph.inserting_before(node):
        new = graph.call_function(node.target, args)
        out = graph.call_function(_UNSQUEEZE, (new, 0))
    for n in (new, out):
        n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    shapes[new], shapes[out] = inner, (1, *inner)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _sink_both(graph: torch.fx.Graph, node: torch.fx.Node, shape: Callable, shapes: Dict[torch.fx.Node, Any]) -> None:
    """``op(unsqueeze(c1, 0), unsqueeze(c2, 0))`` -> ``unsqueeze(op(c1, c2), 0)`` (see :func:`_sink_unsqueezes`)."""
    a, b = node.args
    s1, s2 = shape(a), shape(b)  # (1, *c.shape): known where the inner node's is not (made by an earlier pass)
    if s1 is None or s2 is None:
        return
    s1, s2 = s1[1:], s2[1:]
    try:
        inner = tuple(torch.broadcast_shapes(s1, s2))
    except RuntimeError:
        return
    if shape(node) != (1, *inner):
        return
    _unsqueezed_op(graph, node, (a.args[0], b.args[0]), inner, shapes)
    for u in (a, b):
        if not u.users:
            graph.erase_node(u)


def _fake_val(target: Any, args: tuple) -> Any:
    """The fake value ``target(*args)`` would record (``None`` where an argument has none or the op fails)."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
    modes = [v.fake_mode for v in vals if hasattr(v, "fake_mode")]
    if not modes or any(isinstance(a, torch.fx.Node) and v is None for a, v in zip(args, vals)):
        return None
    try:
        with modes[0]:
            return target(*vals)
    except Exception:  # a value only changes what later passes know, never what runs
        return None


def _squeeze_single_blocks(graph: torch.fx.Graph) -> None:
    """``op(t, b)`` with ``t`` of shape ``(1, *S)`` and ``b`` of shape ``S`` -> ``unsqueeze(op(squeeze(t, 0), b), 0)``
    for add/sub/mul/div: the same values, and the backward hands ``b`` its gradient as it is, where broadcasting
    made autograd reduce the leading 1 away (one full copy per op). One tangent's block against the primal: the
    difference form's ``z_1 - a`` and a rule's ``a + t``, two per normalisation. :func:`_sink_unsqueezes` then
    carries the unsqueeze to the rule's output stack."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _BINARY or node.kwargs or len(node.args) != 2:
            continue
        if node.meta.get("jvpreg_grad") is False:  # recorded without autograd: no backward to spare, two ops more
            continue
        out = _shape(node)
        if out is None or len(out) < 1 or out[0] != 1:
            continue
        pos = [i for i, a in enumerate(node.args) if _shape(a) == out]
        other = node.args[1 - pos[0]] if len(pos) == 1 else None
        if other is None or _shape(other) != out[1:]:
            continue
        t = node.args[pos[0]]
        with graph.inserting_before(node):
            if t.target is _UNSQUEEZE and tuple(t.args[1:]) == (0,):
                sq = t.args[0]  # unsqueeze(c, 0): read c
            else:
                sq = graph.call_function(_SQUEEZE, (t, 0))
                sq.meta.update({k: v for k, v in node.meta.items() if k != "val"})
                sq.meta["val"] = _fake_val(_SQUEEZE, (t, 0))
            args = list(node.args)
            args[pos[0]] = sq
            new = graph.call_function(node.target, tuple(args))
            unsq = graph.call_function(_UNSQUEEZE, (new, 0))
        for n in (new, unsq):
            n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta["val"] = _fake_val(node.target, tuple(args))
        unsq.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(unsq)
        graph.erase_node(node)


_COPY = torch.ops.aten.copy_.default


def _fresh(node: Any) -> bool:
    """``node`` is a new tensor made by an op of the program: no input, no view, no alias of an argument."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return (isinstance(src, torch.fx.Node) and isinstance(src.target, torch._ops.OpOverload)
                and not src.target._schema.is_mutable
                and all(r.alias_info is None for r in src.target._schema.returns))
    return (isinstance(node.target, torch._ops.OpOverload) and not node.target._schema.is_mutable
            and all(r.alias_info is None for r in node.target._schema.returns))


def _same_layout(a: Any, b: Any) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device and va.stride() == vb.stride())


def _drop_copies_back(graph: torch.fx.Graph) -> None:
    """``copy_(x, y)`` -> ``y`` for an in-place rule's write-back (an in-place relu: ``y = relu_blocks(x)``), when
    ``x`` is a tensor the program made (no input, no view of it made before the copy read after it), ``y`` a new
    tensor made from ``x`` and read only by the copy, both of one layout: every later read of ``x`` (or of a view
    of it) reads ``y``. The same values; the forward saves a full copy, and the backward the zero gradient that
    ``copy_`` gives ``x``'s old value and its sum with the real one (three full passes per relu)."""
    for node in [n for n in graph.nodes if n.target is _COPY]:
        if node.kwargs or len(node.args) != 2:
            continue
        x, y = node.args
        if not (isinstance(x, torch.fx.Node) and _fresh(y) and set(y.users) == {node} and _same_layout(x, y)):
            continue
        base = x
        while _written_by_self(base):
            base = base.args[0]
        if not _fresh(base):
            continue  # an input, or a view: other reads see another shape of the same memory
        cls = _aliases(base)
        same = {base}  # base and its in-place results: the tensor x itself, under other names
        for m in base.graph.nodes:
            if m in cls and _written_by_self(m) and m.args[0] in same:
                same.add(m)
        order = {n: i for i, n in enumerate(graph.nodes)}
        at = order[node]
        if any(order[m] < at and m not in same and any(order.get(u, at + 1) > at for u in m.users) for m in cls):
            continue  # a view of x made before the copy and read after it (it would read the old tensor)
        producer = y.args[0] if y.target is operator.getitem else y
        if not any(a in cls for a in producer.args if isinstance(a, torch.fx.Node)):
            continue
        for m in [m for m in same if order[m] < at]:  # x as it stood (views made later follow it)
            for u in list(m.users):
                if u is not node and order.get(u, -1) > at:
                    u.replace_input_with(m, y)
        node.replace_all_uses_with(y)
        graph.erase_node(node)


def _written_by_self(node: torch.fx.Node) -> bool:
    """An in-place op whose result is its own first argument, written (``add_``, ``copy_``)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable or not t._schema.returns:
        return False
    first, ret = t._schema.arguments[0], t._schema.returns[0]
    return (first.alias_info is not None and first.alias_info.is_write and ret.alias_info is not None
            and ret.alias_info.before_set == first.alias_info.before_set)


def _aliases(base: torch.fx.Node) -> set:
    """``base``, its views and in-place results, theirs, and so on."""
    cls, todo = {base}, [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in cls and u.op == "call_function" and _is_view(u) and u.args and u.args[0] is n:
                cls.add(u)
                todo.append(u)
    return cls


def _hoist_selects(graph: torch.fx.Graph) -> None:
    """``select(op(x, y), 0, i)`` -> ``op(select(x, 0, i), y)`` for add/sub/mul/div when only ``x`` has dim 0 (``y``
    a number or of lower rank) and the select is ``op``'s one use: a rule's ``(z[1:] - a)[0]`` for one tangent
    reads block 1 once instead of differencing every block."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or tuple(node.args[1:2]) != (0,):
            continue
        op = node.args[0]
        if not (isinstance(op, torch.fx.Node) and op.target in _BINARY and not op.kwargs and len(op.args) == 2
                and len(op.users) == 1):
            continue
        x, y = op.args
        full = _shape(op)
        if not (isinstance(x, torch.fx.Node) and full is not None and _shape(x) == full):
            continue
        if isinstance(y, torch.fx.Node):
            ys = _shape(y)
            if ys is None or len(ys) >= len(full):
                continue
        elif not isinstance(y, (int, float)):
            continue
        with graph.inserting_before(op):  # where op read x: an in-place write to x may come before the select
            part = graph.call_function(_SELECT, (x, 0, node.args[2]))
            new = graph.call_function(op.target, (part, y))
        part.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new.meta.update(part.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        graph.erase_node(op)


_CAT, _STACK, _UNSQUEEZE = torch.ops.aten.cat.default, torch.ops.aten.stack.default, torch.ops.aten.unsqueeze.default


def _stack_unsqueezed_cats(graph: torch.fx.Graph) -> None:
    """``cat([unsqueeze(a, 0), unsqueeze(b, 0)], 0)`` -> ``stack([a, b], 0)``: the clone rules' output
    ``[primal; primal + tangent]`` in one call (``stack`` is that cat, in C++)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _CAT or node.kwargs:
            continue
        parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
        if dim != 0 or not all(isinstance(p, torch.fx.Node) and p.target is _UNSQUEEZE and tuple(p.args[1:]) == (0,)
                               and len(p.users) == 1 for p in parts):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(_STACK, ([p.args[0] for p in parts], 0))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


# ------------------------------------------------------------------------- the non-finite fix, where it is moot

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


_STACK, _CAT, _UNSQUEEZE = torch.ops.aten.stack.default, torch.ops.aten.cat.default, torch.ops.aten.unsqueeze.default


def _leading(node: torch.fx.Node) -> Optional[int]:
    val = node.meta.get("val")
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() > 0 else None


def _block_read(node: torch.fx.Node) -> Optional[tuple]:
    """``(t, i)`` if ``node`` reads block ``i`` of ``t`` along dim 0: ``select(t, 0, i)``, or a one-block chunk of
    ``split_with_sizes(t, sizes, 0)`` (``squeeze``-d or not: how :func:`jvpreg.clone.api.unpack` reads the primal
    block), else ``None``."""
    if node.target is torch.ops.aten.select.int:
        return (node.args[0], node.args[2]) if node.args[1] == 0 else None
    if node.target is _SQUEEZE and node.args[1] == 0 and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
        return None
    split, j = node.args
    if split.target is not _SPLIT or (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) != 0:
        return None
    sizes = list(split.args[1])
    return (split.args[0], sum(sizes[:j])) if 0 <= j < len(sizes) and sizes[j] == 1 else None


def _stacked_part(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``b_i`` if ``node`` reads block ``i`` of ``stack([b_0, b_1, ...], 0)`` (a rule's output block:
    :func:`_block_read`), else ``None``."""
    read = _block_read(node)
    if read is None:
        return None
    src, i = read
    if not (isinstance(src, torch.fx.Node) and src.target in (_STACK, _CAT)):
        return None
    if (src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)) != 0:
        return None
    parts = list(src.args[0])
    if src.target is _CAT:  # cat of one-block parts (unsqueeze(b, 0), a + unsqueeze(d, 0)): a rule's output
        if not all(isinstance(p, torch.fx.Node) and _leading(p) == 1 for p in parts):
            return None
        parts = [p.args[0] if p.target is _UNSQUEEZE and p.args[1] == 0 else p for p in parts]
    return parts[i] if -len(parts) <= i < len(parts) and isinstance(parts[i], torch.fx.Node) else None


def _numbers(args: Any):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _numbers(a)
        elif isinstance(a, (int, float)) and not isinstance(a, bool):
            yield a


def _makes_infinity(node: torch.fx.Node) -> bool:
    """``node`` may turn finite inputs into an infinity (by design, not by overflow; a constant too large for its output
    dtype is handled in :func:`_may_be_infinite`)."""
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


def _may_be_infinite(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool],
                     input_magnitudes: Sequence[float] = ()) -> Dict[torch.fx.Node, bool]:
    """For each node: can its value hold an infinity that does not come from overflow? ``{}`` when an
    in-place write could put one into a tensor already marked finite (the analysis then gives up; a write into
    a tensor already counted as possibly infinite, such as BatchNorm's running statistics, changes nothing).

    A constant too large for a dtype it reaches makes an infinity by design, not by chance: HF's ``finfo(float64).min``
    attention mask of a float64 model, cast to float32 for the softmax, is ``-inf`` there. So the largest constant
    magnitude that can flow into each node is carried along (numbers in the arguments, ``get_attr`` tensors,
    ``input_magnitudes[i]`` for placeholder ``i``: parameters and buffers as captured; the call's data counts as 0, its
    overflow being loud), and a floating output whose dtype cannot hold it counts as possibly infinite.

    Where no op may write an infinity in place, a second pass follows block 0 on its own (:func:`_first_row`): a
    clone's primal block is computed from primal blocks only, so it can be finite where the tangent blocks of the
    same tensor may not be (a tangent direction read on a device, whose finiteness is not known)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    inf = _infinities(gm, finite_inputs, input_magnitudes, order, None)
    if not inf or any(inf[n] and _read_writes(n, order) for n in gm.graph.nodes if n.op == "call_function"):
        return inf
    return _infinities(gm, finite_inputs, input_magnitudes, order, {})


def _infinities(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool], input_magnitudes: Sequence[float],
                order: Dict[torch.fx.Node, int],
                rows: Optional[Dict[torch.fx.Node, bool]]) -> Dict[torch.fx.Node, bool]:
    """:func:`_may_be_infinite`'s pass (``order``: each node's position); ``rows``: ``{}`` to follow the first row
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
            elif (part := _stacked_part(node)) is not None:  # block i of stack([b_0, b_1, ...]): b_i's
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
                    first = _block_read(node)
                    if first is not None and first[1] == 0:  # block 0 of a tensor: its first row
                        inf[node] = rows.get(first[0], True)
                if inf[node] and any(not inf.get(w, True) for w in _read_writes(node, order)):
                    return {}
            if rows is not None:
                row = _first_row(node, inf, rows) if inf[node] and not _makes_infinity(node) else None
                rows[node] = inf[node] and (row is None or row)
        if rows is not None and node.op in ("placeholder", "get_attr"):
            rows[node] = inf[node]
    return inf


#: layer and group norms -> where their weight and bias are; the ``native_`` ones return (output, mean, rstd)
_NATIVE_NORMS = {op: where for op, where in ((_aten("native_layer_norm"), slice(2, 4)),
                                              (_aten("native_group_norm"), slice(1, 3))) if op is not None}
_NORMS = {op: slice(2, 4) for op in (_aten("layer_norm"), _aten("group_norm")) if op is not None}
#: batch norms: normalised by the batch's statistics in training mode (their ``training`` flag at position 5)
_BATCH_NORMS = {op: native for op, native in ((_aten("batch_norm"), False), (_aten("native_batch_norm"), True),
                                              (_aten("_native_batch_norm_legit"), True)) if op is not None}


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


def _apart(d: Any, rank: Optional[int]) -> bool:
    """``d`` is a known dim of a rank-``rank`` tensor other than dim 0."""
    return isinstance(d, int) and not isinstance(d, bool) and bool(rank) and d % rank != 0


def _first_row(node: torch.fx.Node, inf: Dict[torch.fx.Node, bool], rows: Dict[torch.fx.Node, bool]) -> Optional[bool]:
    """Can index 0 along dim 0 of ``node``'s value hold an infinity, from the first rows of its arguments, for ops
    that keep dim 0 apart (views that leave it in place, pointwise ops, ``linear``, batched products); ``None``
    for any other op (then: whatever its whole value may hold)."""
    target, args = node.target, node.args
    shape = _shape(node)
    rank = None if shape is None else len(shape)
    row = lambda a: isinstance(a, torch.fx.Node) and rows.get(a, True)  # noqa: E731
    whole = lambda a: isinstance(a, torch.fx.Node) and inf.get(a, True)  # noqa: E731
    src = args[0] if args and isinstance(args[0], torch.fx.Node) else None
    src_rank = None if src is None or _shape(src) is None else len(_shape(src))
    if target is operator.getitem and src is not None:
        first = _block_read(node)
        if first is not None:
            return row(first[0]) if first[1] == 0 else None
        op = src.target
        if node.args[1] == 0 and _schema_name(op) == "jvpreg::batch_norm_blocks":  # block 0: BN(a), batch statistics
            return whole(src.args[1]) or whole(src.args[2]) if len(src.args) > 2 else None
        dim = (src.args[2] if op is _SPLIT and len(src.args) > 2
               else src.args[1] if op is _UNBIND and len(src.args) > 1 else 0)
        return row(src.args[0]) if op in (_SPLIT, _UNBIND) and _apart(dim, _rank(src.args[0])) else None
    if target in (_STACK, _CAT) and rank and not node.kwargs:
        parts, d = list(args[0]), args[1] if len(args) > 1 else 0
        if _apart(d, rank):
            return any(row(p) or not isinstance(p, torch.fx.Node) for p in parts)
        first = _shape(parts[0]) if parts else None
        return (whole(parts[0]) if target is _STACK else row(parts[0])) if first and first[0] else None
    if src is None or rank is None or src_rank is None:
        return None
    if target in _KEEP_ROWS:
        return row(src)
    if node.kwargs or (target in (_SELECT, _SQUEEZE, _UNSQUEEZE, _UNFLATTEN, _PERMUTE) and len(args) < 2):
        return None
    if target in (_SELECT, _SQUEEZE):
        return row(src) if _apart(args[1], src_rank) or (target is _SELECT and args[1:] == (0, 0)) else None
    if target is _UNSQUEEZE:
        return row(src) if _apart(args[1], rank) else whole(src)
    if target is _TRANSPOSE:
        return row(src) if len(args) == 3 and _apart(args[1], src_rank) and _apart(args[2], src_rank) else None
    if target is _PERMUTE:
        return row(src) if list(args[1])[:1] == [0] else None
    if target is _UNFLATTEN:
        return row(src) if _apart(args[1], src_rank) else None
    if target in _RESHAPES:  # row-major: the same first dim keeps the first numel / shape[0] entries in row 0
        return row(src) if src_rank and rank and _shape(src)[0] == shape[0] else None
    if target is _EXPAND:
        return row(src) if src_rank == rank else whole(src)
    if target is _LINEAR:
        return row(src) or any(whole(a) for a in args[1:]) if src_rank >= 2 else None
    if target is _BMM:
        return row(src) or row(args[1])
    if target is _MM:
        return row(src) or whole(args[1])
    pointwise = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    if pointwise and not target._schema.is_mutable:
        return any(row(a) if _rank(a) == rank else whole(a) for a in node.all_input_nodes)
    return None


def _schema_name(target: Any) -> str:
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else ""


def _rank(node: Any) -> Optional[int]:
    shape = _shape(node)
    return None if shape is None else len(shape)


_UNBIND, _TRANSPOSE, _PERMUTE = torch.ops.aten.unbind.int, torch.ops.aten.transpose.int, torch.ops.aten.permute.default
_UNFLATTEN, _EXPAND = torch.ops.aten.unflatten.int, torch.ops.aten.expand.default
_LINEAR = torch.ops.aten.linear.default
_BMM, _MM = torch.ops.aten.bmm.default, torch.ops.aten.mm.default
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_KEEP_ROWS = (torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
              torch.ops.aten.detach.default)


def _read_writes(node: torch.fx.Node, order: Dict[torch.fx.Node, int]) -> list:
    """The tensors ``node`` writes into that the program may read afterwards: not those, themselves no view, whose
    other users all come before ``node`` and make no alias (BatchNorm's running statistics, read by the batch norm and
    then updated in place: the write reaches no reader of this call)."""
    return [w for w in _written(node)
            if _is_view(w) or any(u is not node and (order[u] > order[node] or _is_view(u)) for u in w.users)]


def _written(node: torch.fx.Node):
    """The argument nodes an aten op writes into (its schema's ``Tensor(a!)`` arguments, and the running
    statistics of a batch norm in training mode: :data:`_HIDDEN_WRITES`)."""
    target = node.target
    hidden = _HIDDEN_WRITES.get(target)
    if hidden is not None:
        *stats, flag = hidden
        if len(node.args) <= flag or node.args[flag] is not False:
            yield from (node.args[i] for i in stats if i < len(node.args) and isinstance(node.args[i], torch.fx.Node))
        return
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable or target in _METADATA_ONLY:
        return
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                yield value


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
    if set(d.users) != {isnan, node} - {None} or any(_writes(u) for u in node.users):
        return None  # ``d`` would alias what the fill returns: an in-place write to it would reach d's readers
    return d, d.args[1]


def _writes(node: torch.fx.Node) -> bool:
    """An aten op that may write into its arguments (the graph's other calls are getitem and grad-mode switches)."""
    return isinstance(node.target, torch._ops.OpOverload) and (node.target._schema.is_mutable
                                                               or node.target in _HIDDEN_WRITES)


def _drop_finite_fixes(gm: torch.fx.GraphModule, finite_inputs: Sequence[bool],
                       input_magnitudes: Sequence[float] = ()) -> None:
    """``masked_fill(z - a, isnan(z - a) & (z == a), 0)`` -> ``z - a`` where ``a`` holds no infinity.

    The fix turns ``inf - inf`` into 0 where every block holds the same infinity (a ``-inf`` mask);
    with a finite primal ``a``, ``z == a`` and ``isnan(z - a)`` never hold together, so the masked
    fill changes nothing: four kernels per smooth op saved. ``a`` is finite when every input it
    depends on is (:func:`_may_be_infinite`): a parameter or buffer as it was at capture (one that
    turns non-finite later gives NaN where the fix would give 0), a call's tensors as the guard
    checked them, no op on the way that makes infinities by design.
    """
    inf = None
    for node in list(gm.graph.nodes):
        match = _nonfinite_fix(node) if node.op == "call_function" else None
        if match is None:
            continue
        if inf is None:
            inf = _may_be_infinite(gm, finite_inputs, input_magnitudes)
        d, a = match
        if inf and isinstance(a, torch.fx.Node) and not inf.get(a, True):
            node.replace_all_uses_with(d)
            gm.graph.erase_node(node)


_SPLIT, _SQUEEZE = torch.ops.aten.split_with_sizes.default, torch.ops.aten.squeeze.dim


def _is_view(node: Any) -> bool:
    """``node`` may share memory with its first argument: an aten op whose schema marks a result as an alias
    (``view``, ``split``, ``add_``), or ``getitem`` of a list or of such a result. ``getitem(topk(x), 1)`` is not:
    a multi-result op's results are separate tensors unless its schema says otherwise."""
    t = getattr(node, "target", None)
    if t is operator.getitem:
        returns = _schema_returns(node.args[0])
        index = node.args[1] if len(node.args) > 1 else None
        if returns is not None and len(returns) > 1 and isinstance(index, int) and -len(returns) <= index < len(returns):
            return returns[index].alias_info is not None
        return True
    return isinstance(t, torch._ops.OpOverload) and any(r.alias_info is not None for r in t._schema.returns)


def _schema_returns(node: Any):
    """The schema's results of the aten op that made ``node``, else ``None``."""
    t = getattr(node, "target", None)
    return t._schema.returns if isinstance(t, torch._ops.OpOverload) else None


def _alias_classes(graph: torch.fx.Graph) -> Dict[torch.fx.Node, Any]:
    """Each node's alias class, as a key: a node, its views, their views, ... and back to the base share one
    (:func:`_is_view`); two reads of one result of a multi-result op share one too."""
    parent: Dict[Any, Any] = {}

    def root(n):
        while n in parent:
            n = parent[n]
        return n

    for node in graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        if _is_view(node):
            source = node.args[0]
        elif node.target is operator.getitem:
            source = (node.args[0], node.args[1] % len(_schema_returns(node.args[0])))  # one result, however read
        else:
            continue
        a, b = root(node), root(source)
        if a is not b:
            parent[a] = b
    return {n: root(n) for n in graph.nodes}


def _last_writes(graph: torch.fx.Graph) -> Dict[torch.fx.Node, int]:
    """For each node whose tensor an op writes into, with every view of it and every tensor it is a view of:
    the graph position of the last such write."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes = [(w, order[node]) for node in graph.nodes if node.op == "call_function" for w in _written(node)]
    if not writes:
        return {}
    classes = _alias_classes(graph)
    last: Dict[Any, int] = {}
    for w, i in writes:
        last[classes[w]] = max(last.get(classes[w], -1), i)
    return {n: last[c] for n, c in classes.items() if c in last}


def _split_block_reads(graph: torch.fx.Graph) -> None:
    """``z[0]``, ``z[1:]``, ``z[i]`` read under autograd -> ``squeeze``/``select`` of ``split(z, [1, K-1])``.

    Same views, one backward node: split's backward concatenates the two gradients, where a ``select`` and a
    ``slice`` each fill a zero tensor of ``z``'s full size, copy their part in, and the two are summed (three
    full-size passes more per rule, 5% of a regularized ResNet step). Only for tensors no op writes into once
    they are read (a multi-view split does not allow its base to be modified in place; an in-place ReLU's result
    read by the next layer is written before) and reads recorded in grad mode (the
    values recorded carry no ``requires_grad``; a tensor that needs none pays one view op more).
    """
    last_write = None
    for z in list(graph.nodes):
        val = z.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[0] >= 2):
            continue
        k = val.shape[0]
        head, rest, others = [], [], []
        for u in z.users:
            if u.op != "call_function" or u.kwargs or not u.meta.get("jvpreg_grad", False):
                continue
            if u.target is _SELECT and u.args[1] == 0 and isinstance(u.args[2], int):
                i = u.args[2] % k
                (head if i == 0 else others).append((u, i))
            elif (u.target is _SLICE and tuple(u.args[1:3]) == (0, 1) and len(u.args) == 4
                  and isinstance(u.args[3], int) and u.args[3] >= k):
                rest.append(u)
        if not head or not (rest or others):
            continue
        reads = {u for u, _ in head} | set(rest) | {u for u, _ in others}
        first_read = next(n for n in graph.nodes if n in reads)  # recorded under autograd, as is the split then
        if last_write is None:
            last_write = _last_writes(graph)
            order = {n: i for i, n in enumerate(graph.nodes)}
        if z in last_write and last_write[z] >= order[first_read]:
            continue
        with graph.inserting_before(first_read):
            parts = graph.call_function(_SPLIT, (z, [1, k - 1], 0))
        with graph.inserting_after(parts):
            tail = graph.call_function(operator.getitem, (parts, 1))
        with graph.inserting_after(parts):
            first = graph.call_function(operator.getitem, (parts, 0))
        with graph.inserting_after(tail):
            a = graph.call_function(_SQUEEZE, (first, 0))
        for n in (parts, first, tail, a):
            n.meta["jvpreg_grad"] = True
        for u, _ in head:
            u.replace_all_uses_with(a)
            graph.erase_node(u)
        for u in rest:
            u.replace_all_uses_with(tail)
            graph.erase_node(u)
        for u, i in others:
            with graph.inserting_before(u):
                b = graph.call_function(_SQUEEZE, (tail, 0)) if k == 2 else graph.call_function(_SELECT, (tail, 0, i - 1))
            b.meta.update(u.meta)
            u.replace_all_uses_with(b)
            graph.erase_node(u)


_UNBIND = torch.ops.aten.unbind.int
_MAX_UNBIND = 64  # selects of more entries than this stay selects (one node per entry)


def _unbind_full_selects(graph: torch.fx.Graph) -> None:
    """``z.select(d, 0)``, ..., ``z.select(d, n-1)`` read under autograd -> ``unbind(z, d)``: the same views, and one
    backward node that stacks the gradients, where each ``select`` fills a zero tensor of ``z``'s full size and
    copies its part in, and the ``n`` results are summed (``3n - 1`` full passes). Attention's ``q, k, v`` read out
    of one packed projection (``proj[0], proj[1], proj[2]``), or blocks read one by one. Same conditions as
    :func:`_split_block_reads` (no write into ``z`` once it is read)."""
    last_write = order = None
    for z in list(graph.nodes):
        val = z.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        by_dim: Dict[int, Dict[int, list]] = {}
        for u in z.users:
            if (u.op == "call_function" and u.target is _SELECT and not u.kwargs and len(u.args) == 3
                    and isinstance(u.args[1], int) and isinstance(u.args[2], int) and u.meta.get("jvpreg_grad", False)):
                d = u.args[1] % val.dim()
                by_dim.setdefault(d, {}).setdefault(u.args[2] % max(val.shape[d], 1), []).append(u)
        for d, reads in by_dim.items():
            n = val.shape[d]
            if not isinstance(n, int) or n < 2 or n > _MAX_UNBIND or set(reads) != set(range(n)):
                continue
            nodes = {u for us in reads.values() for u in us}
            first_read = next(x for x in graph.nodes if x in nodes)
            if last_write is None:
                last_write = _last_writes(graph)
                order = {x: i for i, x in enumerate(graph.nodes)}
            if z in last_write and last_write[z] >= order.get(first_read, -1):
                continue
            with graph.inserting_before(first_read):
                parts = graph.call_function(_UNBIND, (z, d))
            parts.meta["jvpreg_grad"] = True
            for i, us in sorted(reads.items()):
                with graph.inserting_after(parts):
                    part = graph.call_function(operator.getitem, (parts, i))
                part.meta.update(us[0].meta)
                for u in us:
                    u.replace_all_uses_with(part)
                    graph.erase_node(u)
            break  # one unbind per tensor


def _squeeze_single_selects(graph: torch.fx.Graph) -> None:
    """``select(z, d, 0)`` with ``z.shape[d] == 1`` -> ``squeeze(z, d)``: the same view, whose backward is a view
    too (a select's fills a zero tensor and copies the gradient in). One tangent's block read out of ``(1, ...)``."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SELECT or node.kwargs or len(node.args) != 3:
            continue
        z, d, i = node.args
        val = z.meta.get("val") if isinstance(z, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and isinstance(d, int) and -val.dim() <= d < val.dim()
                and val.shape[d] == 1 and i in (0, -1)):
            continue
        node.target, node.args = _SQUEEZE, (z, d)


def _fuse_batch_norm_relu(graph: torch.fx.Graph) -> None:
    """``relu_blocks(batch_norm_blocks(z)[0])`` -> ``batch_norm_relu_blocks(z)``, where the relu is the BatchNorm
    output's only reader: one output written in place, as a plain BatchNorm -> ReLU(inplace=True) has, where the two
    operators keep two alive at once (:mod:`jvpreg.clone.rules.kernels` gives the measured effect)."""

    bn_op, relu_op = torch.ops.jvpreg.batch_norm_blocks.default, torch.ops.jvpreg.relu_blocks.default
    fused_op = torch.ops.jvpreg.batch_norm_relu_blocks.default
    for relu in list(graph.nodes):
        if relu.op != "call_function" or relu.target is not relu_op:
            continue
        out = relu.args[0]
        if not (isinstance(out, torch.fx.Node) and out.target is operator.getitem and out.args[1] == 0
                and isinstance(out.args[0], torch.fx.Node) and out.args[0].target is bn_op and len(out.users) == 1):
            continue
        bn = out.args[0]
        if sum(1 for item in bn.users if item.args[1] == 0) != 1:  # another read of the output would see the relu
            continue
        with graph.inserting_before(bn):
            fused = graph.call_function(fused_op, bn.args, bn.kwargs)
        for item in list(bn.users) + list(relu.users):  # bn's (out, mean, ...) -> 0, 2, ...; relu's (out, keep) -> 0, 1
            k = item.args[1]
            with graph.inserting_before(item):
                new = graph.call_function(operator.getitem, (fused, k if item.args[0] is relu or k == 0 else k + 1))
            new.meta.update(item.meta)
            item.replace_all_uses_with(new)
        for node in [*relu.users, relu, *bn.users, bn]:
            if not node.users:
                graph.erase_node(node)
