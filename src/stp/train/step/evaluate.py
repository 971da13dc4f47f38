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

import torch

from stp.models import valid_token_ratio
from stp.runtime.executor import Executor
from stp.runtime.stage_api import reset
from stp.schedule import Schedule
from stp.schedule.ir import Kind, passes_of
from stp.schedule.lower import lower
from stp.train.data.corpus import split_batch
from stp.train.run.parts import Parts
from stp.train.step.documents import mask_documents

__all__ = ["forward_only", "Evaluator"]


def forward_only(schedule: Schedule) -> Schedule:
    """`schedule` keeping only its forward passes, in each rank's order."""
    actions = tuple(
        tuple(p for a in acts for p in passes_of(a) if p.kind is Kind.F)
        for acts in schedule.actions
    )
    return dataclasses.replace(schedule, name=f"{schedule.name}-forward", actions=actions)


class Evaluator:
    """Mean loss of global batches on a Trainer's built parts (stp.train.run.setup.Parts;
    collective, like `Trainer.step`)."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        opts, mesh = parts.options, parts.mesh
        self.executor = Executor(
            lower(forward_only(parts.schedule), lookahead=opts.lookahead), mesh.coord.pp,
            parts.stages, parts.executor.p2p, parts.executor.options)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """Mean loss of the global batch (tokens, targets) [B, s]; the same on every rank."""
        parts = self.parts
        d, m, c = parts.dims, parts.schedule.num_microbatches, parts.mesh.coord
        tokens, targets = batch
        targets = mask_documents(parts, tokens, targets, m)  # as the step masks them
        inputs = [x.to(parts.device) for x in split_batch(tokens, d.dp, c.dp, m)]
        tgts = [x.to(parts.device) for x in split_batch(targets, d.dp, c.dp, m)]
        try:
            with torch.no_grad():  # boundary: decoder positions (a multimodal input row
                # is pixel bytes + tokens; its targets span image tokens + tokens)
                losses = self.executor.run(inputs, tgts,
                                           boundary_shape=parts.boundary_shape(tgts[0]))
        finally:
            for st in parts.stages.values():
                reset(st)
        # the mean over the valid (not ignored) targets, summed as a step's loss is
        return parts.sync.world_loss(losses, m, valid_token_ratio(targets),
                                     action="eval loss all-reduce")
