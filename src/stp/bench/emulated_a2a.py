"""Emulated compute with the expert all-to-all, for `stp bench overlap --all-to-all`.

An `EmulatedA2AStage` is stp.models.emulated's stage (units that wait instead of
computing, real communication of the real sizes) whose units each end in an
expert all-to-all (stp.models.moe.dispatch.ToExchange, launched by the stage
as an expert-parallel MoE stage launches it) in place of the TP all-reduce: each
rank keeps half the [b s, h] rows of the microbatch and sends the other half to
its peer, as a dispatch or combine of tokens routed evenly over two EP ranks
does. The braid runner (stp.runtime.braid) treats it as it treats the
all-reduce, so the same block measures how much of each the braid hides.
What it leaves out: the counts exchange before a dispatch (a few integers) and
uneven splits.
"""

from __future__ import annotations

from typing import Any

import torch

from stp.models.emulated import EmulatedStage
from stp.models.moe.dispatch import ToExchange

__all__ = ["EmulatedA2AStage"]


class EmulatedA2AStage(EmulatedStage):
    """An EmulatedStage (tp_size 2: its group is the EP group) whose units end in an
    all-to-all (module doc); a UnitStage for stp.runtime.braid."""

    def _exchange(self, partial: torch.Tensor) -> ToExchange:
        rows = partial.reshape(-1, partial.shape[-1])
        n, ranks = rows.shape[0], self.tp_size
        splits = [n // ranks + (1 if r < n % ranks else 0) for r in range(ranks)]
        return ToExchange(rows, splits, splits, self.tp_group)

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the all-to-all of a unit's rows; the result keeps the partial's shape."""
        out, work = self._exchange(partial).launch()
        return out.view(partial.shape), work

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self._exchange(partial).exchange().view(partial.shape)
