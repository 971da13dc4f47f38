"""Held-out loss of a Trainer's model: forward passes only, on the training mesh.

The evaluation program is the training schedule with every backward and
weight pass removed, each rank keeping its forwards in their order: a
subset of a deadlock-free program, so it is deadlock-free too, and lowering
it gives exactly the sends and receives the forwards need. The executor runs
it under `torch.no_grad()`; afterwards every stage drops the state its
forwards kept for a backward that will not come.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from stp.models import valid_token_ratio
from stp.runtime.executor import Executor
from stp.schedule import Schedule
from stp.schedule.ir import Kind, passes_of
from stp.schedule.lower import lower
from stp.train.data import split_batch

__all__ = ["forward_only", "Evaluator"]


def forward_only(schedule: Schedule) -> Schedule:
    """`schedule` keeping only its forward passes, in each rank's order."""
    actions = tuple(
        tuple(p for a in acts for p in passes_of(a) if p.kind is Kind.F)
        for acts in schedule.actions
    )
    return dataclasses.replace(schedule, name=f"{schedule.name}-forward", actions=actions)


class Evaluator:
    """Mean loss of global batches on a Trainer's stages (collective, like `step`)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        t = trainer
        self.executor = Executor(
            lower(forward_only(t.schedule), lookahead=t.options.lookahead), t.mesh.coord.pp,
            t.stages, t.executor.p2p, boundary_shape=(1, 1, t.hidden), dtype=t.dtype,
            device=t.device, where=t.mesh.describe(), braid=t.options.braid,
            collective_peers=t.mesh.describe_group("tp"),
        )

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean loss of the global batch (tokens, targets) [B, s]; the same on every rank."""
        t = self.trainer
        d, m, c = t.dims, t.num_microbatches, t.mesh.coord
        tokens, targets = batch
        inputs = [x.to(t.device) for x in split_batch(tokens, d.dp, c.dp, m)]
        tgts = [x.to(t.device) for x in split_batch(targets, d.dp, c.dp, m)]
        try:
            with torch.no_grad():  # boundary: decoder positions (a multimodal input row
                # is pixel bytes + tokens; its targets span image tokens + tokens)
                losses = self.executor.run(inputs, tgts,
                                           boundary_shape=t.boundary_shape(tgts[0]))
        finally:
            for st in t.stages.values():
                reset = getattr(st, "reset", None)
                if reset is not None:
                    reset()
        total = torch.zeros((), dtype=torch.float64, device=t.device)
        if t.holds_loss and c.tp == 0:  # the mean over the valid (not ignored) targets
            total += sum(float(v) for v in losses.values()) / (m * d.dp) * valid_token_ratio(
                targets)
        t._collective("eval loss all-reduce", "the world", dist.all_reduce, total)
        return float(total)
