"""The decoder cut into units at its TP all-reduces, the units that braided
execution blocks interleave (STP paper arXiv 2510.27257, Fig. 3).

A unit computes up to a partial sum, the caller all-reduces it over the TP
group, and a cheap epilogue finishes the unit. Forward of one layer:

      x --+--> RMSNorm -> wq,wk,wv (col) -> RoPE, attention -> wo (row) --> partial
          |                                                                   |
          |                                                      [ all-reduce ]  <- unit boundary
          +-------------------------- residual add (forward_finish) <--------+--> x'
      x'--+--> RMSNorm -> w1,w3 (col) -> silu(gate) * up -> w2 (row) -------> partial
          |                                                      [ all-reduce ]
          +-------------------------- residual add (forward_finish) <--------+--> x''

Backward is the mirror image: backward_partial runs from the unit's output
gradient g down to the partial input gradient of the column-parallel matrices
(each rank holds some heads / some of the MLP width); after the all-reduce,
backward_finish runs the RMSNorm backward and adds the residual gradient g.
The epilogues are a few element-wise ops, so a braiding executor can fold a
unit's finish into the start of the next unit it runs and keep one all-reduce
in flight while the other pass computes.

The stage's two ends, the embedding and the loss, are units too
(stp.models.decoder.end_units).

Unit methods, in the order a pass calls them for microbatch mb:
  F: forward_partial(mb, x[, targets]) -> partial;  forward_finish(mb, reduced) -> y
  B: backward_partial(mb, g) -> partial or None;    backward_finish(mb, reduced) -> dx
  W: weight(mb)   (the deferred weight gradients into .grad, Zero Bubble paper, arXiv 2401.10241)
"""

from __future__ import annotations

from typing import Protocol

import torch

from stp.models.decoder.chunked import (
    ChunkedRegion,
    attention_chunk_body,
    attention_chunk_grads,
    mlp_chunk_body,
    mlp_chunk_grads,
)
from stp.models.decoder.doc_masks import DocumentMasks
from stp.models.decoder.kernels import EAGER, Kernels
from stp.models.decoder.rope import RopeCache, apply_rope
from stp.models.recompute import attention_core
from stp.models.tp.sequence import RegatheredInput, ToScatter
from stp.models.tp.wgrad import GradTaps, WGradEntry
from stp.models.unit import Unit, _MbState, input_grad

__all__ = ["Unit", "AttentionUnit", "MLPUnit", "RopeCache", "apply_rope"]


class _Normed(Protocol):
    """A unit that begins with RMSNorm: a residual unit, or the loss unit
    (stp.models.decoder.end_units)."""

    kernels: Kernels
    norm_w: torch.Tensor
    eps: float
    one_graph: bool

    def _sink(self, st: _MbState, mb: int, one_graph: bool) -> GradTaps | None: ...


def _norm_graph(unit: _Normed, st: _MbState, mb: int,
                x: torch.Tensor) -> tuple[torch.Tensor, GradTaps | None]:
    """RMSNorm of a unit's input x with its autograd graph (x_in a fresh leaf), the
    start of the forward that B walks; kept as x_in and h."""
    with torch.enable_grad():
        x_in = x.detach().requires_grad_(True)
        sink = unit._sink(st, mb, unit.one_graph)
        h = unit.kernels.norm(x_in, unit.norm_w, unit.eps, sink)
    st.saved.update(x_in=x_in, h=h)
    return h, sink


