"""Emulated compute with sequence parallelism, for `stp bench overlap --sequence-parallel`.

An `EmulatedSPStage` is stp.models.emulated's stage (units that wait instead of
computing, real communication of the real sizes) with the collectives of
sequence parallelism (Korthikanti et al., arXiv 2205.05198; stp.models.tp.sequence)
in place of the all-reduce: each F and B unit ends in a reduce-scatter of a
[b, s, h] partial sum into this rank's [b, s/t, h] rows, and each unit but the
first stage's first forward (the embedding, whose input is token ids) starts
with an all-gather of [b, s/t, h] rows. Like the model's units it can launch
that gather early (`prepare_forward` / `prepare_backward`), so the braid runner
(stp.runtime.braid) hides it under the partner's unit where the braid order
leaves room. What it leaves out: the real model's W gathers its input rows
again (stp.models.tp.sequence.RegatheredInput); an emulated W only waits.
"""

from __future__ import annotations

from typing import Any

import torch

from stp.models.emulated import EmulatedStage, EmulatedUnit, hold
from stp.models.tp.sequence import PendingGather, SequenceParallel, ToScatter

__all__ = ["EmulatedSPStage"]


class _SPUnit(EmulatedUnit):
    """An emulated unit whose TP region starts with an all-gather and ends in a
    reduce-scatter."""

    owner: EmulatedSPStage

    def __init__(self, name: str, stage: EmulatedSPStage, index: int) -> None:
        super().__init__(name, stage, index)
        self.pending: dict[tuple[int, str], PendingGather] = {}

    def _gathers_input(self) -> bool:
        return not (self.index == 0 and self.owner.is_first)  # token ids: nothing to gather

    def _gather(self, mb: int, pass_kind: str) -> None:
        """Wait for the unit's all-gather: the one prepared early, else launched now."""
        pending = self.pending.pop((mb, pass_kind), None)
        if pending is None:
            pending = self.owner.seq.launch_gather(self.owner.rows(mb))
        pending.wait()

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        if self._gathers_input():
            self.pending[(mb, "F")] = self.owner.seq.launch_gather(self.owner.rows(mb))

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        self.pending[(mb, "B")] = self.owner.seq.launch_gather(self.owner.rows(mb))

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> Any:
        if self.index == 0:
            full = x.shape[1] * (1 if self.owner.is_first else self.owner.tp_size)
            self.owner.shapes[mb] = (x.shape[0], full, self.owner.hidden)
        if self._gathers_input():
            self._gather(mb, "F")
        hold(self.owner.times.f)
        return ToScatter(self.owner.buffer(mb))

    def backward_partial(self, mb: int, grad: torch.Tensor) -> Any:
        self._gather(mb, "B")
        hold(self.owner.times.b)
        return ToScatter(self.owner.buffer(mb))


class EmulatedSPStage(EmulatedStage):
    """An EmulatedStage (tp_size >= 2) whose units run sequence parallelism's
    collectives (module doc); a UnitStage for stp.runtime.braid."""

    def __init__(self, stage: int, num_stages: int, *, tp_rank: int, **kwargs: Any) -> None:
        super().__init__(stage, num_stages, **kwargs)
        self.units = tuple(_SPUnit(u.name, self, u.index) for u in self.units)
        self.seq = SequenceParallel(self.tp_group, self.tp_size, tp_rank)
        self.sequence_parallel = self.prepares_gathers = True
        self._rows: list[torch.Tensor] = []

    def rows(self, mb: int) -> torch.Tensor:
        """This rank's [b, s/t, h] rows of microbatch mb (values do not matter)."""
        b, s, h = self.shapes[mb]
        if not self._rows or tuple(self._rows[0].shape) != (b, s // self.tp_size, h):
            self._rows = [torch.zeros((b, s // self.tp_size, h), dtype=self.dtype,
                                      device=self.device)]
        return self._rows[0]

    def launch_allreduce(self, partial: Any) -> tuple[torch.Tensor, Any]:
        """The reduce-scatter of a unit's partial sum (a ToScatter)."""
        return self.seq.launch_scatter(partial.partial)

    def take_gathers(self) -> list[tuple[float, float, float]]:
        return self.seq.take_gathers()

    def _reduce(self, partial: Any) -> torch.Tensor:
        return self.seq.scatter(partial.partial)
