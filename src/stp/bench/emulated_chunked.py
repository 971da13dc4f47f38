"""Emulated compute with in-layer TP overlap, for `stp bench fidelity --tp-overlap-chunks K`.

An `EmulatedChunkedStage` is stp.bench.emulated_sp's stage (emulated units with
sequence parallelism's all-gather before and reduce-scatter after each F and B
unit) with each unit cut into K chunks along the sequence, as
stp.models.decoder.chunked cuts the decoder's units: the K chunk all-gathers
launched at once (stp.models.tp.overlap.ChunkedGather, early when the runner
prepares them), chunk k's emulated compute (1/K of the unit's) started when
chunk k's gather is in, chunk k's reduce-scatter launched as its compute ends,
and the last chunk handed to the runner as a ChunkedScatter (braided like any
reduce-scatter). W gathers its input rows again, chunk by chunk, as the real
units' ChunkedRegather does: chunk k waited for before 1/K of W's compute.
The collectives are the runtime's own (stp.models.tp.overlap), with the real
sizes; only the compute is a timed wait.
"""

from __future__ import annotations

from typing import Any

import torch

from stp.bench.emulated_sp import EmulatedSPStage, _SPUnit
from stp.models.emulated import hold
from stp.models.tp.overlap import ChunkedGather, ChunkedScatter

__all__ = ["EmulatedChunkedStage"]


class _ChunkedUnit(_SPUnit):
    """An emulated SP unit whose gather, compute and scatter run in K chunks."""

    owner: EmulatedChunkedStage

    def _launch(self, mb: int) -> ChunkedGather:
        return ChunkedGather(self.owner.seq, self.owner.rows(mb), self.owner.chunks)

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        if self._gathers_input():
            self.pending[(mb, "F")] = self._launch(mb)  # type: ignore[assignment]  # chunked here

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        self.pending[(mb, "B")] = self._launch(mb)  # type: ignore[assignment]  # chunked here

    def _run_chunks(self, mb: int, pass_kind: str, seconds: float,
                    gathers: bool) -> ChunkedScatter:
        """Chunk k: wait for its gather, compute 1/K, launch its scatter; the last
        chunk's partial goes to the runner."""
        k_all, seq = self.owner.chunks, self.owner.seq
        gather: Any = None
        if gathers:
            gather = self.pending.pop((mb, pass_kind), None) or self._launch(mb)
        partial = self.owner.buffer(mb)
        p = partial.shape[1] // k_all
        flying = []
        for k in range(k_all):
            if gather is not None:
                gather.wait(k)
            hold(seconds / k_all)
            piece = partial.narrow(1, k * p, p)
            if k < k_all - 1:
                flying.append(seq.launch_scatter(piece))
        self.owner.pieces_launched += k_all
        return ChunkedScatter(piece, flying)

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> Any:
        if self.index == 0:
            full = x.shape[1] * (1 if self.owner.is_first else self.owner.tp_size)
            self.owner.shapes[mb] = (x.shape[0], full, self.owner.hidden)
        return self._run_chunks(mb, "F", self.owner.times.f, self._gathers_input())

    def backward_partial(self, mb: int, grad: torch.Tensor) -> Any:
        return self._run_chunks(mb, "B", self.owner.times.b, True)

    def weight(self, mb: int) -> None:
        """The input rows gathered again chunk by chunk under W's compute; the shapes
        of mb are gone after its B (backward_finish), so the last-seen rows stand in
        (same size: every microbatch has one shape here)."""
        k_all, w = self.owner.chunks, self.owner.times.w
        if not self._gathers_input() or not self.owner._rows:
            hold(w)
            return
        gather = ChunkedGather(self.owner.seq, self.owner._rows[0], k_all)
        for k in range(k_all):
            gather.wait(k)
            hold(w / k_all)


class EmulatedChunkedStage(EmulatedSPStage):
    """An EmulatedSPStage whose units cut their collectives and compute into `chunks`
    pieces (module doc); `pieces_launched` counts the reduce-scatter pieces issued."""

    def __init__(self, stage: int, num_stages: int, *, chunks: int, **kwargs: Any) -> None:
        super().__init__(stage, num_stages, **kwargs)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
        self.chunks = chunks
        self.pieces_launched = 0
        self.units = tuple(_ChunkedUnit(u.name, self, u.index) for u in self.units)

    def launch_allreduce(self, partial: Any) -> tuple[torch.Tensor, Any]:
        """The last chunk's reduce-scatter, its work waiting for every chunk's."""
        return partial.launch(self.seq)

    def _reduce(self, partial: Any) -> torch.Tensor:
        rows, work = self.launch_allreduce(partial)
        work.wait()
        return rows