class _ResidualUnit(ChunkedRegion, Unit):
    """x -> x + f(RMSNorm(x)), f ending in a row-parallel matrix. Two autograd graphs,
    x -> h (the norm) and h -> partial (the TP body), so the all-reduce of dh sits
    between them, outside autograd. `one_graph` (one TP rank: the all-reduce is the
    identity): a single graph x -> partial, so B walks it with one engine call and
    backward_partial returns None (nothing to reduce).

    With full recomputation (stp.models.recompute) the forward runs the same
    functions without a graph and keeps x alone; backward_partial first runs the
    forward again with its graph (`_rebuild`), then walks it as it would have.
    Under sequence parallelism the rebuild's all-gather is launched by
    `prepare_backward` where the runner advances the chain (after the output
    gradient's gather, so every TP rank issues them in one order), else at the
    start of backward_partial and waited for at once."""

    kernels: Kernels = EAGER
    """The pieces between the linears (stp.models.decoder.kernels), set by the stage:
    eager, or compiled (stp.models.compile)."""

    def __init__(
        self, name: str, norm_weight: torch.Tensor, eps: float, one_graph: bool = False
    ) -> None:
        super().__init__(name)
        self.norm_w = norm_weight
        self.eps = eps
        self.one_graph = one_graph

    def _body(self, h: torch.Tensor, sink: list[WGradEntry] | None) -> torch.Tensor:
        raise NotImplementedError

    def _matrices(self) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def weights(self) -> list[torch.Tensor]:
        return [w for w in (self.norm_w, *self._matrices()) if w is not None]

    def branch(self, x: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        """f(RMSNorm(x)) in one graph, for one TP rank (stp.models.decoder.chunk)."""
        return self._body(self.kernels.norm(x, self.norm_w, self.eps, sink), sink)

    def _graphless_sink(self) -> list[WGradEntry] | None:
        """For a forward without a graph (full recomputation): the kind of sink the
        graph's forward uses (F.linear at one TP rank, the deferring Functions
        otherwise), so the values are the same bits; nothing is recorded."""
        return None if self.one_graph else []

    def _norm(self, mb: int, x: torch.Tensor) -> tuple[_MbState, torch.Tensor, GradTaps | None]:
        """The unit's start: RMSNorm of its input (this rank's rows under SP)."""
        st = self._enter(mb, None, "F-partial")
        st.saved["x"] = x
        if self.recompute == "full":
            with torch.no_grad():
                return st, self.kernels.norm(x, self.norm_w, self.eps,
                                             self._graphless_sink()), None
        h, sink = _norm_graph(self, st, mb, x)
        return st, h, sink

    def _body_graph(self, st: _MbState, h: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
        """The TP body on h_in (the norm's output h, gathered under SP) as a graph of
        its own; kept as h_in and out."""
        h_in.requires_grad_(True)
        sink: list[WGradEntry] | RegatheredInput = st.sink
        if self.seq is not None:  # the matrices keep this rank's rows; W gathers again
            sink = RegatheredInput(self.seq, h.detach(), h_in, st.sink)
        with torch.enable_grad():
            out = self._body(h_in, sink)
        if self.seq is not None:  # nothing reads the gathered values again: free them
            h_in.untyped_storage().resize_(0)
        st.saved.update(h_in=h_in, out=out)
        return out

    def _rebuild(self, st: _MbState, mb: int) -> None:
        """Full recomputation, at the start of B: the forward again from the kept
        input, with the graph (and the taps) the forward without recomputation
        keeps."""
        gather = st.saved.pop("rebuild_gather", None)  # prepare_backward ran
        if gather is not None:
            self._body_graph(st, st.saved["h"], gather.wait())
            return
        h, sink = _norm_graph(self, st, mb, st.saved.pop("x"))
        if self.one_graph:
            with torch.enable_grad():
                st.saved["out"] = self._body(h, sink)
            del st.saved["h"]  # one graph: x_in -> out
            return
        self._body_graph(st, h, self._gathered(h.detach()))  # SP: an all-gather waited at once

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        """SP: launch the output gradient's all-gather; with full recomputation also
        rebuild the norm and launch the all-gather of its rows, so both fly under the
        partner's next item (stp.runtime.braid's advance)."""
        st = self._states.get(mb)
        ready = self.seq is not None and st is not None and st.phase == "F"
        super().prepare_backward(mb, grad)
        if ready and self.recompute == "full":
            assert st is not None and self.seq is not None
            h, _ = _norm_graph(self, st, mb, st.saved.pop("x"))
            st.saved["rebuild_gather"] = self.seq.launch_gather(h.detach())

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        """SP: the norm and the launch of its all-gather ahead of forward_partial, so the
        runner can hide the gather under the partner's unit (stp.runtime.braid)."""
        if self.seq is not None:
            st, h, _ = self._norm(mb, x)
            st.saved["gather"] = self._launch_gather(h.detach())

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | ToScatter:
        full = self.recompute == "full"
        st = self._states.get(mb)
        if st is not None and "gather" in st.saved:  # prepare_forward ran
            if self.overlap:
                return self._chunked_forward(st, st.saved.pop("gather"))
            h_in = st.saved.pop("gather").wait()
        else:
            st, h, sink = self._norm(mb, x)
            if self.one_graph and not full:
                with torch.enable_grad():
                    out = self._body(h, sink)
                del st.saved["h"]  # one graph: x_in -> out
                st.saved["out"] = out
                return out.detach()
            if self.overlap:
                return self._chunked_forward(st, self._launch_gather(h.detach()))
            # SP: the column-parallel matrices read it; W gathers the rows again
            h_in = self._gathered(h.detach())
        if full:
            with torch.no_grad():
                return self._handoff(self._body(h_in, self._graphless_sink()))
        out = self._body_graph(st, st.saved["h"], h_in)
        return self._handoff(out.detach())

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        # full recomputation keeps the input for B
        x = st.saved["x"] if self.recompute == "full" else st.saved.pop("x")
        return x + reduced

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":
            self._rebuild(st, mb)
        if self.one_graph:
            out, x_in = st.saved.pop("out"), st.saved.pop("x_in")
            st.saved["grad"] = grad + self._input_grad(st, out, x_in, grad)
            return None
        gather = st.saved.pop("grad_gather", None)  # prepare_backward ran
        if self.overlap:
            st.saved["grad"] = grad
            return self._chunked_backward(st, gather or self._launch_gather(grad))
        full = gather.wait() if gather is not None else self._gathered(grad)
        grad_h = input_grad(st.saved.pop("out"), st.saved.pop("h_in"), full)
        st.saved["grad"] = grad  # the residual's gradient: this rank's rows under SP
        return self._handoff(grad_h)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        grad = st.saved.pop("grad")
        if not self.one_graph:
            assert reduced is not None
            grad = grad + input_grad(st.saved.pop("h"), st.saved.pop("x_in"), reduced)
        self._close(mb)
        return grad


class AttentionUnit(_ResidualUnit):
    """Causal grouped-query attention over this rank's heads (num_heads / tp query heads,
    num_kv_heads / tp kv heads: a rank's query heads use only its own kv heads; with
    fewer kv heads than ranks, the one kv head they use, replicated). `biases`: the
    q, k, v biases (Qwen2), sharded like their matrices' rows."""

    def __init__(
        self,
        layer: int,
        norm_weight: torch.Tensor,
        wq: torch.Tensor,
        wk: torch.Tensor,
        wv: torch.Tensor,
        wo: torch.Tensor,
        *,
        head_dim: int,
        eps: float,
        rope: RopeCache,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        one_graph: bool = False,
    ) -> None:
        super().__init__(f"layers.{layer}.attn", norm_weight, eps, one_graph)
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.bq, self.bk, self.bv = biases if biases is not None else (None, None, None)
        self.head_dim = head_dim
        self.rope = rope

    def _matrices(self) -> list[torch.Tensor | None]:
        return [self.wq, self.wk, self.wv, self.wo, self.bq, self.bk, self.bv]

    documents: DocumentMasks | None = None
    """The stage's document-masking tables when the run masks documents (set by
    ModelStage.load_documents); None: plain causal attention at positions 0..s-1."""

    def _tables(self, h: torch.Tensor, seq_len: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, mask) for the microbatch being computed (seq_len: h's rows)."""
        if self.documents is None:
            cos, sin = self.rope.get(seq_len or h.shape[1], h.device, h.dtype)
            return cos, sin, None
        return self.documents.tables()

    def at(self, mb: int) -> None:
        """Name the microbatch the next body computes (its document tables)."""
        if self.documents is not None:
            self.documents.current = mb

    def _body(self, h: torch.Tensor, sink: list[WGradEntry] | None) -> torch.Tensor:
        cos, sin, mask = self._tables(h)
        return self.kernels.attention(h, (self.wq, self.wk, self.wv), self.wo,
                                      (self.bq, self.bk, self.bv), cos, sin, self.head_dim,
                                      sink, self.recompute, mask)  # [b, s, h], partial over TP

    def branch(self, x: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        cos, sin, mask = self._tables(x)
        q, k, v = self.kernels.norm_qkv_rope(x, self.norm_w, self.eps, (self.wq, self.wk, self.wv),
                                             (self.bq, self.bk, self.bv), cos, sin, self.head_dim,
                                             sink)
        return self._attend(q, k, v, sink, mask)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sink: list[WGradEntry] | GradTaps | None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        o = attention_core(q, k, v, causal=True, gqa=True, recompute=self.recompute, mask=mask)
        return self.kernels.attn_out(o, self.wo, sink)  # [b, s, h], partial over TP

    _chunk_body = attention_chunk_body
    _chunk_grads = attention_chunk_grads

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        self.at(mb)
        super().prepare_forward(mb, x)

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | ToScatter:
        self.at(mb)
        return super().forward_partial(mb, x, targets)

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        self.at(mb)
        super().prepare_backward(mb, grad)

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        self.at(mb)  # full recomputation runs the body again here
        return super().backward_partial(mb, grad)


class MLPUnit(_ResidualUnit):
    """SwiGLU MLP over this rank's slice of the inner width: w2(silu(w1 h) * w3 h)."""

    def __init__(
        self,
        layer: int,
        norm_weight: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        *,
        eps: float,
        one_graph: bool = False,
    ) -> None:
        super().__init__(f"layers.{layer}.mlp", norm_weight, eps, one_graph)
        self.w1, self.w3, self.w2 = w1, w3, w2

    def _matrices(self) -> list[torch.Tensor | None]:
        return [self.w1, self.w3, self.w2]

    def _body(self, h: torch.Tensor, sink: list[WGradEntry] | None) -> torch.Tensor:
        return self.kernels.mlp(h, self.w1, self.w3, self.w2, sink)  # [b, s, h], partial over TP

    _chunk_body = mlp_chunk_body
    _chunk_grads = mlp_chunk_grads

    def branch(self, x: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        return self.kernels.norm_mlp(x, self.norm_w, self.eps, self.w1, self.w3, self.w2, sink)
