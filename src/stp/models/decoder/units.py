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

Unit methods, in the order a pass calls them for microbatch mb:
  F: forward_partial(mb, x[, targets]) -> partial;  forward_finish(mb, reduced) -> y
  B: backward_partial(mb, g) -> partial or None;    backward_finish(mb, reduced) -> dx
  W: weight(mb)   (the deferred weight gradients into .grad, Zero Bubble paper, arXiv 2401.10241)
"""

from __future__ import annotations

import torch

from stp.models.decoder.doc_masks import DocumentMasks
from stp.models.decoder.kernels import EAGER, Kernels
from stp.models.decoder.rope import RopeCache, apply_rope
from stp.models.recompute import attention_core
from stp.models.tp.layers import (
    linear,
    vocab_ce_finish,
    vocab_embedding_partial,
)
from stp.models.tp.sequence import RegatheredInput, ToScatter
from stp.models.tp.wgrad import EmbedGrad, GradTaps, WGradEntry
from stp.models.unit import Unit, _MbState, input_grad

__all__ = ["Unit", "EmbedUnit", "AttentionUnit", "MLPUnit", "LossUnit", "RopeCache", "apply_rope"]


class EmbedUnit(Unit):
    """Vocab-parallel embedding (stage 0): partial rows, all-reduce, identity finish.
    No input gradient (token ids), so its backward has nothing to reduce. The row of
    `pad_token_id` gets no gradient (torch.nn.Embedding's padding_idx).
    `whole_vocab` (one TP rank): the weight holds every token's row, so the lookup
    needs no ownership mask and B keeps the ids alone (the stage has checked them;
    the pad row's gradient is zeroed instead of masked out)."""

    def __init__(
        self, weight: torch.Tensor, vocab_start: int, pad_token_id: int | None = None,
        *, whole_vocab: bool = False,
    ) -> None:
        super().__init__("embed")
        self.w = weight
        self.vocab_start = vocab_start
        self.pad_token_id = pad_token_id
        self.whole_vocab = whole_vocab and vocab_start == 0

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        st = self._enter(mb, None, "F-partial")
        if self.whole_vocab:
            st.saved["ids"] = x
            return self._handoff(self.w.detach()[x])
        partial, owned, local = vocab_embedding_partial(x, self.w.detach(), self.vocab_start)
        if self.pad_token_id is not None:
            owned = owned & (x != self.pad_token_id)  # looked up, never trained
        st.saved.update(owned=owned, local=local)
        return self._handoff(partial)

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        self._enter(mb, "F-partial", "F")
        return reduced

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        gather = st.saved.pop("grad_gather", None)  # prepare_backward ran
        # SP: the dual of the forward's reduce-scatter
        grad = gather.wait() if gather is not None else self._gathered(grad)
        if "ids" in st.saved:  # every token's row is here (whole_vocab)
            ids = st.saved.pop("ids")
            if self.pad_token_id is not None:  # adds 0 to the pad row: it stays untrained
                grad = grad.masked_fill((ids == self.pad_token_id).unsqueeze(-1), 0.0)
            st.sink.append(EmbedGrad(self.w, ids.reshape(-1), grad.reshape(-1, grad.shape[-1])))
            return None
        owned, local = st.saved.pop("owned"), st.saved.pop("local")
        st.sink.append(EmbedGrad(self.w, local[owned], grad[owned]))
        return None

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        self._enter(mb, "B-partial", "B")
        self._close(mb)
        return None


def _norm_graph(unit: _ResidualUnit | LossUnit, st: _MbState, mb: int,
                x: torch.Tensor) -> tuple[torch.Tensor, GradTaps | None]:
    """RMSNorm of a unit's input x with its autograd graph (x_in a fresh leaf), the
    start of the forward that B walks; kept as x_in and h."""
    with torch.enable_grad():
        x_in = x.detach().requires_grad_(True)
        sink = unit._sink(st, mb, unit.one_graph)
        h = unit.kernels.norm(x_in, unit.norm_w, unit.eps, sink)
    st.saved.update(x_in=x_in, h=h)
    return h, sink


class _ResidualUnit(Unit):
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
            st.saved["gather"] = self.seq.launch_gather(h.detach())

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | ToScatter:
        full = self.recompute == "full"
        st = self._states.get(mb)
        if st is not None and "gather" in st.saved:  # prepare_forward ran
            h_in = st.saved.pop("gather").wait()
        else:
            st, h, sink = self._norm(mb, x)
            if self.one_graph and not full:
                with torch.enable_grad():
                    out = self._body(h, sink)
                del st.saved["h"]  # one graph: x_in -> out
                st.saved["out"] = out
                return out.detach()
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

    def _tables(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, mask) for the microbatch being computed."""
        if self.documents is None:
            cos, sin = self.rope.get(h.shape[1], h.device, h.dtype)
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

    def branch(self, x: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        return self.kernels.norm_mlp(x, self.norm_w, self.eps, self.w1, self.w3, self.w2, sink)


class LossUnit(Unit):
    """Final RMSNorm, column-parallel head (vocab-sharded logits) and vocab-parallel
    cross-entropy (last stage). Forward reduces the loss statistics
    (stp.models.tp.layers.vocab_ce_stats), backward the head's input gradient.
    Its backward_partial takes the loss gradient as a 0-dim tensor.

    The loss of a microbatch is the sum of its token losses over the number of
    target positions: targets equal to IGNORE_INDEX add nothing, so the Trainer
    turns the mean over all positions into the mean over the valid tokens of the
    global batch with one scale (and without ignored targets it is the plain mean).
    `vocab_valid`: this rank's real vocabulary rows; the rest are padding whose
    logits are masked out. `one_graph`: as for the residual units (one TP rank).
    With full recomputation it keeps its input and the loss's statistics, and B
    computes the logits again (they are [b, s, V / tp], a stage's largest tensor)."""

    kernels: Kernels = EAGER
    """As the residual units' (stp.models.decoder.kernels)."""

    def __init__(
        self,
        norm_weight: torch.Tensor,
        head_weight: torch.Tensor,
        *,
        eps: float,
        vocab_start: int,
        tp_size: int,
        tp_rank: int,
        vocab_valid: int | None = None,
        one_graph: bool = False,
    ) -> None:
        super().__init__("head")
        self.one_graph = one_graph
        self.norm_w, self.head_w = norm_weight, head_weight
        self.eps = eps
        self.vocab_start, self.tp_size, self.tp_rank = vocab_start, tp_size, tp_rank
        self.vocab_valid = head_weight.shape[0] if vocab_valid is None else vocab_valid

    def weights(self) -> list[torch.Tensor]:
        return [self.norm_w, self.head_w]

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        if targets is None:
            raise ValueError("the loss unit needs targets")
        st = self._states.get(mb)
        if st is not None and "gather" in st.saved:  # prepare_forward ran
            h_in, sink = st.saved.pop("gather").wait(), st.taps
        else:
            st, h, sink = self._norm(mb, x)
            h_in = h if self.one_graph else self._gathered(h.detach())
        st.saved["targets"] = targets
        if self.recompute == "full":  # B computes the logits again (`_logits`)
            with torch.no_grad():
                logits = linear(h_in, self.head_w, None)
        else:
            logits = self._logits(st, h_in, sink)
        return self.kernels.ce_stats(
            logits.detach(), targets, self.vocab_start, self.tp_size, self.tp_rank,
            self.vocab_valid,
        )

    def _logits(self, st: _MbState, h_in: torch.Tensor, sink: GradTaps | None) -> torch.Tensor:
        """The head on the normalised input with its graph (kept for B)."""
        if self.one_graph:
            del st.saved["h"]  # one graph: x_in -> logits
        else:
            h_in.requires_grad_(True)
            st.saved["h_in"] = h_in
        with torch.enable_grad():
            logits = linear(h_in, self.head_w, sink)  # [b, s, V / tp]
        st.saved["logits"] = logits
        return logits

    def _norm(self, mb: int, x: torch.Tensor) -> tuple[_MbState, torch.Tensor, GradTaps | None]:
        st = self._enter(mb, None, "F-partial")
        if self.recompute == "full":  # keep the input alone; the same values, no graph
            st.saved["x"] = x
            with torch.no_grad():
                return st, self.kernels.norm(x, self.norm_w, self.eps, None), None
        h, sink = _norm_graph(self, st, mb, x)
        return st, h, sink

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        """SP: as the residual units' (the norm, then the all-gather launched)."""
        if self.seq is not None:
            st, h, _ = self._norm(mb, x)
            st.saved["gather"] = self.seq.launch_gather(h.detach())

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        st = self._enter(mb, "F-partial", "F")
        loss, st.saved["lse"] = vocab_ce_finish(reduced, st.saved["targets"])
        return loss.detach()

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":  # the forward again, with its graph
            h, sink = _norm_graph(self, st, mb, st.saved.pop("x"))
            self._logits(st, h if self.one_graph else self._gathered(h.detach()), sink)
        logits = st.saved.pop("logits")
        grad_logits = self.kernels.ce_grad(  # vocab_start None: the whole vocabulary
            logits.detach(), st.saved.pop("targets"), st.saved.pop("lse"),
            None if self.tp_size == 1 else self.vocab_start, grad, self.vocab_valid,
        )
        if self.one_graph:
            st.saved["grad"] = self._input_grad(st, logits, st.saved.pop("x_in"), grad_logits)
            return None
        grad_h = self._input_grad(st, logits, st.saved.pop("h_in"), grad_logits)  # taps the head
        return self._handoff(grad_h)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        if self.one_graph:
            grad_x = st.saved.pop("grad")
        else:
            assert reduced is not None
            grad_x = input_grad(st.saved.pop("h"), st.saved.pop("x_in"), reduced)
        self._close(mb)
        return grad_x
