"""In-layer TP overlap in the decoder's units (stp.models.tp.overlap has the chunk
layout and the collectives): a residual unit under sequence parallelism with
`overlap` = K > 0 runs its TP region chunk by chunk.

    MLP F:  AG chunks launched | mm(0) | mm(1) ... | mm(K-1)      (all row-wise)
            RS(k) launched as chunk k's w2 product is ready; RS(K-1): the unit's
    Attn F: qkv(0) ... qkv(K-1) under the gathers | RoPE + core on the whole
            sequence, in order | wo(0) ... wo(K-1), RS(k) after wo(k)
    MLP B:  dy gathers launched (prepare_backward) | dx(k) = chunk k's walk, RS(k)
    Attn B: wo's input gradient chunk by chunk under the dy gathers | one walk
            through the core and the projections | RS of every chunk

The attention core needs every row (causal and document masks, RoPE positions),
so only its projections are chunked; it sees the sequence reassembled in order
(`to_sequence`), exactly the tensor the unchunked unit computes on. Every
chunk's rows keep their own positions: chunk k holds piece k of each rank's
rows, and `to_sequence` puts each row back at its index.

W gathers the input of the column-parallel matrices again, chunk by chunk
(ChunkedRegather): dW = sum_k dy_k^T x_k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stp.models.recompute import attention_core
from stp.models.tp.layers import linear
from stp.models.tp.overlap import (
    ChunkedGather,
    ChunkedRegather,
    ChunkedScatter,
    to_chunks,
    to_sequence,
)
from stp.models.tp.sequence import SequenceParallel
from stp.models.unit import _MbState, input_grad, input_grads

__all__ = ["ChunkedRegion", "attention_chunk_body", "attention_chunk_grads", "mlp_chunk_body",
           "mlp_chunk_grads"]

Ready = Callable[[int, torch.Tensor], None]
Unit = Any
"""The functions below are methods of stp.models.decoder.units' AttentionUnit and
MLPUnit (that module imports this one, so they are typed loosely here)."""


class ChunkedRegion:
    """The chunk driver of a residual unit (stp.models.decoder.units._ResidualUnit)."""

    seq: SequenceParallel | None
    overlap: int

    def _chunk_input(self, st: _MbState, gather: ChunkedGather, source: ChunkedRegather,
                     k: int) -> torch.Tensor:
        """Gathered chunk k as the leaf the column-parallel matrices read (kept empty:
        W gathers it again)."""
        h_k = source.take(k, gather.wait(k))
        st.saved[f"h_in.{k}"] = h_k
        return h_k

    def _chunk_body(self, st: _MbState, gather: ChunkedGather, source: ChunkedRegather,
                    ready: Ready) -> None:
        """The TP body chunk by chunk, `ready(k, partial_k)` as each chunk's partial
        sum is computed; saves what `_chunk_grads` walks."""
        raise NotImplementedError

    def _chunk_grads(self, st: _MbState, gather: ChunkedGather, ready: Ready) -> None:
        """B's input gradient chunk by chunk, `ready(k, dh_k)` as each is computed."""
        raise NotImplementedError

    def _chunked(self, run: Callable[[Ready], None]) -> ChunkedScatter:
        """Run `run(ready)`: every chunk but the last reduce-scattered as soon as it is
        ready, the last one handed to the runner (braided like any reduce-scatter)."""
        assert self.seq is not None
        seq, flying, last = self.seq, [], []

        def ready(k: int, partial: torch.Tensor) -> None:
            if k < self.overlap - 1:
                flying.append(seq.launch_scatter(partial.detach()))
            else:
                last.append(partial.detach())
        run(ready)
        return ChunkedScatter(last[0], flying)

    def _chunked_forward(self, st: _MbState, gather: ChunkedGather) -> ChunkedScatter:
        assert self.seq is not None
        source = ChunkedRegather(self.seq, st.saved["h"].detach(), self.overlap, st.sink)

        def run(ready: Ready) -> None:
            with torch.enable_grad():
                self._chunk_body(st, gather, source, ready)
        scatter = self._chunked(run)
        for k in range(self.overlap):  # nothing reads the gathered values again
            st.saved[f"h_in.{k}"].untyped_storage().resize_(0)
        return scatter

    def _chunked_backward(self, st: _MbState, gather: ChunkedGather) -> ChunkedScatter:
        return self._chunked(lambda ready: self._chunk_grads(st, gather, ready))


def attention_chunk_body(self: Unit, st: _MbState, gather: ChunkedGather,
                         source: ChunkedRegather, ready: Ready) -> None:
    """q, k, v projected chunk by chunk under the gathers; RoPE and the core on the
    sequence reassembled in order (positions and masks as without chunks); the
    output projection chunk by chunk, each chunk's reduce-scatter under the next."""
    assert self.seq is not None
    t, n = self.seq.size, self.overlap
    parts: tuple[list[torch.Tensor], ...] = ([], [], [])
    for k in range(n):
        h_k = self._chunk_input(st, gather, source, k)
        for part, w, bias in zip(parts, (self.wq, self.wk, self.wv),
                                 (self.bq, self.bk, self.bv), strict=True):
            part.append(linear(h_k, w, source, bias))
    b, s = h_k.shape[0], h_k.shape[1] * n
    cos, sin, mask = self._tables(h_k, s)
    q, k_, v = (to_sequence(p, t).view(b, s, -1, self.head_dim).transpose(1, 2)
                for p in parts)
    q, k_ = self.kernels.rope(q, k_, cos, sin)
    o = attention_core(q, k_, v, causal=True, gqa=True, recompute=self.recompute, mask=mask)
    # the chunks in one buffer [K, b, t p, h], which wo's chunks read as views: kept once
    o_chunks = torch.stack(to_chunks(o.transpose(1, 2).reshape(b, s, -1), t, n))
    st.saved["o"] = o_chunks
    for k in range(n):
        leaf = o_chunks[k].detach().requires_grad_(True)  # B walks wo chunk by chunk
        out = linear(leaf, self.wo, source)
        st.saved[f"o_in.{k}"], st.saved[f"out.{k}"] = leaf, out
        ready(k, out)



def attention_chunk_grads(self: Unit, st: _MbState, gather: ChunkedGather,
                          ready: Ready) -> None:
    """wo's input gradient chunk by chunk under the output gradient's gathers; the
    core and the projections in one walk (the core needs every row)."""
    n = self.overlap
    d_o = tuple(input_grad(st.saved.pop(f"out.{k}"), st.saved.pop(f"o_in.{k}"),
                           gather.wait(k)) for k in range(n))
    h_in = tuple(st.saved.pop(f"h_in.{k}") for k in range(n))
    for k, dh in enumerate(input_grads((st.saved.pop("o"),), h_in, (torch.stack(d_o),))):
        ready(k, dh)


def mlp_chunk_body(self: Unit, st: _MbState, gather: ChunkedGather,
                   source: ChunkedRegather, ready: Ready) -> None:
    """Row-wise throughout: chunk k's whole MLP under chunk k+1's gather."""
    for k in range(self.overlap):
        h_k = self._chunk_input(st, gather, source, k)
        out = self._body(h_k, source)
        st.saved[f"out.{k}"] = out
        ready(k, out)



def mlp_chunk_grads(self: Unit, st: _MbState, gather: ChunkedGather, ready: Ready) -> None:
    """Chunk k's input gradient under chunk k+1's gather, its reduce-scatter under k+1's."""
    for k in range(self.overlap):
        ready(k, input_grad(st.saved.pop(f"out.{k}"), st.saved.pop(f"h_in.{k}"),
                            gather.wait(k)))
