"""The value guard of a captured program: the tensor values its Python read, recomputed and compared before a replay.

Where the recorded Python read a tensor's value (:mod:`jvpreg.clone.program.value_reads`) or an op's output shape
depends on values (:mod:`jvpreg.clone.program.value_shapes`), the program is exact only for calls that read the same.
:func:`split_off` moves the ops that compute those tensors into a separate *guard program*, and
:class:`ValueGuard` runs it before each replay and compares:

    replay allowed  <=>  guard(inputs)[i].tolist() == value_i  for every read i  (NaN == NaN).

A changed value sends the call to another program recorded for it (:mod:`jvpreg.clone.program.capture` keeps a few
per call signature) or records a new one. Hugging Face models read their attention mask this way
(``padding_mask.all()`` decides whether SDPA gets a mask); the guard costs the few small ops of that check, which
the eager model runs too.

A guard is sound only if recomputing its tensors before the replay gives the values the read saw. The guard program
holds the ops that compute them and every in-place write into what those ops read made before they read it (a
Mixture-of-Experts layer's ``out.index_add_(...)``, whose result the next layer routes on; alias classes,
:func:`jvpreg.clone.program.passes.analysis.alias_classes`, follow views). It cannot hold a random draw, a write into
an input (a BatchNorm buffer updated in place: the guard would update it before the replay does), or a write into
the read tensor after the read (which value did Python see?). Those make the capture fail with
:class:`~jvpreg.clone.core.errors.CaptureError` and the call run in eager clone mode, as does a read the tracer
cannot answer (a value read inside a C++ op: ``torch.full(shape, t)`` with a tensor ``t``).

The guard program checks each read as soon as it computes it and stops at the first that differs
(:class:`GuardMismatch`): the ops after a differing shape hold the recorded sizes and would fail, or broadcast, on
other ones. A read of a tensor the trace does not track (a constant made outside the forward) is not guarded: such
tensors are the program's constants.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from jvpreg.clone.core.errors import CaptureError
from jvpreg.clone.program.passes.analysis import METADATA_ONLY, alias_classes, pure, written
from jvpreg.clone.program.passes.cleanup import drop_dead
from jvpreg.clone.program.replay import replay_function
from jvpreg.clone.program.value_reads import ValueReads
from jvpreg.clone.program.value_shapes import dynamic_shapes

__all__ = ["ValueGuard", "GuardMismatch", "same", "expected_reads", "split_off"]


def same(a: Any, b: Any) -> bool:
    """``a == b`` for nested lists of numbers, with NaN equal to NaN."""
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if a == b:
        return True
    return isinstance(a, (float, complex)) and isinstance(b, (float, complex)) and _nan(a) and _nan(b)


def _nan(v: Any) -> bool:
    return math.isnan(v.real) or math.isnan(v.imag) if isinstance(v, complex) else math.isnan(v)


class GuardMismatch(Exception):
    """Raised inside a guard program at the first read whose value or shape differs from the recorded one."""

    def __init__(self, index: int, got: Any):
        super().__init__(index, got)
        self.index, self.got = index, got


_UNREAD = "<not read: an earlier value differed>"


def _checker(expected: Sequence[Tuple[str, Any]]) -> Callable:
    """The check a guard program calls on read ``i`` as soon as it is computed: a differing shape or value stops
    the program there (the ops after it hold the recorded shapes and could fail or broadcast on others)."""
    def guard_check(t: torch.Tensor, i: int) -> None:
        kind, value = expected[i]
        got = tuple(t.shape) if kind == "shape" else t.tolist()
        if not same(got, value):
            raise GuardMismatch(i, got)

    return guard_check


class ValueGuard:
    """The guard program of a captured program and what it must reproduce (module docstring): per output, a
    value (``("value", nested list)``) or, for an op whose output shape depends on its input's values, a shape
    (``("shape", tuple)``). The program checks each one as soon as it computes it (:func:`split_off`)."""

    def __init__(self, fn: Callable, expected: Sequence[Tuple[str, Any]], names: Sequence[str]):
        self.fn, self.expected, self.names = fn, tuple(expected), tuple(names)

    def read(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """What the guard program gives for ``inputs``: per output its value (nested list) or its shape; past
        the first one that differs from the recorded one, a marker that it was not read."""
        try:
            with torch.no_grad():
                self.fn(*inputs)
        except GuardMismatch as miss:  # the reads before it held their recorded values
            return tuple(v for _, v in self.expected[:miss.index]) + (miss.got,) + \
                (_UNREAD,) * (len(self.expected) - miss.index - 1)
        return tuple(v for _, v in self.expected)  # every check passed: each read saw its recorded value

    def matches(self, got: tuple) -> bool:
        """``got`` (from :meth:`read`) is what the program was recorded for."""
        return all(same(g, v) for g, (_, v) in zip(got, self.expected))


def _why_not_replayable(node: torch.fx.Node, classes: dict, inputs: set) -> Optional[str]:
    """Why a guard program cannot run ``node`` again and get its recorded result, or ``None`` when it can: a pure
    op, or a deterministic write into a tensor the program made (not into an input: the guard would change it
    before the replay)."""
    if node.op != "call_function" or node.target in METADATA_ONLY or pure(node.target):
        return None
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return f"computed by {getattr(target, '__name__', target)}, which a guard program cannot run again"
    if torch.Tag.nondeterministic_seeded in target.tags:
        return f"computed from what the forward draws at random ({target})"
    targets = list(written(node))
    if not targets and not target._schema.is_mutable:  # a batch norm in eval mode
        return None
    if targets and all(classes[w] not in inputs for w in targets):
        return None
    return f"computed from an input or buffer that the forward changes in place ({target})"


def expected_reads(gm: torch.fx.GraphModule, reads: ValueReads) -> Tuple[List[Tuple[str, Any]], List[str]]:
    """What the value guard of ``gm`` must reproduce, and a name for each: every value its Python read (the read
    tensors are ``gm``'s last outputs), then every shape that depends on values (:func:`dynamic_shapes`; their
    tensors are appended to ``gm``'s outputs here, in place)."""
    expected = [("value", v) for v in reads.values]
    names = list(reads.names)
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    for node, shape, op in dynamic_shapes(gm.graph):  # shapes the program holds: re-checked like the values read
        output.args = (list(output.args[0]) + [node],)
        expected.append(("shape", shape))
        names.append(f"the shape of {op}")
    return expected, names


def split_off(gm: torch.fx.GraphModule, expected: Sequence[Tuple[str, Any]], names: Sequence[str]) -> ValueGuard:
    """The value guard of ``gm`` (:func:`expected_reads`): the guard program that computes ``gm``'s last
    ``len(expected)`` outputs, which are taken off ``gm``, in place, run through its replay function."""
    return ValueGuard(replay_function(_split(gm, expected, names)), expected, names)


def _split(gm: torch.fx.GraphModule, expected: Sequence[Tuple[str, Any]], names: Sequence[str]) -> torch.fx.GraphModule:
    """Move the last ``len(expected)`` outputs of ``gm`` (the tensors Python read) into a new program of their
    own ops, in place; return it. The new program checks each read against ``expected`` as soon as it computes
    it and raises :class:`GuardMismatch` at the first that differs. Raises
    :class:`~jvpreg.clone.core.errors.CaptureError` if recomputing them first would not give the values the reads
    saw (module docstring)."""
    n = len(expected)

    graph = gm.graph
    out = next(node for node in reversed(graph.nodes) if node.op == "output")
    results = list(out.args[0])
    reads, kept = results[len(results) - n:], results[:len(results) - n]
    order = {node: i for i, node in enumerate(graph.nodes)}
    classes = alias_classes(graph)
    writes: dict = {}  # alias class -> the ops that write into it
    for node in graph.nodes:
        if node.op == "call_function":
            for w in written(node):
                writes.setdefault(classes[w], []).append(node)
    needed, todo = set(), [r for r in reads if isinstance(r, torch.fx.Node)]
    while todo:  # the reads' ops, and every write into what they read made before they read it
        node = todo.pop()
        if node in needed:
            continue
        needed.add(node)
        for a in node.all_input_nodes:
            todo.append(a)
            todo.extend(w for w in writes.get(classes[a], ()) if order[w] < order[node])
    inputs = {classes[node] for node in graph.nodes if node.op in ("placeholder", "get_attr")}
    what = ", ".join(sorted(set(names)))
    for r in reads:
        if isinstance(r, torch.fx.Node) and any(order[w] > order[r] for w in writes.get(classes[r], ())):
            raise CaptureError(f"its Python code reads tensor values ({what}) of a tensor that the forward changes "
                               "in place after it is made, so a guard cannot tell which value the read saw")
    for node in (n for n in graph.nodes if n in needed):
        why = _why_not_replayable(node, classes, inputs)
        if why:
            raise CaptureError(f"its Python code reads tensor values ({what}) {why}, so they cannot be re-checked "
                               "before a replay")
    sub = torch.fx.Graph()
    env = {}
    check, checks = _checker(expected), {}
    for i, r in enumerate(reads):
        checks.setdefault(r, []).append(i)
    pending = []  # reads of the inputs themselves: checked once every input is declared
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = sub.placeholder(node.name)
            pending.append(node)
            continue
        for p in pending:
            for i in checks.get(p, ()):
                sub.call_function(check, (env[p], i))
        pending = []
        if node in needed:
            env[node] = sub.node_copy(node, env.__getitem__)
            for i in checks.get(node, ()):
                sub.call_function(check, (env[node], i))
    sub.output(tuple(env[r] for r in reads))
    guard = torch.fx.GraphModule(gm, sub)
    out.args = (type(out.args[0])(kept),)
    drop_dead(graph)
    gm.recompile()
    return guard
