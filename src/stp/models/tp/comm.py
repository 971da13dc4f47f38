"""The raw TP collective: a sum all-reduce over the tensor-parallel group.

Units of a stage never call a collective themselves: they return a partial sum
and take the reduced tensor back (stp.models.decoder.units). Whoever drives them
picks how to reduce: `make_allreduce` gives the synchronous default the stage
uses between units; `start_allreduce` gives an in-flight handle for an executor
that braids two passes and computes while the all-reduce runs (braided
execution blocks: "Synergistic Tensor and Pipeline Parallelism", arXiv
2510.27257, Fig. 3). `launch_sum` is the cheap launch the stages use on the
braided path (stp.runtime.braid waits on the work it returns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "AllReduce",
    "identity_allreduce",
    "launch_sum",
    "make_allreduce",
    "PendingAllReduce",
    "start_allreduce",
]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum-reduce a tensor over the TP group and return the result (which may be the
same tensor, reduced in place)."""


def identity_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a group of one rank."""
    return tensor


def make_allreduce(group: dist.ProcessGroup | None, tp_size: int) -> AllReduce:
    """Synchronous sum all-reduce on `group` (None: the default group); identity when
    tp_size == 1, so a tp=1 run needs no process group at all."""
    if tp_size == 1:
        return identity_allreduce

    def allreduce(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    return allreduce


class PendingAllReduce:
    """An all-reduce in flight: `wait()` returns the reduced tensor.

        compute stream:  [unit k of pass A: partial] [unit j of pass B .......]
        TP all-reduce:                              [reduce A's partial]
                                                                  wait() -> finish of A
    """

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None) -> None:
        self._tensor = tensor
        self._work = work

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


def start_allreduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, tp_size: int
) -> PendingAllReduce:
    """Launch the sum all-reduce of `tensor` in place and return without waiting."""
    if tp_size == 1:
        return PendingAllReduce(tensor, None)
    tensor = tensor.contiguous()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingAllReduce(tensor, work)


def launch_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    """Start a sum all-reduce of `tensor`, in place, on `group` (None: the default
    group); returns its work. It calls the process group as torch.distributed.
    all_reduce does, without that function's per-call Python checks: on a 2-core
    VM those cost 40-60 us a launch (stp bench overlap), and every F and B unit
    launches one on the compute stream."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = True
    return pg.allreduce([tensor], opts)
