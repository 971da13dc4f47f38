"""An expert-parallel MoE layer's MLP as three units, cut at its two all-to-alls
(stp.models.moe.dispatch), so that the braid rule hides them as it hides the TP
all-reduce (STP paper arXiv 2510.27257, Fig. 3; the same idea as DeepSeek's
DualPipe overlap of the expert all-to-all, arXiv 2412.19437, section 3.2.1):

    unit      forward                                     backward
    route     norm, router, top-k, counts launched;      roots (sent rows, routing
              rows sorted, shared expert; counts         weights, shared output, aux)
              waited -> [A2A dispatch]                   -> dh partial -> [AR TP]
    experts   this rank's experts on the received rows   experts' input gradient
                                -> [A2A combine]          -> [A2A back to the tokens]
    combine   weight and sum rows per token (+ shared)   the gradient of the rows and
                                -> [AR TP] -> x + out     of the weights -> [A2A]

    braided:  route F(i) | combine B(j) | experts F(i) | experts B(j) | ...
              [A2A F(i)......] [A2A B(j).....] [A2A F(i).....]

Each unit keeps a graph of its own over detached inputs. What crosses units
besides the exchanged rows (the routing plan, the sorted routing weights, the
shared expert's output, the layer input for the residual, and in B the
output gradient and the weights' gradient) lives in a `_Layer` the three
share, per microbatch. The route unit's backward walks one graph from four
roots: the sent rows, the weights, the shared output and the load-balancing
loss (seeded with `aux_seed`, as stp.models.moe.units.MoEUnit), so the router
gets every gradient in one walk and its W stays deferred.

The matrices are the deferring autograd Functions of stp.models.tp.layers at any
TP size (no one-graph fast path: the layer has collectives inside it even at
one TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stp.models.decoder.units import _ResidualUnit
from stp.models.moe.dispatch import ExpertGroup, Routed, ToExchange, sort_rows, start_counts
from stp.models.moe.routing import aux_loss, expert_counts, route
from stp.models.moe.units import Expert
from stp.models.tp.layers import linear
from stp.models.tp.wgrad import WGradEntry
from stp.models.unit import _ENGINE, Unit, input_grad

__all__ = ["CombineUnit", "ExpertsUnit", "RouteUnit", "expert_parallel_units"]


def _swiglu(x: torch.Tensor, w: Expert, sink: list[WGradEntry]) -> torch.Tensor:
    w1, w3, w2 = w
    return linear(F.silu(linear(x, w1, sink)) * linear(x, w3, sink), w2, sink)


@dataclass
class _Mb:
    """What one microbatch's three units hand each other beside the exchanged rows."""

    plan: Routed
    weights: torch.Tensor
    """[n k] the sent rows' routing weights (detached; the route unit keeps the graph)."""
    shared: torch.Tensor | None
    """[n, h] the shared expert's gated output (detached), a TP partial (None once the
    combine unit added it)."""
    x: torch.Tensor | None
    """The layer's input, for the residual (None once the combine unit added it)."""
    shape: torch.Size
    grad_out: torch.Tensor | None = None
    """B: the layer output's gradient (the combine unit's input)."""
    grad_weights: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held here: the microbatch's own, kept from its forward to its
        backward like a unit's saved tensors (RouteUnit.kept_tensors)."""
        plan = self.plan
        held = (plan.order, plan.token, plan.expert, self.weights, self.shared, self.x,
                self.grad_out, self.grad_weights)
        return [t for t in held if isinstance(t, torch.Tensor)]


@dataclass
class _Layer:
    mbs: dict[int, _Mb] = field(default_factory=dict)


