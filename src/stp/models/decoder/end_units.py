"""The two ends of a decoder stage as units: the vocab-parallel embedding (the
first stage) and the final norm, head and vocab-parallel cross-entropy (the
last). They follow the unit protocol of stp.models.decoder.units: a partial,
the TP all-reduce, a finish."""

from __future__ import annotations

import torch

from stp.models.compile_loss import applies
from stp.models.decoder.kernels import EAGER, Kernels
from stp.models.decoder.units import _norm_graph
from stp.models.tp.layers import linear, vocab_ce_finish, vocab_embedding_partial
from stp.models.tp.wgrad import EmbedGrad, GradTaps
from stp.models.unit import Unit, _MbState, input_grad

__all__ = ["EmbedUnit", "LossUnit"]


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
        if applies(self):  # compiled: one graph, no autograd (stp.models.compile_loss)
            st = self._enter(mb, None, "F-partial")
            return self.kernels.loss_graphs.forward_partial(self, st, mb, x, targets)
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
        if "xhat" in st.saved:  # the compiled graphs' forward
            return self.kernels.loss_graphs.forward_finish(st, reduced)
        loss, st.saved["lse"] = vocab_ce_finish(reduced, st.saved["targets"])
        return loss.detach()

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        if "xhat" in st.saved:
            return self.kernels.loss_graphs.backward_partial(self, st, grad)
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
        if "xhat" in st.saved:  # the compiled graphs, more TP ranks
            assert reduced is not None
            grad_x = self.kernels.loss_graphs.backward_finish(self, st, reduced)
        elif self.one_graph:
            grad_x = st.saved.pop("grad")
        else:
            assert reduced is not None
            grad_x = input_grad(st.saved.pop("h"), st.saved.pop("x_in"), reduced)
        self._close(mb)
        return grad_x
