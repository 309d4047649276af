"""Generic clean-ups of a captured program: repeated pure ops shared, unused ones dropped."""
from __future__ import annotations

from typing import Any, Dict

import torch

from jvpreg.clone.program.passes.analysis import pure

__all__ = ["share_repeated_ops", "drop_dead"]


def share_repeated_ops(graph: torch.fx.Graph) -> None:
    """Common-subexpression elimination: a pure op called again with the same arguments reads the first call's result.

    The clone rules read block 0 of the same tensor many times (``h[0]``); the eager engine cannot share those reads
    across rules, the program can. Conservative: the table of known values is dropped at every mutating or non-aten
    node, and random ops are never merged."""
    seen: Dict[Any, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if not pure(node.target):
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


def drop_dead(graph: torch.fx.Graph) -> None:
    """Erase unused pure ops (grad-mode switches and writes stay)."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and pure(node.target):
            graph.erase_node(node)
