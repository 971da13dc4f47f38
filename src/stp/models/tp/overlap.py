"""In-layer TP overlap (async TP): a unit's sequence-parallel collectives cut into K
chunks along the sequence, each chunk's collective in flight while the next
chunk's matmul runs (the technique of Megatron-LM's --tp-comm-overlap and
torchtitan's async TP; the units it cuts are stp.models.decoder.units').

Chunk k of a gathered tensor is piece k of every TP rank's s/t rows: rank r's
rows [r s/t + k p, r s/t + (k+1) p), p = s/(tK), rank after rank -- the
"chunk layout" [b, t p, ...]. It is what one all-gather of every rank's piece k
gives (SequenceParallel.launch_gather on [b, p, ...]), and what one
reduce-scatter of a [b, t p, ...] partial splits back into this rank's piece k
(SequenceParallel.launch_scatter). So row-wise work (the column-parallel
matrices, SwiGLU, the row-parallel matrix) runs on chunk-layout tensors with no
reordering at all, and only work that needs every row in order (RoPE by
position, the causal / document-masked attention core) reassembles the
sequence (`to_sequence`) and cuts it again afterwards (`to_chunks`).

    compute:   mm(0)  | mm(1)  | mm(2)  | mm(3)
    TP:      [AG 1 ...][AG 2 ...][AG 3 ...]           all K gathers launched at once
                       [RS 0 ...][RS 1 ...][RS 2 ...]  [RS 3: the unit's ToScatter]

The first chunk's gather is exposed (nothing runs before it), and the last
chunk's reduce-scatter is the unit's `ChunkedScatter`, which the runner
(stp.runtime.braid) launches and braids like any reduce-scatter: its work
waits for every chunk's reduce-scatter and lays the pieces into this rank's
rows.

W (the deferred weight gradients) needs the gathered input of the
column-parallel matrices. As without chunks it is gathered again in W
(`ChunkedRegather`: the K chunk gathers launched at W's first matrix, chunk k
waited for just before dW += dy_k^T x_k), so the bytes kept from F to B are
those of sequence parallelism: this rank's s/t rows.
"""

from __future__ import annotations

from typing import Any

import torch

from stp.models.tp.layers import _LinearFn
from stp.models.tp.sequence import (
    PendingGather,
    RegatheredInput,
    SequenceParallel,
    ToScatter,
    _RegatheredLinearFn,
)
from stp.models.tp.wgrad import WGradEntry

__all__ = ["ChunkedGather", "ChunkedRegather", "ChunkedScatter", "ChunkedWork",
           "check_chunks", "to_chunks", "to_sequence"]


def check_chunks(seq_len: int, tp: int, chunks: int) -> None:
    """ValueError (one line) unless each TP rank's s/t rows split into `chunks` pieces."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"--tp-overlap-chunks must be an integer >= 1, got {chunks!r}")
    if tp > 1 and (seq_len % tp or (seq_len // tp) % chunks):
        raise ValueError(f"--tp-overlap-chunks {chunks}: each TP rank's rows (--seq-len "
                         f"{seq_len} / --tp {tp}) must divide into {chunks} chunks")


def to_sequence(chunks: list[torch.Tensor], tp: int) -> torch.Tensor:
    """K chunk-layout tensors [b, t p, ...] -> the sequence in order [b, t K p, ...]."""
    b, rows, *rest = chunks[0].shape
    p = rows // tp
    parts = [c.reshape(b, tp, p, *rest) for c in chunks]
    return torch.stack(parts, dim=2).reshape(b, tp * len(chunks) * p, *rest)


def to_chunks(full: torch.Tensor, tp: int, k: int) -> list[torch.Tensor]:
    """The inverse of `to_sequence`: [b, s, ...] -> K chunk-layout tensors [b, s/K, ...]."""
    b, s, *rest = full.shape
    p = s // (tp * k)
    blocks = full.reshape(b, tp, k, p, *rest)
    return [blocks[:, :, i].reshape(b, tp * p, *rest) for i in range(k)]


class ChunkedGather:
    """The K chunk all-gathers of this rank's rows [b, s/t, ...], all launched at once
    (they complete in launch order); `wait(k)` gives chunk k [b, t p, ...]."""

    def __init__(self, seq: SequenceParallel, local: torch.Tensor, chunks: int) -> None:
        p = local.shape[1] // chunks
        self.pending: list[PendingGather | None] = [
            seq.launch_gather(local.narrow(1, k * p, p)) for k in range(chunks)]

    def wait(self, k: int) -> torch.Tensor:
        pending = self.pending[k]
        assert pending is not None, f"chunk {k} of an all-gather waited for twice"
        self.pending[k] = None
        return pending.wait()


class ChunkedWork:
    """The works of a unit's K chunk reduce-scatters as one (what the runner waits on):
    complete when all are, and then this rank's rows `out` hold every piece."""

    def __init__(self, pieces: list[tuple[torch.Tensor, Any]], out: torch.Tensor) -> None:
        self.pieces, self.out = pieces, out
        self._laid = False

    def _lay(self) -> None:
        if not self._laid:
            p = self.pieces[0][0].shape[1]
            for k, (piece, _) in enumerate(self.pieces):
                self.out.narrow(1, k * p, p).copy_(piece)
            self._laid, self.pieces = True, []

    def is_completed(self) -> bool:
        if self._laid or all(w is None or w.is_completed() for _, w in self.pieces):
            self._lay()
            return True
        return False

    def wait(self) -> bool:
        for _, work in self.pieces:
            if work is not None:
                work.wait()
        self._lay()
        return True


