"""What every unit shares: the per-microbatch bookkeeping of the unit protocol
(stp.runtime.stage_api.Unit; the order of calls is in stp.models.decoder.units's doc),
the deferred weight-gradient store, and the one engine call that walks a unit's
graph in B (input gradient, plus the tapped linears' output gradients or the
plain-autograd weight gradients of the same walk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from stp.models.tp.overlap import ChunkedGather
from stp.models.tp.sequence import PendingGather, SequenceParallel, ToScatter
from stp.models.tp.wgrad import GradTaps, ReadyGrad, WGradEntry, WGradStore

__all__ = ["Unit", "input_grad"]

_ENGINE = torch.autograd.Variable._execution_engine


def input_grads(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
                grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """`input_grad` for several outputs (each with its gradient) and several inputs."""
    return _ENGINE.run_backward(outputs, grads, False, False, inputs, False, False)


def input_grad(output: torch.Tensor, inp: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """torch.autograd.grad(output, inp, grad)[0], straight into autograd's C++ engine.
    The units call it twice per unit and microbatch; torch.autograd.grad's Python
    argument handling costs about as much again as a small unit's graph walk
    (21 against 12 us per call measured). The engine still checks that grad fits
    output's shape; inp must be reachable from output."""
    return _ENGINE.run_backward((output,), (grad,), False, False, (inp,), False, False)[0]


@dataclass
class _MbState:
    phase: str
    """'F-partial', 'F', 'B-partial': the last method run for this microbatch."""
    sink: list[WGradEntry]
    saved: dict[str, Any] = field(default_factory=dict)
    early_w: bool = False
    """W ran between backward_partial and backward_finish (a braided full backward)."""
    taps: GradTaps | None = None
    """The forward's linears whose output gradients B must catch (`Unit._sink`)."""


