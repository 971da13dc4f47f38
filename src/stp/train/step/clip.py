"""The global gradient norm over a pp x tp x dp mesh, and clipping by it.

The norm is the L2 norm of the whole model's gradient, as one process holding
every parameter would compute it (torch.nn.utils.clip_grad_norm_):

    norm^2 = sum over parameters P of sum over elements of grad(P)^2

Each rank adds the squares of what it alone must count, then one SUM
all-reduce over the world gives every rank the same norm. A gradient is
counted by the lowest global rank holding it:

    - a TP-sharded parameter: every TP rank counts its own shard (the shards
      are disjoint boxes of the full tensor);
    - a TP-replicated parameter (RMSNorm gains, a kv head shared by several
      TP ranks): one TP rank, the others hold the same values;
    - a tied embedding and head, held by two pipeline ranks and given the
      same summed gradient: once;
    - DP replicas: DP rank 0, after the DP all-reduce made them equal.

The sum runs in float64 so that squares of bf16/fp32 gradients neither
overflow nor lose the small ones. Clipping multiplies every gradient by
min(1, max_norm / (norm + 1e-6)), torch's coefficient, the same number on
every rank because the norm is. A norm that is inf or NaN means some rank
holds a non-finite gradient; every rank sees it and skips the update.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["counted_mask", "grad_norm", "global_norm", "clip_coefficient", "scale_grads"]

_EXACT_TENSOR_FACTOR = (torch.float32, torch.float64)
"""Gradient dtypes a 0-dim factor of their own dtype multiplies to the bits a Python float
does (not bf16 / fp16: there the two round differently)."""

EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s guard against dividing by a zero norm."""


def counted_mask(
    keys: Sequence[Hashable], *, rank: int,
    gather: Callable[[list[object], object], None] | None = None,
) -> list[bool]:
    """For each local gradient: does this rank add its squares to the norm?

    `keys[i]` identifies gradient i (stp.train.checkpoint.shards.norm_key: parameter name
    and box); ranks holding equal keys hold equal gradients, and the lowest
    global rank among them counts it. `gather` (all_gather_object over the
    world) collects every rank's keys; None in a world of one."""
    owner: dict[Hashable, int] = {}
    if gather is not None:
        every: list[Any] = [None] * dist.get_world_size()  # (rank, keys) of each rank
        gather(every, (rank, list(keys)))
        for item in every:
            holder, held = item
            for key in held:
                owner[key] = min(owner.get(key, holder), holder)
    seen: set[Hashable] = set()
    mask = []
    for key in keys:
        mask.append(owner.get(key, rank) == rank and key not in seen)
        seen.add(key)
    return mask


def global_norm(
    grads: Sequence[torch.Tensor], counted: Sequence[bool],
    world_sum: Callable[[torch.Tensor], None] | None,
) -> torch.Tensor:
    """The global L2 norm (module doc) as a float64 scalar tensor on the gradients'
    device, not read: the trainer reads it with the step's loss in one host sync
    (stp.train.step.grad_sync). `world_sum` all-reduces a float64 scalar in place over
    the world (None in a world of one). Collective."""
    mine = [g for g, c in zip(grads, counted, strict=True) if c]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    if mine:
        # one multi-tensor call: each norm as torch.linalg.vector_norm(g, dtype=float64)
        norms = torch.stack(torch._foreach_norm(mine, 2, dtype=torch.float64))
        total = total + norms.pow(2).sum()
    if world_sum is not None:
        world_sum(total)
    return total.sqrt()


def grad_norm(
    grads: Sequence[torch.Tensor], counted: Sequence[bool],
    world_sum: Callable[[torch.Tensor], None] | None,
) -> float:
    """`global_norm`, read as a Python float. Collective."""
    return float(global_norm(grads, counted, world_sum))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """min(1, max_norm / (norm + 1e-6)): torch.nn.utils.clip_grad_norm_'s factor."""
    return min(1.0, max_norm / (norm + EPS))


def scale_grads(grads: Sequence[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place (torch multiplies even by 1.0; so do we, so
    that a clipped run and torch's agree bit for bit)."""
    if not grads:
        return
    grads = list(grads)
    dtype = grads[0].dtype
    if (grads[0].device.type == "cpu" and dtype in _EXACT_TENSOR_FACTOR
            and all(g.dtype == dtype for g in grads)):
        # torch's CPU foreach runs tensor by tensor and turns a Python scalar into a
        # tensor and a cast each time (5 aten ops a gradient); a 0-dim tensor of the
        # gradients' float32/float64 multiplies to the same bits in one op each
        torch._foreach_mul_(grads, torch.tensor(factor, dtype=dtype))
    else:
        torch._foreach_mul_(grads, factor)
