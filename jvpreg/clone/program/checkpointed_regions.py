"""Activation checkpointing in a captured clone program: each checkpointed region replays as a checkpointed sub-program.

While a capture records a clone forward with gradients enabled (:mod:`jvpreg.clone.program.capture`), a non-reentrant
checkpoint (the reentrant form is routed to it: :mod:`jvpreg.clone.eager.checkpointing`) does not run torch's checkpoint
machinery: its region runs inline, and every node the tracer records meanwhile is tagged with the region
(:func:`recording`, :func:`tag`). After the program's passes, :func:`outline` cuts each region's span of nodes out
of the program into a sub-program and calls it through ``torch.utils.checkpoint.checkpoint(sub, *inputs,
use_reentrant=False, ...)`` with the region's own options (``preserve_rng_state``, ``context_fn``,
``determinism_check``, ...): ``(y_1, ..., y_m) = checkpoint(sub, x_1, ..., x_n)``, where the ``x_i`` are the values
the span reads from before it and the ``y_j`` those read after it. The forward saves the inputs only; the backward
recomputes the span's ops (the same recorded kernels, so the same values, RNG state restored for dropout), as a
plain checkpointed forward of the doubled batch does.

A span is the contiguous run of nodes from a region's first surviving node to its last: the program is in
topological order, so cutting any contiguous run gives the same values; the passes may move a pure op in or out
of a region, which changes what is recomputed, never a value. Nested checkpoints are recorded as part of the
outermost one. A region with no gradient recording (``torch.no_grad``) saves nothing and stays inline.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from jvpreg.clone.core.errors import CaptureError
from jvpreg.clone.core.session import current, holding

__all__ = ["Region", "CheckpointedRegion", "recording", "open_region", "tag", "outline"]

_META = "jvpreg_region"
#: checkpoint's options and their defaults (torch 2.11 takes ``preserve_rng_state`` through ``**kwargs``)
_DEFAULTS = {"preserve_rng_state": True, **{name: p.default for name, p in
                                            inspect.signature(torch_checkpoint.checkpoint).parameters.items()
                                            if p.kind is p.KEYWORD_ONLY and name != "use_reentrant"}}


@dataclass(eq=False)
class Region:
    """One checkpoint call met while capturing: the checkpoint's options other than the function and its arguments."""

    options: Dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Scope of one capture in the clone forward's session: a checkpoint with gradients runs :func:`open_region`
    (:mod:`jvpreg.clone.eager.checkpointing` asks the session), and no region is open at its start or after it (a
    failed trace leaves none open)."""
    with holding(record_checkpoint=open_region, region=None):
        yield


def open_region(options: Dict[str, Any]) -> Iterator[None]:
    """The generator torch's checkpoint drives while a capture records it (``next`` before the region's function
    runs, ``next`` after): the nodes recorded in between are the region's. A nested checkpoint joins the open one."""
    session = current()
    if session.region is not None:
        yield
        return
    # only the options that differ from checkpoint's defaults (torch.compile refuses some explicit defaults)
    session.region = Region({k: v for k, v in options.items() if k in _DEFAULTS and v is not _DEFAULTS[k]
                             and v != _DEFAULTS[k]})
    try:
        yield
    finally:
        session.region = None


def tag(node: torch.fx.Node) -> None:
    """Mark a node the tracer records with the open region (called from the capture's ``create_node``)."""
    session = current()
    if session is not None and session.region is not None:
        node.meta[_META] = session.region


class CheckpointedRegion(nn.Module):
    """``forward(*w, *x) = checkpoint(partial(run, *w), *x, use_reentrant=False, **options)``: ``run`` a region's
    sub-program, ``w`` the parameters and buffers it reads (read again at the recomputation, as a module's attributes
    are: BatchNorm's running statistics change in between), ``x`` the values of the program it reads (kept)."""

    def __init__(self, gm: torch.fx.GraphModule, run: Callable, n_slots: int, options: Dict[str, Any]):
        super().__init__()
        self.gm = gm
        self.run = run
        self.n_slots = n_slots
        self.options = dict(options)

    def forward(self, *inputs: Any) -> Any:
        run = functools.partial(self.run, *inputs[:self.n_slots]) if self.n_slots else self.run
        return torch_checkpoint.checkpoint(run, *inputs[self.n_slots:], use_reentrant=False, **self.options)


