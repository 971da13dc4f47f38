"""Objective terms beside the language-model loss, and the figures a step reports
about them: the MoE load-balancing loss (stp.models.moe).

A stage that has such terms implements two methods (duck-typed, so the trainer
needs no family's class): `set_num_microbatches(m)`, after which each
microbatch's backward seeds its share of the term (the term's gradient is
taken inside the units, so it stays exact with W deferred and under
braiding), and `take_aux()` -> (sum of the term over the stage's layers and
microbatches since the last call, routing choices per expert or None).

The step's figures, the same on every rank after one all-reduce over the
world (one TP rank of each group counts; the DP replicas add up):
- `aux_loss`: the mean over MoE layers and over every replica's microbatches;
- `expert_load`: the busiest expert's routing choices over the mean, summed over
  the step's layers and microbatches (1.0: perfectly balanced);
- `expert_tokens_max`, `expert_tokens_mean`: those two counts themselves (routed
  tokens per expert in the step, every MoE layer and replica added up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from stp.runtime.stage_api import offers_aux
from stp.train.step.grad_sync import WORLD

__all__ = ["AuxLosses"]


class AuxLosses:
    """The auxiliary terms of this rank's stages (None from `of` when there are none)."""

    def __init__(self, stages: Mapping[int, Any], sync: Any, mesh: Any, num_layers: int,
                 device: torch.device) -> None:
        self.stages, self.sync, self.mesh = stages, sync, mesh
        self.num_layers, self.device = num_layers, device

    @classmethod
    def of(cls, stages: Mapping[int, Any], sync: Any, mesh: Any,
           device: torch.device) -> AuxLosses | None:
        """For stages that report auxiliary terms (every rank of a run decides alike:
        its stages are all of one family)."""
        if not stages or not all(offers_aux(st) for st in stages.values()):
            return None
        some = next(iter(stages.values()))
        layers = len(some.config.moe_layers)
        return cls(stages, sync, mesh, layers, device) if layers else None

    def start(self, microbatches: int) -> None:
        """Before a step: seed each microbatch's share; forget what evaluation left."""
        for st in self.stages.values():
            st.set_num_microbatches(microbatches)
            st.take_aux()

    def reduce(self) -> torch.Tensor:
        """After a step's backward: [aux loss sum, routing choices per expert], summed
        over the world (collective), on this rank's device and not read: the trainer
        reads it with the step's loss and norm in one host sync (`figures`)."""
        total: Any = 0.0
        counts = None
        for st in self.stages.values():
            aux, c = st.take_aux()
            total = total + aux
            if c is not None:
                counts = c if counts is None else counts + c
        experts = next(iter(self.stages.values())).config.num_experts
        flat = torch.zeros(1 + experts, dtype=torch.float64, device=self.device)
        if self.mesh.coord.tp == 0:
            flat[0] = total
            if counts is not None:
                flat[1:] = counts.to(flat)
        self.sync.collective("aux loss all-reduce", WORLD, dist.all_reduce, flat)
        return flat

    def figures(self, values: list[float], microbatches: int) -> dict[str, float]:
        """The step's figures from `reduce`'s tensor, read (module doc)."""
        d = self.mesh.dims
        load = values[1:]
        mean = sum(load) / len(load)
        return {"aux_loss": values[0] / (self.num_layers * microbatches * d.dp),
                "expert_load": max(load) / mean if mean > 0 else 1.0,
                "expert_tokens_max": max(load), "expert_tokens_mean": mean}

    def collect(self, microbatches: int) -> dict[str, float]:
        """After a step's backward: the step's figures (collective; reads them)."""
        return self.figures(self.reduce().tolist(), microbatches)
