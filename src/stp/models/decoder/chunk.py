"""A stage's run of layers as one unit, for one TP rank.

Units exist so that a braiding executor can hide each TP all-reduce under the
other pass's work (STP paper, arXiv 2510.27257, section 3). With one TP rank
there is no all-reduce to hide, and every unit boundary only costs: a detach,
a fresh autograd leaf, an engine call per pass and the per-microbatch
bookkeeping, about 0.1 ms per unit on a CPU (benchmarks/bench_unit_overhead.py).
So at tp=1 the stage runs its residual layers as a single unit: one autograd
graph from the chunk's input to its output, the residual adds inside it, one
engine call for B. Weight gradients still wait for W (Zero Bubble, arXiv
2401.10241) through the same deferred store, unless the microbatch's backward
is a full BW, when the same graph walk computes them (`Unit.weights_at_once`).
With full recomputation (stp.models.recompute) the chunk keeps its input only
and B runs all its layers again before walking them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stp.models.decoder.units import AttentionUnit, MLPUnit, Unit
from stp.models.tp.wgrad import GradTaps
from stp.models.unit import _MbState

__all__ = ["LayerChunk"]


class LayerChunk(Unit):
    """Consecutive attention and MLP units run as one unit (no all-reduce inside)."""

    def __init__(self, parts: Sequence[AttentionUnit | MLPUnit]) -> None:
        if not parts:
            raise ValueError("a layer chunk needs at least one unit")
        super().__init__(parts[0].name if len(parts) == 1 else
                         f"{parts[0].name}..{parts[-1].name}")
        self.parts = tuple(parts)

    def weights(self) -> list[torch.Tensor]:
        return [w for part in self.parts for w in part.weights()]

    def _at(self, mb: int) -> None:
        """Name the microbatch to the attention layers (their document tables)."""
        for part in self.parts:
            if isinstance(part, AttentionUnit):
                part.at(mb)

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._at(mb)
        st = self._enter(mb, None, "F-partial")
        if self.recompute == "full":  # keep the input alone; B runs the layers again
            st.saved["x"] = x
            with torch.no_grad():  # the graph's functions (F.linear, the norm), no graph
                h, last = self._layers(x, None)
            return h + last
        h, last = self._graph(st, mb, x)
        # The last residual add outside autograd, as a unit's finish does: the output
        # is a fresh tensor, not one the graph keeps (activation offload frees what
        # the graph keeps while the next stage may still read the output). B seeds
        # both roots with the output gradient.
        return h.detach() + last.detach()

    def _layers(self, x: torch.Tensor, sink: GradTaps | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stream before the last residual add, the last unit's branch)."""
        return self.parts[0].kernels.layers(self.parts, x, sink)  # compiled: one graph

    def _graph(self, st: _MbState, mb: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers from x with their graph, kept for B (the forward, or with full
        recomputation its rerun at the start of B)."""
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(True)
            h, last = self._layers(x_in, self._sink(st, mb, one_graph=True))
        st.saved.update(x_in=x_in, last=last, h=h)  # tensors: kept_tensors lists them
        return h, last

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        self._enter(mb, "F-partial", "F")
        return reduced

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        self._at(mb)  # full recomputation runs the layers again here
        st = self._enter(mb, "F", "B-partial")
        if self.recompute == "full":
            self._graph(st, mb, st.saved.pop("x"))
        roots = (st.saved.pop("last"), st.saved.pop("h"))
        st.saved["grad"] = self._input_grad(st, roots, st.saved.pop("x_in"), grad)
        return None  # nothing to reduce

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        st = self._enter(mb, "B-partial", "B")
        grad = st.saved.pop("grad")
        self._close(mb)
        return grad