class RouteUnit(_ResidualUnit):
    """Norm, router, routing plan and shared expert; hands the runner the rows to
    dispatch. Its B walks back to the norm's output: a TP partial, all-reduced."""

    def __init__(self, layer: int, shared_state: _Layer, norm_weight: torch.Tensor,
                 router: torch.Tensor, *, top_k: int, norm_topk_prob: bool, eps: float,
                 num_experts: int, group: ExpertGroup, shared: Expert | None,
                 shared_gate: torch.Tensor | None) -> None:
        super().__init__(f"layers.{layer}.moe.route", norm_weight, eps, one_graph=False)
        self.layer, self.router = shared_state, router
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.num_experts, self.group = num_experts, group
        self.shared, self.shared_gate = shared, shared_gate
        self.aux_seed = 0.0
        self.aux: dict[int, torch.Tensor] = {}
        """Each microbatch's load-balancing loss (detached), until the stage takes it."""
        self.counts: dict[int, torch.Tensor] = {}
        """Each microbatch's routing choices per expert, until the stage takes them."""

    def _matrices(self) -> list[torch.Tensor | None]:
        shared = [] if self.shared is None else [*self.shared, self.shared_gate]
        return [self.router, *shared]

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> ToExchange:
        st, h, _ = self._norm(mb, x)
        b, s, d = h.shape
        h_in = h.detach().requires_grad_(True)
        with torch.enable_grad():
            flat = h_in.reshape(b * s, d)
            logits = linear(flat, self.router, st.sink)  # [n, E], the same on every TP rank
            weights, ids = route(logits, self.top_k, self.norm_topk_prob)
            counts = start_counts(ids, self.num_experts, self.group)  # hidden by what follows
            order, token = sort_rows(ids)
            rows, sorted_w = flat[token], weights.reshape(-1)[order]
            aux = aux_loss(logits, ids, self.num_experts)
            shared = None
            if self.shared is not None:
                gate = torch.sigmoid(linear(flat, self.shared_gate, st.sink))  # [n, 1]
                shared = gate * _swiglu(flat, self.shared, st.sink)
        plan = counts.plan(order, token)
        st.saved.update(h_in=h_in, rows=rows, weights=sorted_w, aux=aux, shared=shared)
        self.aux[mb], self.counts[mb] = aux.detach(), expert_counts(ids, self.num_experts)
        self.layer.mbs[mb] = _Mb(plan, sorted_w.detach(), None if shared is None else
                                 shared.detach(), st.saved.pop("x"), h.shape)
        return plan.dispatch(rows.detach())

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        self._enter(mb, "F-partial", "F")
        return reduced  # the rows this rank's experts compute

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor:
        """grad: the sent rows' gradient (back from the experts' ranks)."""
        st = self._enter(mb, "F", "B-partial")
        m = self.layer.mbs[mb]
        saved = st.saved
        roots = [saved.pop("rows"), saved.pop("weights"), saved.pop("aux")]
        aux = roots[2]
        grads = [grad, m.grad_weights, torch.full((), self.aux_seed, dtype=aux.dtype,
                                                  device=aux.device)]
        shared = saved.pop("shared")
        if shared is not None:
            roots.append(shared)
            grads.append(m.grad_out.reshape(shared.shape))
        h_in = saved.pop("h_in")
        (grad_h,) = _ENGINE.run_backward(tuple(roots), tuple(grads), False, False, (h_in,),
                                         False, False)
        saved["grad"] = m.grad_out  # the residual's gradient
        return self._handoff(grad_h)  # a partial over TP

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        out = super().backward_finish(mb, reduced)
        del self.layer.mbs[mb]
        return out

    def kept_tensors(self, mb: int) -> list[torch.Tensor]:
        """The unit's own, and what the layer's three units share for mb (`_Mb`), from
        the forward to the backward: activation offload moves them and the memory
        count sees them (stp.runtime.offload)."""
        m = self.layer.mbs.get(mb)
        return super().kept_tensors(mb) + ([] if m is None else m.tensors())

    def reset(self) -> None:
        super().reset()
        self.aux.clear()
        self.counts.clear()
        self.layer.mbs.clear()


