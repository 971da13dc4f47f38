"""Emulated compute with the expert all-to-all, for `stp bench overlap --all-to-all`.

An `EmulatedA2AStage` is stp.models.emulated's stage (units that wait instead of
computing, real communication of the real sizes) whose units each end in an
expert all-to-all (stp.models.moe.dispatch.ToExchange, launched by the stage
as an expert-parallel MoE stage launches it) in place of the TP all-reduce.
Each of the microbatch's b s tokens goes to `top_k` experts spread evenly over
the two EP ranks, so a unit exchanges [top_k b s, h] rows: each rank keeps half
of them and sends the other half to its peer, as a dispatch or combine of
evenly routed tokens does. At top_k = 2 (Mixtral's routing) a rank sends b s
rows, the bytes one rank sends in the ring all-reduce of the [b, s, h] partial
at tp = 2; at top_k = 1 it sends half of them.

A unit's step makes its exchange (`buffer`: a ToExchange), as an expert-parallel
MoE unit makes its own in its compute, and the stage's launch is the process
group's call alone. Rows to send and rows received both come from rings of
preallocated buffers, as the all-reduce's partials come from the emulated
stage's ring: the values do not matter, and an allocation per launch would
time the machine's allocator, not the collective. The braid runner (stp.runtime.braid) treats
the all-to-all as it treats the all-reduce, so the same block measures how
much of each the braid hides. What it leaves out: the counts exchange before a
dispatch (a few integers, hidden in the route unit's own work:
stp.models.moe.dispatch.CountsExchange) and uneven splits.

Launches: the all-to-all goes through the communication thread
(stp.models.moe.comm_thread), as the MoE units' does, and the all-reduce
through the compute stream, as the decoder's does; `ThreadLaunchedARStage`
gives the all-reduce the same thread, for comparison.
"""

from __future__ import annotations

from typing import Any

import torch

from stp.models.emulated import EmulatedStage
from stp.models.moe import comm_thread
from stp.models.moe.dispatch import ToExchange
from stp.models.tp.comm import launch_sum

__all__ = ["EmulatedA2AStage", "ThreadLaunchedARStage"]

_RING = 8  # buffers in flight at most: a block holds a few collectives at a time


class EmulatedA2AStage(EmulatedStage):
    """An EmulatedStage (tp_size 2: its group is the EP group) whose units end in an
    all-to-all of `top_k` rows per token (module doc); a UnitStage for
    stp.runtime.braid."""

    def __init__(self, *args: Any, top_k: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 (experts per token)")
        self.top_k = top_k
        self._received: list[torch.Tensor] = []
        self._splits: list[int] = []

    def buffer(self, mb: int) -> ToExchange:  # type: ignore[override]  # gets its own units' type back
        """The exchange a unit hands the runner: [top_k b s, h] rows to send and the
        buffer they arrive in, from rings (see EmulatedStage), made in the unit's
        step as an expert-parallel MoE unit makes its exchange."""
        b, s, h = self.shapes[mb]
        shape = (self.top_k * b * s, h)
        if not self._ring or tuple(self._ring[0].shape) != shape:
            self._ring = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(_RING)]
            self._received = [torch.empty_like(t) for t in self._ring]
            n, ranks = shape[0], self.tp_size
            self._splits = [n // ranks + (1 if r < n % ranks else 0) for r in range(ranks)]
        self._next = (self._next + 1) % _RING
        rows, into = self._ring[self._next], self._received[self._next]
        return ToExchange(rows, self._splits, self._splits, self.tp_group, into=into)

    def launch_allreduce(self, partial: ToExchange) -> tuple[torch.Tensor, Any]:  # type: ignore[override]  # gets its own units' type back
        """Start a unit's all-to-all: (the received rows, work)."""
        return partial.launch()

    def _reduce(self, partial: ToExchange) -> torch.Tensor:  # type: ignore[override]  # gets its own units' type back
        return partial.exchange()


class ThreadLaunchedARStage(EmulatedStage):
    """The emulated all-reduce stage with its all-reduces launched from the
    communication thread, as the all-to-alls are (stp.models.moe.comm_thread): what
    the all-reduce would hide if it were launched the same way (a comparison row;
    the decoder's stages launch theirs on the compute stream)."""

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        group = self.tp_group
        return partial, comm_thread.launch(lambda: launch_sum(partial, group), partial)
