"""Every rank's peak of resident activations in the last step, gathered: what
`stp train` reports per rank and `--json` records (the offloader counts them on
the host, so one rank reads no device)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from stp.runtime.offload import StepMemory
from stp.train.run.parts import Parts
from stp.train.step.grad_sync import WORLD

__all__ = ["world_peaks"]


def world_peaks(parts: Parts, mem: StepMemory) -> tuple[list[int], list[int]]:
    """(peak resident activation bytes, what the DP reductions' copies in flight added
    to it) of every global rank, in rank order. Collective over the world."""
    peaks: list[Any] = [None] * parts.dims.world_size
    mine = (mem.peak_bytes, max(0, mem.peak_with_held - mem.peak_bytes))
    if parts.dims.world_size == 1:  # host counters: nothing to gather, no device read
        peaks[0] = mine
    else:
        parts.sync.collective("memory gather", WORLD, dist.all_gather_object, peaks, mine)
    return [int(p) for p, _ in peaks], [int(c) for _, c in peaks]