def _spans(graph: torch.fx.Graph) -> List[tuple]:
    """``(region, first, last)`` per region, in program order, ``first``/``last`` positions of its surviving nodes."""
    bounds: Dict[Region, list] = {}
    for i, node in enumerate(graph.nodes):
        region = node.meta.get(_META)
        if region is not None:
            bounds.setdefault(region, [i, i])[1] = i
    spans = sorted((first, last, region) for region, (first, last) in bounds.items())
    for (_, last, _), (first, _, _) in zip(spans, spans[1:]):
        if first <= last:

            raise CaptureError("two checkpointed regions of the program overlap after its passes")
    return [(region, first, last) for first, last, region in spans]


def _grad_after(nodes: List[torch.fx.Node], state: bool) -> bool:
    for node in nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            state = bool(node.args[0])
    return state


def outline(gm: torch.fx.GraphModule, make_run: Callable[[torch.fx.GraphModule], Callable],
            grad_enabled: bool, n_data: int) -> int:
    """Replace each checkpointed region's span of ``gm``'s nodes by a :class:`CheckpointedRegion` submodule call,
    in place; ``make_run(sub)`` gives the callable that runs a sub-program (its replay, or the sub-program itself
    for ``torch.compile``). ``grad_enabled``: the grad mode the program starts in; ``n_data``: how many of its
    placeholders are the call's data (the others are parameters and buffers). Returns the number of regions."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    slots = set(placeholders[n_data:])
    spans = _spans(graph)
    if not spans:
        return 0
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    state, done = grad_enabled, 0
    for count, (region, first, last) in enumerate(spans):
        state = _grad_after(nodes[done:first], state)
        body = nodes[first:last + 1]
        inside = set(body)
        end_state = _grad_after(body, state)
        done = last + 1
        inputs: List[torch.fx.Node] = []
        for node in body:
            for a in node.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        inputs.sort(key=lambda a: a not in slots)  # the parameters and buffers first: read through the closure
        n_slots = sum(a in slots for a in inputs)
        outputs = [n for n in body if any(order[u] > last for u in n.users)]
        sub = torch.fx.Graph()
        env: Dict[torch.fx.Node, torch.fx.Node] = {}
        for a in inputs:
            env[a] = sub.placeholder(a.name)
            env[a].meta = dict(a.meta)
        if not state:
            sub.call_function(torch._C._set_grad_enabled, (False,))  # the span starts under no_grad
        for node in body:
            env[node] = sub.node_copy(node, env.__getitem__)
            env[node].meta.pop(_META, None)
        if end_state != state:
            sub.call_function(torch._C._set_grad_enabled, (state,))  # the caller's checkpoint restores its own
        sub.output(tuple(env[n] for n in outputs))
        sub_gm = torch.fx.GraphModule(gm, sub)
        name = f"checkpointed_region_{count}"
        gm.add_submodule(name, CheckpointedRegion(sub_gm, make_run(sub_gm), n_slots, region.options))
        with graph.inserting_before(body[0]):
            call = graph.call_module(name, tuple(inputs))
            call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
            results = []
            for j, n in enumerate(outputs):
                got = graph.call_function(operator.getitem, (call, j))
                got.meta = {k: v for k, v in n.meta.items() if k != _META}
                results.append(got)
            if end_state != state:
                graph.call_function(torch._C._set_grad_enabled, (end_state,))
        for n, got in zip(outputs, results):
            n.replace_all_uses_with(got, delete_user_cb=lambda user: order.get(user, -1) > last)
        for node in reversed(body):
            graph.erase_node(node)
        state = end_state
    graph.lint()
    gm.recompile()
    return len(spans)
