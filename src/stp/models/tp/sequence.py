"""Sequence parallelism's two collectives (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", arXiv 2205.05198, section 4.2.2).

Between the TP regions of a layer (RMSNorm, the residual add, and the stream
sent between pipeline stages) each of the t TP ranks holds s/t rows of the
sequence, rows [r s/t, (r+1) s/t) on rank r. The all-reduce that ends a
row-parallel matrix becomes a reduce-scatter into those rows (g-bar in the
paper's Fig. 5), and the input of the column-parallel matrices is all-gathered
first (g). Their duals in the backward: the gradient of an all-gather is a
reduce-scatter, of a reduce-scatter an all-gather. A ring all-reduce is
exactly a reduce-scatter followed by an all-gather, so the bytes on the wire
do not change; what changes is that every tensor between them is s/t rows.

How the unit protocol (stp.models.decoder.units) carries them: a unit still
ends in ONE collective that the runner launches and braids (stp.runtime.braid)
-- now a reduce-scatter, marked by returning `ToScatter(partial)` instead of a
bare partial -- and the next unit begins with the all-gather of its
normalised input (backward: of its output gradient). The gather needs the
scatter's result through the residual add and the norm, so the two cannot be
one collective; `prepare_forward` / `prepare_backward` run the unit's start
up to the gather's launch, and the runner calls them as early as the braid
order allows (its "advance"): right after the first item that follows the
reduce-scatter, when one more item remains to hide the gather under.

    F braided with a full backward (STP paper, Fig. 3 order):
    compute: Attn F(i) | MLP B(j) |adv| MLP W(j) |adv| MLP F(i) | Attn B(j)
    TP:           [RS F(i)...]   [AG F(i)...]          ^ waited   ^ waited
                             [RS B(j) ...]       [AG B(j) .........]
    F braided with B only (W deferred): one item between a chain's units:
    compute: Attn F(i) | MLP B(j) | MLP F(i) | Attn B(j)
    TP:           [RS F(i)...]    [AG]^exposed: launched at its own unit

So the reduce-scatter hides exactly where the all-reduce did (same braid rule),
and the all-gather hides too wherever the braid has two items between a
chain's units (a full backward's W gives that room); elsewhere it is
launched at its unit's start and waited for there.

The gathered input of a unit's column-parallel matrices (s rows) is not kept
for the backward: those matrices save only this rank's s/t rows
(`RegatheredInput`), their input gradient needs none of it (dx = dy W), and W
of the split backward (Zero Bubble, arXiv 2401.10241) gathers the rows again,
once per unit and microbatch, as Megatron-LM re-gathers in its backward
(arXiv 2205.05198, section 4.2.2). The loss head, whose matrix runs in plain
autograd, keeps its gathered input.

That W gather is waited for at once (W has no collective of its own for the
braid to hide; it costs compute-stream time, counted with the other gathers):
memory bought with communication, as in Megatron-LM.

In-layer TP overlap (stp.models.tp.overlap) cuts both collectives into chunks
along the sequence, each under the next chunk's matmul; a unit then hands the
runner its last chunk (`ChunkedScatter`, a ToScatter that carries the others).

The collectives sit between autograd graphs, outside them, like the TP
all-reduce (stp.models.tp.layers); the one in W runs at the same point of
every TP rank's program, so the ranks issue it in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from stp.models.tp.layers import _LinearFn
from stp.models.tp.wgrad import LinearGrad, WGradEntry

__all__ = ["PendingGather", "RegatheredInput", "RegatheredLinearGrad", "SequenceParallel",
           "ToScatter", "check_sequence"]


@dataclass(frozen=True)
class ToScatter:
    """A unit's partial sum over the TP group, full sequence [b, s, h], to be
    reduce-scattered along the sequence (dim 1) rather than all-reduced."""

    partial: torch.Tensor
    collective = "RS"
    """Its name in a measured trace (stp.runtime.trace), next to the all-reduce's AR."""

    def launch(self, seq: SequenceParallel) -> tuple[torch.Tensor, Any]:
        """Start the reduce-scatter: (this rank's rows, filled when the work completes;
        the work). In-layer overlap's ChunkedScatter (stp.models.tp.overlap) also
        carries the reduce-scatters of its earlier chunks."""
        return seq.launch_scatter(self.partial)


def check_sequence(seq_len: int, tp: int) -> None:
    """ValueError (one line) unless the sequence splits evenly over the TP ranks:
    stp refuses rather than pads (a padded row would need a mask in the attention
    and the loss for no gain)."""
    if seq_len % tp:
        raise ValueError(f"--sequence-parallel splits the sequence over the TP ranks: "
                         f"--seq-len {seq_len} is not divisible by tp={tp} (stp refuses "
                         "rather than pads)")