class ChunkedScatter(ToScatter):
    """A unit's last chunk of partial sums [b, t p, h] (chunk layout) to reduce-scatter,
    with the works of the earlier chunks' reduce-scatters already in flight."""

    collective = "RS"
    flying: list[tuple[torch.Tensor, Any]]
    """The earlier chunks' (rows, work), set once in __init__ (the base is frozen)."""

    def __init__(self, partial: torch.Tensor, flying: list[tuple[torch.Tensor, Any]]) -> None:
        super().__init__(partial)
        object.__setattr__(self, "flying", flying)

    def launch(self, seq: SequenceParallel) -> tuple[torch.Tensor, Any]:
        last = seq.launch_scatter(self.partial)
        pieces = [*self.flying, last]
        b, p, *rest = last[0].shape
        out = last[0].new_empty((b, p * len(pieces), *rest))
        return out, ChunkedWork(pieces, out)


class _ChunkSource:
    """What `_RegatheredLinearFn` records for a matrix reading chunk k: this rank's
    piece k (kept), and chunk k gathered again in W."""

    def __init__(self, owner: ChunkedRegather, k: int) -> None:
        self.owner, self.k, self.sink = owner, k, owner.sink
        p = owner.rows.shape[1] // owner.chunks
        self.rows = owner.rows.narrow(1, k * p, p)

    def gathered(self) -> torch.Tensor:
        return self.owner.gathered(self.k)


class ChunkedRegather(RegatheredInput):
    """RegatheredInput for a unit cut into chunks: a linear reading one of the gathered
    chunks keeps nothing of it; W gathers it again chunk by chunk."""

    def __init__(self, seq: SequenceParallel, rows: torch.Tensor, chunks: int,
                 sink: list[WGradEntry]) -> None:
        super().__init__(seq, rows, rows, sink)
        self.chunks = chunks
        self._inputs: dict[int, _ChunkSource] = {}
        self._again_chunks: ChunkedGather | None = None
        self._got: dict[int, torch.Tensor] = {}

    def take(self, k: int, gathered: torch.Tensor) -> torch.Tensor:
        """Gathered chunk k as the leaf the unit's matrices read."""
        gathered.requires_grad_(True)
        self._inputs[id(gathered)] = _ChunkSource(self, k)
        return gathered

    def route_linear(self, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        source = self._inputs.get(id(x))
        if source is not None:
            return _RegatheredLinearFn.apply(x, weight, source, bias)
        return _LinearFn.apply(x, weight, self.sink, bias)

    def gathered(self, k: int = 0) -> torch.Tensor:
        """Chunk k again (W): every chunk's gather launched at the first call."""
        if k not in self._got:
            if self._again_chunks is None:
                self._again_chunks = ChunkedGather(self.seq, self.rows, self.chunks)
            for i in range(k + 1):  # in order: a chunk is waited for once
                if i not in self._got and self._again_chunks.pending[i] is not None:
                    self._got[i] = self._again_chunks.wait(i)
        return self._got[k]
