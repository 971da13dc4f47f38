"""Expert parallelism: the token all-to-alls of an MoE layer whose experts are spread
over the ranks of an expert-parallel (EP) group (stp.runtime.mesh: ep consecutive
DP ranks; each holds E / ep experts, every one still TP-sharded).

One MoE layer on EP rank r, n local tokens, k choices each (GShard, arXiv
2006.16668, section 2.2; dropless, as Megatron-LM's token dispatcher):

    pairs (token, slot) sorted by expert  ->  rows for rank 0 | rank 1 | ..
    1. counts all-to-all: how many rows each rank sends each of my experts
       (launched once the router has chosen, waited for after the rows are
       gathered: CountsExchange)
    2. dispatch all-to-all: the rows, uneven splits from the counts
    3. my experts on what arrived (rows grouped by source, then by expert)
    4. combine all-to-all: the outputs back the way they came
    5. weight each row by its routing weight, sum into its token

Every TP rank of a DP replica holds the same tokens (the norm's output is
replicated), so TP rank t exchanges with the TP ranks t of its EP group only
and computes its shard of the experts; the combined output is a partial sum
over TP like the dense MLP's, all-reduced after the layer as before.

The two token all-to-alls are unit boundaries (stp.models.moe.ep_units): a unit
hands the runner a `ToExchange` where a dense unit hands it a partial sum, and
the stage launches it asynchronously (`launch`) as it launches an all-reduce,
so the braid rule hides it under the partner microbatch's unit, in the forward
and (the reverse exchange of the gradient) in the backward. The ranks of an EP
group run the same program, microbatch for microbatch, so their all-to-alls
meet in the same order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stp.models.moe import comm_thread

__all__ = ["CountsExchange", "ExpertGroup", "Routed", "ToExchange", "plan_dispatch",
           "sort_rows", "start_counts"]


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


def _group(group: Any) -> Any:
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    return pg


@functools.cache
def _async_options() -> Any:
    """One AllToAllOptions for every launch (the process group only reads it): building
    it is a few microseconds of Python on the compute stream per launch."""
    opts = dist.AllToAllOptions()
    opts.asyncOp = True
    return opts


@dataclass
class ToExchange:
    """Rows a unit hands the runner to send over the EP group: runs of `send[r]` rows
    to rank r, `recv[r]` rows from it (an uneven all-to-all).

    Made by the unit, in its compute: the rows made contiguous and the buffer they
    arrive in allocated here (`__post_init__`), so that the launch, which the
    braid cannot hide, is the process group's call and nothing else (as the
    all-reduce's launch is: its partial sum was made by the unit too)."""

    rows: torch.Tensor
    recv: list[int]
    send: list[int]
    group: Any
    into: torch.Tensor | None = None
    """Where the received rows go ([sum(recv), ...] like `rows`); None: allocated
    when the exchange is made."""
    collective = "A2A"
    """Its name in a measured trace (stp.runtime.trace), next to the all-reduce's AR."""

    def __post_init__(self) -> None:
        self.rows = self.rows.contiguous()
        if self.into is None:
            self.into = self.rows.new_empty((sum(self.recv), *self.rows.shape[1:]))

    def launch(self) -> tuple[torch.Tensor, Any]:
        """Start the exchange: (the received rows, filled when the work completes; work).
        It calls the process group as torch.distributed.all_to_all_single does,
        without that function's per-call Python checks, on the communication
        thread (stp.models.moe.comm_thread: the compute stream only enqueues; the
        launch would otherwise be exposed whatever the braid hides)."""
        out, rows, recv, send = self.into, self.rows, self.recv, self.send
        assert out is not None  # __post_init__
        pg = _group(self.group)
        return out, comm_thread.launch(
            lambda: pg.alltoall_base(out, rows, recv, send, _async_options()), rows)

    def exchange(self) -> torch.Tensor:
        """The received rows, waited for."""
        out, work = self.launch()
        work.wait()
        return out


@dataclass
class Routed:
    """One microbatch's routing plan on this rank (what the dispatch found, the
    experts and the combine need)."""

    order: torch.Tensor
    """[n k] the (token, slot) pair of each sent row, rows sorted by expert."""
    token: torch.Tensor
    """[n k] the token of each sent row."""
    send: list[int]
    """Rows sent to each EP rank."""
    recv: list[int]
    """Rows received from each EP rank."""
    expert: torch.Tensor
    """[sum(recv)] the local expert (0 .. E/ep - 1) of each received row."""
    group: Any
    """The EP process group."""

    def dispatch(self, rows: torch.Tensor) -> ToExchange:
        """Sent rows (or the gradient of the combined rows) to the experts' ranks."""
        return ToExchange(rows, self.recv, self.send, self.group)

    def combine(self, rows: torch.Tensor) -> ToExchange:
        """The experts' rows (or the gradient of the received rows) back to the tokens'."""
        return ToExchange(rows, self.send, self.recv, self.group)


@dataclass
class CountsExchange:
    """Step 1 of the module doc in flight: how many rows this rank sends each expert,
    exchanged with the EP group (a few integers, an equal-split all-to-all).

    It is launched as soon as the router has chosen (`start_counts`) and waited for
    only when the plan is built (`plan`), after the route unit has sorted and
    gathered the rows to send and run the shared expert, so that work hides it:

        route unit:  router, top-k | sort, gather rows, aux, shared expert | plan
        EP group:                  [counts ..........................]   ^ wait
    """

    counts: torch.Tensor
    """[E] rows this rank sends each expert (rank-major: rank r holds experts
    [r E/ep, (r+1) E/ep))."""
    got: torch.Tensor
    """[E] filled by the exchange: [ep, E/ep], per source rank, rows for each of my experts."""
    work: Any
    ep: ExpertGroup

    def plan(self, order: torch.Tensor, token: torch.Tensor) -> Routed:
        """The routing plan of rows sorted by expert (`sort_rows`), once the counts are in."""
        self.work.wait()
        ep, per = self.ep, self.counts.numel() // self.ep.size
        by_source = self.got.view(ep.size, per)
        expert = torch.repeat_interleave(
            torch.arange(per, device=self.got.device).repeat(ep.size), by_source.reshape(-1))
        return Routed(order, token, self.counts.view(ep.size, per).sum(1).tolist(),
                      by_source.sum(1).tolist(), expert, ep.group)


def start_counts(ids: torch.Tensor, num_experts: int, ep: ExpertGroup) -> CountsExchange:
    """Launch the counts exchange of tokens routed to experts `ids` [n, k]."""
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)  # [E], rank-major
    got = torch.empty_like(counts)
    pg = _group(ep.group)
    work = comm_thread.launch(  # equal splits: E/ep each
        lambda: pg.alltoall_base(got, counts, [], [], _async_options()), counts)
    return CountsExchange(counts, got, work, ep)


def sort_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, token): the (token, slot) pairs of `ids` [n, k] grouped by expert, and
    the token of each."""
    order = torch.argsort(ids.reshape(-1), stable=True)
    return order, torch.div(order, ids.shape[1], rounding_mode="floor")


def plan_dispatch(ids: torch.Tensor, num_experts: int, ep: ExpertGroup) -> Routed:
    """The plan of tokens routed to experts `ids` [n, k], the counts exchanged and
    waited for at once (step 1 of the module doc)."""
    return start_counts(ids, num_experts, ep).plan(*sort_rows(ids))