class SequenceParallel:
    """The sequence-parallel collectives of one TP group (size > 1)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        if size < 2:
            raise ValueError(f"sequence parallelism needs tp >= 2, got {size}")
        self.group, self.size, self.rank = group, size, rank
        self.gathers: list[tuple[float, float, float]] = []
        """(launch, done, seconds on the compute stream: launch plus blocking wait) of the
        all-gathers since `take_gathers` (perf_counter seconds)."""

    def take_gathers(self) -> list[tuple[float, float, float]]:
        """The all-gathers run since the last call (the runner times and traces them)."""
        out, self.gathers = self.gathers, []
        return out

    def _pg(self) -> Any:
        pg = self.group if self.group is not None else dist.group.WORLD
        assert pg is not None, "torch.distributed is not initialised"
        return pg

    def rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor [b, s, ...] (a view)."""
        part = full.shape[1] // self.size
        return full.narrow(1, self.rank * part, part)

    def launch_scatter(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the sum reduce-scatter of `partial` [b, s, h] over the sequence: (this
        rank's [b, s/t, h], filled when the work completes; the work). Calls the process
        group as dist.reduce_scatter_tensor does, without its per-call checks (as
        stp.models.tp.comm.launch_sum does for the all-reduce)."""
        b, s, *rest = partial.shape
        t = self.size
        # reduce_scatter_tensor splits dim 0: put the t sequence blocks first
        blocks = partial.reshape(b, t, s // t, *rest).transpose(0, 1).reshape(
            t * b, s // t, *rest)
        out = partial.new_empty((b, s // t, *rest))
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.asyncOp = True
        return out, self._pg()._reduce_scatter_base(out, blocks, opts)

    def scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter, waited for."""
        out, work = self.launch_scatter(partial)
        work.wait()
        return out

    def launch_gather(self, local: torch.Tensor) -> PendingGather:
        """Start the all-gather of this rank's rows [b, s/t, ...] into the full sequence
        (dist.all_gather_into_tensor, without its per-call checks); `wait()` gives it."""
        start = time.perf_counter()
        b, part, *rest = local.shape
        blocks = local.new_empty((self.size * b, part, *rest))  # dim 0: rank-major blocks
        opts = AllgatherOptions()
        opts.asyncOp = True
        work = self._pg()._allgather_base(blocks, local.contiguous(), opts)
        return PendingGather(self, blocks, (b, part, *rest), work, start,
                             time.perf_counter() - start)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The all-gather, launched and waited for at once (nothing to hide it under)."""
        return self.launch_gather(local).wait()

    def _timed(self, start: float, exposed: float) -> None:
        if len(self.gathers) < 4096:  # bounded when nobody takes them
            self.gathers.append((start, time.perf_counter(), exposed))


class PendingGather:
    """An all-gather in flight; `wait()` returns the full sequence [b, s, ...]."""

    def __init__(self, seq: SequenceParallel, blocks: torch.Tensor, local_shape: tuple,
                 work: Any, start: float, launch_s: float) -> None:
        self.seq, self.blocks, self.local_shape = seq, blocks, local_shape
        self.work, self.start, self.launch_s = work, start, launch_s

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self.work.wait()
        self.seq._timed(self.start, self.launch_s + time.perf_counter() - t0)
        b, part, *rest = self.local_shape
        return self.blocks.view(self.seq.size, b, part, *rest).transpose(0, 1).reshape(
            b, self.seq.size * part, *rest)


class RegatheredInput:
    """The sink a unit's body gets under SP (stp.models.tp.layers.linear routes to it):
    a linear reading `full` (the gathered input) saves only `rows`, this rank's part,
    and its W gathers them again; any other linear defers to `sink` as usual."""

    def __init__(self, seq: SequenceParallel, rows: torch.Tensor, full: torch.Tensor,
                 sink: list[WGradEntry]) -> None:
        self.seq, self.rows, self.full, self.sink = seq, rows, full, sink
        self._again: torch.Tensor | None = None

    def route_linear(self, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        if x is self.full:
            return _RegatheredLinearFn.apply(x, weight, self, bias)
        return _LinearFn.apply(x, weight, self.sink, bias)

    def gathered(self) -> torch.Tensor:
        """The full input again, gathered once for all of this unit's matrices."""
        if self._again is None:
            self._again = self.seq.gather(self.rows)
        return self._again


class _RegatheredLinearFn(torch.autograd.Function):
    """y = x W^T (+ b) on the gathered x, keeping nothing of x: B gives dx = dy W, and
    W's record holds the rows (RegatheredLinearGrad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, source: RegatheredInput,
                bias: torch.Tensor | None):
        ctx.save_for_backward(weight)
        ctx.source, ctx.bias = source, bias
        y = x @ weight.t()
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        src = ctx.source
        src.sink.append(RegatheredLinearGrad(weight, src.rows, grad_out, ctx.bias, src))
        return grad_out @ weight, None, None, None


@dataclass
class RegatheredLinearGrad:
    """LinearGrad whose input is kept as this rank's rows and gathered again in W."""

    weight: torch.Tensor
    x: torch.Tensor
    """This rank's rows of the input [b, s/t, in] (what the memory accounting sees)."""
    grad_out: torch.Tensor
    bias: torch.Tensor | None
    source: RegatheredInput = field(repr=False)

    def accumulate(self) -> None:
        LinearGrad(self.weight, self.source.gathered(), self.grad_out, self.bias).accumulate()
