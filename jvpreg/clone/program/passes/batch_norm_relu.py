"""A train-mode BatchNorm whose output only a relu reads, fused into one operator that applies the relu in place.

The BatchNorm rule and its operators are in :mod:`jvpreg.clone.rules.normalization` and
:mod:`jvpreg.clone.rules.kernels`; this pass is the part of it that needs the whole program (who reads the output).
"""
from __future__ import annotations

import operator

import torch

from jvpreg.clone.rules import kernels  # noqa: F401  (registers the operators)

__all__ = ["fuse_batch_norm_relu"]


def fuse_batch_norm_relu(graph: torch.fx.Graph) -> None:
    """``relu_blocks(batch_norm_blocks(z)[0])`` -> ``batch_norm_relu_blocks(z)``, where the relu is the BatchNorm
    output's only reader: one output written in place, as a plain BatchNorm -> ReLU(inplace=True) has, where the two
    operators keep two alive at once."""

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
