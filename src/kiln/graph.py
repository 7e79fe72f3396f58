"""Which parameters a loss reaches: read from its autograd graph, without running a backward (no
gradient the size of the model). The one answer to that question for the checks (parameters
used only in some steps) and the model zoo (model=hf's parameters a forward never reaches)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch


def graph_leaves(outputs: Iterable[torch.Tensor], first: int | None = None) -> set[int]:
    """The ids of the leaf tensors (parameters) the autograd graph of `outputs` reaches: those
    a backward would give a gradient. `first`: stop after that many, met breadth-first (the
    leaves nearest the outputs, whose gradients autograd reaches without the whole graph)."""
    queue = deque(t.grad_fn for t in outputs if t.grad_fn is not None)
    seen, leaves = set(), set()
    while queue and (first is None or len(leaves) < first):
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's
        if variable is not None:
            leaves.add(id(variable))
        queue.extend(child for child, _ in node.next_functions)
    return leaves


def reached_parameters(
    outputs: Iterable[torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]
) -> frozenset[str]:
    """The names, of `named` (model.named_parameters()), the graph of `outputs` reaches."""
    leaves = graph_leaves(outputs)
    return frozenset(name for name, p in named if id(p) in leaves)
