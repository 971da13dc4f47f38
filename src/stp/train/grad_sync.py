"""A step's collectives after the backward, in the one order every rank runs them.

After the executor's backward each rank holds its own gradients and, on the
ranks of the last stage, its microbatches' losses. `GradSync.after_backward`
then runs, on every rank:

    1. the shared-gradient sum: tied embedding / head copies and replicated
       kv heads (the decoder's SharedGrads), before the DP average (they commute);
    2. the loss sum over the world: the mean over microbatches and replicas,
       so every rank returns the same number;
    3. the DP average of the gradients (fp32 main grads in mixed precision),
       one flat all-reduce; with the sharded optimizer (stp.train.zero) one
       reduce-scatter instead, each rank keeping the mean of its shard. With
       expert parallelism an expert's gradient already holds the tokens of
       its whole EP group: it is summed over the expert's replicas (the
       expert-data-parallel group, dp / ep ranks) and divided by dp, so it is
       the mean over every replica's microbatches as a dense one;
    4. the global gradient norm's all-reduce (stp.train.clip), over the
       gradients the optimizer reads (with sharding: each rank's shards).

Every collective goes through `collective`, so a backend error becomes one
rank error the one way (stp.runtime.errors.wrap): a lost DP peer is reported
as lost, a stalled one as a timeout, both naming this rank, the collective
and the group it waited on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from stp.runtime.errors import RankError, wrap
from stp.runtime.mesh import Mesh
from stp.train.clip import counted_mask, grad_norm
from stp.train.precision import Precision
from stp.train.shards import box_of, norm_key
from stp.train.zero import ShardedPrecision

__all__ = ["GradSync", "SharedSum", "collective", "WORLD"]

SharedSum = Callable[[dict[str, torch.Tensor]], None]
"""Sums the gradients of parameters held in several places, in place, by global name."""

WORLD = "a rank in the world"
"""Who a collective over the whole world waits on, as error messages name it."""


def collective(mesh: Mesh, action: str, peers: str, fn: Callable[..., Any], *args: Any,
               **kw: Any) -> Any:
    """`fn(*args, **kw)`, a torch.distributed collective this rank runs as `action`
    waiting on `peers`; a backend error is raised as the rank error it is."""
    try:
        return fn(*args, **kw)
    except RankError:
        raise
    except RuntimeError as e:
        raise wrap(e, where=mesh.describe(), action=action, peers=peers) from e


class GradSync:
    """The gradient and loss collectives of one rank's steps (see the module doc).

    `stages`: this rank's stages by global index; `shared`: sums, in place,
    the gradients (by global name) of parameters held in several places (the
    decoder's SharedGrads; None: a user's stage builder); `holds_loss`: this
    pipeline rank runs the last stage; `device`: where this rank's tensors
    live. Building it is collective: the ranks agree on which of them counts
    each gradient in the norm.
    """

    def __init__(self, mesh: Mesh, precision: Precision, stages: Mapping[int, Any], *,
                 shared: SharedSum | None, holds_loss: bool, device: torch.device) -> None:
        self.mesh, self.precision, self.shared = mesh, precision, shared
        self.holds_loss, self.device = holds_loss, device
        self.collective = functools.partial(collective, mesh)
        """`collective(action, peers, fn, *args, **kw)` on this rank (module function)."""
        experts = {n for st in stages.values() for n in getattr(st, "expert_names", ())}
        self.expert_index = [i for i, n in enumerate(precision.names) if n in experts]
        """Which of the precision's parameters are experts held by this EP rank only."""
        self.counted = self._norm_mask(stages)
        """Which of this rank's gradients it adds to the global norm (stp.train.clip)."""

    def _norm_mask(self, stages: Mapping[int, Any]) -> list[bool]:
        tp, tp_rank = self.mesh.dims.tp, self.mesh.coord.tp
        keys = [norm_key(st, n, box_of(st, n, p, tp, tp_rank))
                for st in stages.values() for n, p in st.named_parameters()]
        gather = None if self.mesh.dims.world_size == 1 else functools.partial(
            self.collective, "gradient keys gather", WORLD, dist.all_gather_object)
        return counted_mask(self.precision.norm_keys(keys), rank=self.mesh.rank, gather=gather)

    def after_backward(self, losses: Mapping[int, torch.Tensor], microbatches: int,
                       valid_ratio: float) -> tuple[float, float]:
        """(the step's mean loss, the global gradient norm), both the same on every
        rank, with the gradients summed where shared and averaged over DP.
        `losses`: this rank's microbatch mean losses (empty off the last stage);
        `valid_ratio`: the global batch's share of counted targets (each
        microbatch's mean is over its own valid targets). Collective."""
        self.sum_shared()
        loss = self.world_loss(losses, microbatches, valid_ratio)
        if isinstance(self.precision, ShardedPrecision):
            self.precision.reduce_scatter()
        elif self.mesh.dims.dp > 1:
            self.average_dp()
        return loss, self.grad_norm()

    def sum_shared(self) -> None:
        """Sum the gradients of parameters held in more than one place."""
        if self.shared is not None:
            p = self.precision
            grads = dict(zip(p.names, p.full_grads(), strict=True))
            self.collective("tied / replicated gradient sum", "a rank sharing parameters",
                            self.shared, grads)

    def world_loss(self, losses: Mapping[int, torch.Tensor], microbatches: int,
                   valid_ratio: float, *, action: str = "loss all-reduce") -> float:
        """The global batch's mean loss from the microbatch means on the ranks holding
        the last stage (one TP rank of each counts), summed over the world."""
        d = self.mesh.dims
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.holds_loss and self.mesh.coord.tp == 0:
            total += sum(float(v) for v in losses.values()) / (microbatches * d.dp) * valid_ratio
        self.collective(action, WORLD, dist.all_reduce, total)
        return float(total)

    def average_dp(self) -> None:
        """Average the gradients (fp32 main grads in mixed precision) over the DP
        replicas in one flat all-reduce (experts': over their replicas, module doc)."""
        grads = self.precision.grads()
        experts = set(self.expert_index)
        dense = [g for i, g in enumerate(grads) if i not in experts]
        self._mean(dense, "dp", self.mesh.dp_group, "DP gradient all-reduce")
        if experts:
            self._mean([grads[i] for i in self.expert_index], "edp", self.mesh.edp_group,
                       "expert gradient all-reduce")

    def _mean(self, grads: list[torch.Tensor], axis: str, group: Any, action: str) -> None:
        """Sum `grads` over the group of `axis` in one flat all-reduce, divide by dp."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if len(self.mesh.ranks[axis]) > 1:
            peers = f"a rank in {self.mesh.describe_group(axis)}"
            self.collective(action, peers, dist.all_reduce, flat, group=group)
        flat /= self.mesh.dims.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients (stp.train.clip). Collective."""
        world_sum = None
        if self.mesh.dims.world_size > 1:
            world_sum = functools.partial(self.collective, "grad-norm all-reduce", WORLD,
                                          dist.all_reduce)
        return grad_norm(self.precision.grads(), self.counted, world_sum)