class ExpertsUnit(Unit):
    """This rank's experts (each a TP shard) on the rows the dispatch brought; hands
    the runner their outputs to combine. B: the rows' gradient, sent back."""

    def __init__(self, layer: int, shared_state: _Layer, experts: list[Expert]) -> None:
        super().__init__(f"layers.{layer}.moe.experts")
        self.layer, self.experts = shared_state, experts

    def weights(self) -> list[torch.Tensor]:
        return [w for e in self.experts for w in e]

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> ToExchange:
        st = self._enter(mb, None, "F-partial")
        plan = self.layer.mbs[mb].plan
        rows = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = rows.new_zeros(rows.shape)
            for j, expert in enumerate(self.experts):
                (row,) = torch.where(plan.expert == j)  # possibly none: W then adds zeros
                y = y.index_add(0, row, _swiglu(rows[row], expert, st.sink))
        st.saved.update(rows=rows, y=y)
        return plan.combine(y.detach())  # partial over TP

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        self._enter(mb, "F-partial", "F")
        return reduced

    def backward_partial(self, mb: int, grad: torch.Tensor) -> ToExchange:
        st = self._enter(mb, "F", "B-partial")
        g = input_grad(st.saved.pop("y"), st.saved.pop("rows"), grad)  # a TP partial
        return self.layer.mbs[mb].plan.combine(g)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        self._enter(mb, "B-partial", "B")
        self._close(mb)
        return reduced


class CombineUnit(Unit):
    """The experts' rows weighted and summed into their tokens, plus the shared
    expert's output: a TP partial, all-reduced, then the residual. Holds no weights."""

    def __init__(self, layer: int, shared_state: _Layer) -> None:
        super().__init__(f"layers.{layer}.moe.combine")
        self.layer = shared_state

    def forward_partial(self, mb: int, x: torch.Tensor,
                        targets: torch.Tensor | None = None) -> torch.Tensor:
        st = self._enter(mb, None, "F-partial")
        m = self.layer.mbs[mb]
        back = x.detach().requires_grad_(True)
        weights = m.weights.requires_grad_(True)
        with torch.enable_grad():
            out = back.new_zeros((m.shape[0] * m.shape[1], back.shape[1]))  # [b s, h]
            out = out.index_add(0, m.plan.token, back * weights[:, None])
        st.saved.update(back=back, weights=weights, out=out)
        partial = out.detach() if m.shared is None else out.detach() + m.shared
        m.shared = None  # forward only: not kept until the backward
        return self._handoff(partial.view(m.shape))

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        self._enter(mb, "F-partial", "F")
        m = self.layer.mbs[mb]
        x, m.x = m.x, None  # forward only (the residual): not kept until the backward
        assert x is not None, f"{self.name}: microbatch {mb}'s forward finished twice"
        return x + reduced

    def backward_partial(self, mb: int, grad: torch.Tensor) -> ToExchange:
        st = self._enter(mb, "F", "B-partial")
        m = self.layer.mbs[mb]
        out, back, weights = st.saved.pop("out"), st.saved.pop("back"), st.saved.pop("weights")
        g_back, g_w = _ENGINE.run_backward((out,), (grad.reshape(out.shape),), False, False,
                                           (back, weights), False, False)
        m.grad_out, m.grad_weights = grad, g_w
        return m.plan.dispatch(g_back)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        self._enter(mb, "B-partial", "B")
        self._close(mb)
        return reduced


def expert_parallel_units(layer: int, norm_weight: torch.Tensor, router: torch.Tensor,
                          experts: list[Expert], *, group: ExpertGroup, num_experts: int,
                          top_k: int, norm_topk_prob: bool, eps: float,
                          shared: Expert | None = None,
                          shared_gate: torch.Tensor | None = None) -> list[Unit]:
    """The three units of one expert-parallel MoE layer's MLP (module doc)."""
    state = _Layer()
    return [
        RouteUnit(layer, state, norm_weight, router, top_k=top_k,
                  norm_topk_prob=norm_topk_prob, eps=eps, num_experts=num_experts,
                  group=group, shared=shared, shared_gate=shared_gate),
        ExpertsUnit(layer, state, experts),
        CombineUnit(layer, state),
    ]
