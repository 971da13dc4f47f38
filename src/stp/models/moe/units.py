"""The MoE layer's MLP as a unit: x -> x + moe(RMSNorm(x)), the decoder's MLP unit
with its body routed (stp.models.decoder.units: attention units are the
decoder's own).

    x --+--> RMSNorm -> router (replicated) -> softmax, top-k ----------+
        |            +-> experts e (TP-sharded SwiGLU) on their tokens --+--> sum -> partial
        |            +-> shared expert (TP-sharded) * sigmoid(gate) ----/         |
        |                                                            [ all-reduce ]
        +------------------------- residual add (forward_finish) <-------------+--> x'

Routing weights and the shared expert's gate scale TP partial sums, which is
linear, so the unit still ends in one partial sum to all-reduce. The
load-balancing loss (stp.models.moe.routing) is a second root of the unit's
graph: B walks (output, aux) with seeds (output gradient, `aux_seed`), so its
gradient reaches the router through the same walk, and the router's weight
gradient waits for W like every other matrix (exact with W deferred).
`aux_seed` is set by the stage: aux_loss_coef / (MoE layers x microbatches x
TP ranks) (each TP rank seeds a share, the TP all-reduce of the input gradient
and the TP sum of the router's gradient add the shares up).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from stp.models.decoder.units import _ResidualUnit
from stp.models.moe.routing import aux_loss, expert_counts, route
from stp.models.tp.layers import linear
from stp.models.tp.sequence import ToScatter
from stp.models.tp.wgrad import ReadyGrad, WGradEntry
from stp.models.unit import _ENGINE

__all__ = ["Expert", "MoEUnit"]

Expert = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(w1, w3, w2) of one SwiGLU expert: this rank's TP shard."""


def _swiglu(x: torch.Tensor, w: Expert, sink: list[WGradEntry] | None) -> torch.Tensor:
    w1, w3, w2 = w
    return linear(F.silu(linear(x, w1, sink)) * linear(x, w3, sink), w2, sink)


class MoEUnit(_ResidualUnit):
    """The routed MLP of layer `layer` over this rank's slice of every expert."""

    def __init__(
        self,
        layer: int,
        norm_weight: torch.Tensor,
        router: torch.Tensor,
        experts: list[Expert],
        *,
        top_k: int,
        norm_topk_prob: bool,
        eps: float,
        shared: Expert | None = None,
        shared_gate: torch.Tensor | None = None,
        one_graph: bool = False,
    ) -> None:
        super().__init__(f"layers.{layer}.moe", norm_weight, eps, one_graph)
        self.router, self.experts = router, experts
        self.shared, self.shared_gate = shared, shared_gate
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.aux_seed = 0.0
        self.aux: dict[int, torch.Tensor] = {}
        """Each microbatch's load-balancing loss (detached), until the stage takes it."""
        self.counts: dict[int, torch.Tensor] = {}
        """Each microbatch's routing choices per expert, until the stage takes them."""
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def _matrices(self) -> list[torch.Tensor | None]:
        shared = [] if self.shared is None else [*self.shared, self.shared_gate]
        return [self.router, *(w for e in self.experts for w in e), *shared]

    def _body(self, h: torch.Tensor, sink: list[WGradEntry] | None) -> torch.Tensor:
        b, s, d = h.shape
        x = h.reshape(b * s, d)
        logits = linear(x, self.router, sink)  # [n, E], the same on every TP rank
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):  # dropless: every chosen pair computed
            token, slot = torch.where(ids == e)  # possibly none: W then adds zeros
            y = _swiglu(x[token], expert, sink) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        if self.shared is not None:
            gate = torch.sigmoid(linear(x, self.shared_gate, sink))  # [n, 1]
            out = out + gate * _swiglu(x, self.shared, sink)
        self._fresh = (aux_loss(logits, ids, len(self.experts)), expert_counts(ids,
                                                                              len(self.experts)))
        return out.view(b, s, d)  # partial over TP

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | ToScatter:
        out = super().forward_partial(mb, x, targets)
        assert self._fresh is not None
        aux, counts = self._fresh
        self._fresh = None
        self._states[mb].saved["aux"] = aux
        self.aux[mb], self.counts[mb] = aux.detach(), counts
        return out

    def _walk(self, mb: int, out: torch.Tensor, inp: torch.Tensor,
              grad: torch.Tensor) -> torch.Tensor:
        """d(out, aux)/d inp applied to (grad, aux_seed), in one engine walk that also
        catches the tapped matrices' output gradients (stp.models.unit.Unit._input_grad,
        with a seed of its own for the second root)."""
        st = self._states[mb]
        aux = st.saved.pop("aux")
        seed = torch.full((), self.aux_seed, dtype=aux.dtype, device=aux.device)
        native, taps = st.saved.pop("native", False), st.taps
        st.taps = None
        extra: tuple[Any, ...] = ()
        if native:
            extra = tuple(w for w in self.weights() if w.requires_grad)
        elif taps is not None:
            extra = taps.edges()
        grads = _ENGINE.run_backward((out, aux), (grad, seed), False, False, (inp, *extra),
                                     False, False)
        if native:
            st.sink.extend(ReadyGrad(w, g) for w, g in zip(extra, grads[1:], strict=True))
        elif taps is not None:
            taps.caught(grads[1:])
        return grads[0]

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        st = self._enter(mb, "F", "B-partial")
        if self.one_graph:
            out, x_in = st.saved.pop("out"), st.saved.pop("x_in")
            st.saved["grad"] = grad + self._walk(mb, out, x_in, grad)
            return None
        if self.seq is not None:
            raise RuntimeError("MoE units run without sequence parallelism")
        grad_h = self._walk(mb, st.saved.pop("out"), st.saved.pop("h_in"), grad)
        st.saved["grad"] = grad
        return self._handoff(grad_h)

    def reset(self) -> None:
        super().reset()
        self.aux.clear()
        self.counts.clear()