class Unit:
    """Per-microbatch bookkeeping shared by the units; subclasses fill the maths."""

    name: str
    weights_at_once: frozenset[int] = frozenset()
    """Microbatches whose backward is a full BW (W right after B). A one-graph unit runs
    them in plain autograd: B gets the weight gradients in the same engine call (kept
    as ReadyGrad until W adds them) instead of recording (x, dy) for a later matmul."""
    seq: SequenceParallel | None = None
    """Sequence parallelism (stp.models.tp.sequence), set by the stage: the stream
    between units holds this rank's s/t rows; None: every rank holds all s rows."""
    overlap: int = 0
    """In-layer TP overlap (stp.models.tp.overlap), set by the stage under sequence
    parallelism: the chunks K each TP region's collectives are cut into; 0: off."""
    recompute: str = "none"
    """Activation recomputation (stp.models.recompute), set by the stage: "none",
    "selective" (the attention core again in B) or "full" (the unit's forward again
    in B, from its kept input)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._states: dict[int, _MbState] = {}
        self._wgrad = WGradStore()

    def _enter(self, mb: int, expect: str | None, phase: str) -> _MbState:
        state = self._states.get(mb)
        have = state.phase if state is not None else None
        if have != expect:
            raise RuntimeError(
                f"unit {self.name}: {phase} of microbatch {mb} needs the previous step "
                f"{expect or 'none (a fresh microbatch)'}, but the microbatch is at "
                f"{have or 'none'}"
            )
        if state is None:
            state = _MbState(phase, self._wgrad.open(mb))
            self._states[mb] = state
        state.phase = phase
        return state

    def _gathered(self, rows: torch.Tensor) -> torch.Tensor:
        """With sequence parallelism, the all-gather of this rank's rows that starts a
        TP region (forward: the normalised input of the column-parallel matrices;
        backward: the output gradient, the dual of the reduce-scatter that ended the
        forward); the tensor itself otherwise."""
        return rows if self.seq is None else self.seq.gather(rows)

    def _handoff(self, partial: torch.Tensor) -> torch.Tensor | ToScatter:
        """A partial sum over the TP group as the unit hands it to the runner: to be
        reduce-scattered into the sequence rows with sequence parallelism, else
        all-reduced."""
        return partial if self.seq is None else ToScatter(partial)

    def prepare_forward(self, mb: int, x: torch.Tensor) -> None:
        """Optional early start of forward_partial: with sequence parallelism, the work
        before the all-gather and the gather's launch, so that the runner can run the
        partner's unit while it is in flight. Units without a gather do nothing here."""

    def prepare_backward(self, mb: int, grad: torch.Tensor) -> None:
        """The same for backward_partial: launch the all-gather of the output gradient
        (this rank's rows) with sequence parallelism."""
        st = self._states.get(mb)
        if self.seq is not None and st is not None and st.phase == "F":
            st.saved["grad_gather"] = self._launch_gather(grad)

    def _launch_gather(self, rows: torch.Tensor) -> PendingGather | ChunkedGather:
        """The all-gather of this rank's rows, in `overlap` chunks when on."""
        assert self.seq is not None
        if self.overlap:
            return ChunkedGather(self.seq, rows, self.overlap)
        return self.seq.launch_gather(rows)

    def weights(self) -> list[torch.Tensor]:
        """The parameters this unit's forward uses (for a plain-autograd backward)."""
        return []

    def _sink(self, st: _MbState, mb: int, one_graph: bool) -> GradTaps | None:
        """Where the forward's layers defer their weight work: taps on plain F.linear
        outputs (stp.models.tp.wgrad.GradTaps), which `_input_grad` turns into W
        work; None: plain autograd computes the weight gradients in B."""
        native = one_graph and mb in self.weights_at_once
        st.saved["native"] = native
        st.taps = None if native else GradTaps(st.sink)
        return st.taps

    def _input_grad(
        self, st: _MbState, output: torch.Tensor | tuple[torch.Tensor, ...], inp: torch.Tensor,
        grad: torch.Tensor
    ) -> torch.Tensor:
        """d output / d inp applied to grad (several outputs: each gets grad, and their
        contributions add), in one walk of the graph `_sink` prepared: the tapped
        linears' output gradients come out of the same walk (their W work goes to
        the sink), or, after a plain-autograd forward, the weight gradients (kept
        for W as they are)."""
        outs = output if isinstance(output, tuple) else (output,)
        native, taps = st.saved.pop("native", False), st.taps
        st.taps = None
        extra: tuple[Any, ...] = ()
        if native:
            extra = tuple(w for w in self.weights() if w.requires_grad)
        elif taps is not None:
            extra = taps.edges()
        grads = _ENGINE.run_backward(outs, (grad,) * len(outs), False, False, (inp, *extra),
                                     False, False)
        if native:
            st.sink.extend(ReadyGrad(w, g) for w, g in zip(extra, grads[1:], strict=True))
        elif taps is not None:
            taps.caught(grads[1:])
        return grads[0]

    def forward_partial(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Compute up to the partial sum to all-reduce. `targets`: loss unit only."""
        raise NotImplementedError

    def forward_finish(self, mb: int, reduced: torch.Tensor) -> torch.Tensor:
        """The epilogue after the all-reduce: the unit's output."""
        raise NotImplementedError

    def backward_partial(self, mb: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Input-gradient work up to the partial sum to all-reduce (None: nothing to
        reduce). Records what weight(mb) needs; touches no `.grad`."""
        raise NotImplementedError

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        """The epilogue after the all-reduce: the unit's input gradient."""
        raise NotImplementedError

    def weight(self, mb: int) -> None:
        """W: accumulate microbatch mb's weight gradients into `.grad`, free its tensors.

        May also run between backward_partial and backward_finish: in a braided
        full backward (STP paper arXiv 2510.27257, Fig. 3) W of a unit runs while the all-reduce of
        its B is in flight. The matrices' gradients need only what backward_partial
        recorded; the RMSNorm gain's needs the reduced gradient, so backward_finish
        accumulates it at once (`_close`)."""
        state = self._states.get(mb)
        if state is not None and state.phase == "B-partial" and not state.early_w:
            self._wgrad.flush(mb)  # clears state.sink; backward_finish refills it
            state.early_w = True
            return
        if state is not None:
            raise RuntimeError(
                f"unit {self.name}: weight of microbatch {mb} before its backward finished "
                f"(it is at {self._states[mb].phase})"
            )
        if mb not in self._wgrad.pending():
            raise RuntimeError(f"unit {self.name}: no pending weight gradient for microbatch {mb}")
        self._wgrad.flush(mb)

    def _close(self, mb: int) -> None:
        """End of mb's backward: drop its state; after an early W, accumulate what
        backward_finish added to the sink (the rest of W)."""
        state = self._states.pop(mb)
        if state.early_w:
            for entry in state.sink:
                entry.accumulate()
            state.sink.clear()

    def pending_backward(self) -> list[int]:
        """Microbatches with a forward started and no finished backward."""
        return sorted(self._states)

    def pending_weight(self) -> list[int]:
        """Microbatches whose backward finished and whose W has not run."""
        return [mb for mb in self._wgrad.pending() if mb not in self._states]

    def kept_tensors(self, mb: int) -> list[torch.Tensor]:
        """What this unit holds for microbatch mb: its forward state until B (the
        roots of autograd's saved tensors among them), then its W work until W.
        For activation offload and memory accounting (stp.runtime.offload)."""
        state = self._states.get(mb)
        saved = [] if state is None else list(state.saved.values())
        return [t for t in saved if isinstance(t, torch.Tensor)] + self._wgrad.tensors(mb)

    def reset(self) -> None:
        """Drop every microbatch's state (after a failed step)."""
        for mb in list(self._wgrad.pending()):
            self._wgrad.discard(mb)
        self._states.clear()
