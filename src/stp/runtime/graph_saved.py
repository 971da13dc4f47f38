"""What a forward keeps for its backward: every tensor autograd saved in a graph.

The activation offloader (stp.runtime.offload) moves these tensors to the host
and back, and the tests count them against the cost model's census
(stp.costmodel.decoder.kept): built-in autograd nodes expose what they saved
as `_saved_*` attributes, a custom Function as its `saved_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["graph_saved"]

_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _node_saved(node: Any) -> list[torch.Tensor]:
    """Tensors autograd saved in one graph node."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return list(node.saved_tensors)  # a custom Function's ctx.save_for_backward
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = tuple(a for a in dir(node) if a.startswith("_saved_"))
        _SAVED_NAMES[type(node)] = names
    out: list[torch.Tensor] = []
    for name in names:
        value = getattr(node, name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


def graph_saved(roots: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor autograd saved in the graphs behind `roots` (documented:
    built-in nodes expose them as `_saved_*` attributes)."""
    seen: set[Any] = set()
    stack: list[Any] = [t.grad_fn for t in roots if t.grad_fn is not None]  # autograd nodes
    out: list[torch.Tensor] = []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out += _node_saved(node)
        stack += [nxt for nxt, _ in node.next_functions]
    return out
