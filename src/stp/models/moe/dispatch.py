"""Expert parallelism: the token all-to-alls of an MoE layer whose experts are spread
over the ranks of an expert-parallel (EP) group (stp.runtime.mesh: ep consecutive
DP ranks; each holds E / ep experts, every one still TP-sharded).

One MoE layer on EP rank r, n local tokens, k choices each (GShard, arXiv
2006.16668, section 2.2; dropless, as Megatron-LM's token dispatcher):

    pairs (token, slot) sorted by expert  ->  rows for rank 0 | rank 1 | ..
    1. counts all-to-all: how many rows each rank sends each of my experts
    2. dispatch all-to-all: the rows, uneven splits from the counts
    3. my experts on what arrived (rows grouped by source, then by expert)
    4. combine all-to-all: the outputs back the way they came
    5. weight each row by its routing weight, sum into its token

Every TP rank of a DP replica holds the same tokens (the norm's output is
replicated), so TP rank t exchanges with the TP ranks t of its EP group only
and computes its shard of the experts; the combined output is a partial sum
over TP like the dense MLP's, all-reduced after the unit as before.

Both token all-to-alls are autograd Functions whose backward is the reverse
exchange (the gradient of a permutation across ranks), so the unit's backward
walk runs them in the same order on every rank of the EP group: the ranks of
an EP group run the same program (the same schedule, microbatch for
microbatch), so their collectives meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExpertGroup", "Routed", "all_to_all", "dispatch", "combine"]


@dataclass(frozen=True)
class ExpertGroup:
    """The EP group an MoE layer's experts are spread over."""

    group: Any
    """The torch.distributed process group (the mesh's ep_group)."""
    size: int
    rank: int
    """This rank's place in the group: it holds experts [rank E/size, (rank+1) E/size)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} is not in [0, {self.size})")

    def experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds."""
        if num_experts % self.size:
            raise ValueError(f"experts={num_experts} must be divisible by ep={self.size} "
                             "(each expert-parallel rank holds experts / ep of them)")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


class _AllToAll(torch.autograd.Function):
    """rows of x [sum(send), ...] sent in runs of `send` to the group's ranks, `recv`
    rows received from each; backward: the gradient sent back the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], group: Any):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group: Any) -> torch.Tensor:
    """Differentiable uneven all-to-all of x's rows (see _AllToAll)."""
    return _AllToAll.apply(x, recv, send, group)


@dataclass
class Routed:
    """One microbatch's routing plan on this rank (what dispatch found, combine needs)."""

    token: torch.Tensor
    """[n k] the token of each sent row (rows sorted by expert)."""
    weight: torch.Tensor
    """[n k] the routing weight of each sent row (differentiable)."""
    send: list[int]
    """Rows sent to each EP rank."""
    recv: list[int]
    """Rows received from each EP rank."""
    expert: torch.Tensor
    """[sum(recv)] the local expert (0 .. E/ep - 1) of each received row."""
    group: Any
    """The EP process group."""


def dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
             ep: ExpertGroup) -> tuple[torch.Tensor, Routed]:
    """(the rows this rank's experts compute [sum(recv), h], the plan) of tokens x [n, h]
    routed to `ids` [n, k] with `weights` [n, k] (steps 1 and 2 of the module doc)."""
    n, k = ids.shape
    order = torch.argsort(ids.reshape(-1), stable=True)  # rows grouped by expert
    token = torch.div(order, k, rounding_mode="floor")
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)  # [E], rank-major
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=ep.group)  # [ep, E/ep]: per source, expert
    per = num_experts // ep.size
    send = counts.view(ep.size, per).sum(1).tolist()
    by_source = got.view(ep.size, per)
    recv = by_source.sum(1).tolist()
    expert = torch.repeat_interleave(
        torch.arange(per, device=ids.device).repeat(ep.size), by_source.reshape(-1))
    rows = all_to_all(x[token], recv, send, ep.group)
    return rows, Routed(token, weights.reshape(-1)[order], send, recv, expert, ep.group)


def combine(y: torch.Tensor, plan: Routed, n: int) -> torch.Tensor:
    """The experts' outputs y [sum(recv), h] back to their tokens, weighted and summed
    per token: [n, h] (steps 4 and 5)."""
    back = all_to_all(y, plan.send, plan.recv, plan.group)
    out = back.new_zeros((n, back.shape[1]))
    return out.index_add(0, plan.token, back * plan.weight[:, None])
