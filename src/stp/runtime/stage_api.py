"""The contract between the executor and a model chunk (one pipeline stage).

The executor (stp.runtime.executor) interprets a schedule's lowered action
lists and calls these methods; the model side (stp.models) implements them
with tensor-parallel layers whose collectives run on the TP group. Keeping the
contract this small is what lets one interpreter run every schedule
(one interpreter, as DualPipe runs every schedule with a handful of chunk
primitives).

Microbatch bookkeeping lives in the stage: `forward(mb, ...)` stores what the
backward of `mb` needs; `backward_input(mb, ...)` consumes it and stores what
`backward_weight(mb)` needs (the split backward of "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, section 2: B computes input gradients only,
W the weight gradients, later).

A stage may also be cut into units (`UnitStage`: attention, MLP, embedding,
loss), each F or B unit ending in a TP all-reduce that the runtime launches
and waits for, so braided blocks can interleave two passes unit by unit
(stp.runtime.braid). `as_unit_stage` presents a stage that is not cut as a
stage of one unit with nothing to reduce, so the executor has one path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["PipelineStage", "Unit", "UnitStage", "as_unit_stage"]


@runtime_checkable
class PipelineStage(Protocol):
    stage: int
    """Global stage index this object runs."""
    is_first: bool
    """Holds the embedding: `forward` takes token ids."""
    is_last: bool
    """Holds the head and loss: `forward` takes targets and returns the loss."""

    def forward(
        self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F. First stage: x = token ids [b, s]; otherwise hidden states [b, s, h].
        Last stage: returns this microbatch's mean loss (a 0-dim tensor, detached);
        otherwise the output hidden states (detached, ready to send)."""
        ...

    def backward_input(
        self, mb: int, grad: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor | None:
        """B: input gradient only. `grad` is the output gradient (None on the last
        stage, whose loss gradient is `scale`). Returns the input gradient (None on
        the first stage). Weight gradients are deferred until backward_weight."""
        ...

    def backward_weight(self, mb: int) -> None:
        """W: accumulate this microbatch's weight gradients into `.grad`."""
        ...

    def backward_full(
        self, mb: int, grad: torch.Tensor | None, scale: float = 1.0
    ) -> torch.Tensor | None:
        """BW: B immediately followed by W."""
        ...


@runtime_checkable
class Unit(Protocol):
    """One unit of a stage (an attention or MLP block, the embedding, the loss).

    Each F and B step is split at its TP all-reduce: `*_partial` returns the
    partial sum to reduce over the TP group (None: nothing to reduce), and
    `*_finish` takes the reduced tensor and returns the unit's output. W needs
    no all-reduce.
    """

    def forward_partial(
        self, mb: int, x: Any, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None: ...

    def forward_finish(self, mb: int, reduced: torch.Tensor | None) -> Any: ...

    def backward_partial(self, mb: int, grad: Any) -> torch.Tensor | None:
        """`grad`: the output gradient; on the last stage's loss unit, the loss
        gradient's scale as a 0-dim tensor."""
        ...

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None: ...

    def weight(self, mb: int) -> None: ...


@runtime_checkable
class UnitStage(Protocol):
    """A pipeline stage cut into units (stp.models.ModelStage, stp.models.emulated)."""

    stage: int
    is_first: bool
    is_last: bool
    units: Sequence[Unit]

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start the TP sum of `partial`: (the tensor that will hold the sum, the
        work to wait on, None when there is nothing to wait for)."""
        ...

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None: ...


class _WholePass:
    """A stage's whole pass as one unit with nothing to reduce."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self._out: dict[int, Any] = {}

    def forward_partial(self, mb: int, x: Any, targets: torch.Tensor | None = None) -> None:
        self._out[mb] = self.stage.forward(mb, x, targets)

    def forward_finish(self, mb: int, reduced: torch.Tensor | None) -> Any:
        return self._out.pop(mb)

    def backward_partial(self, mb: int, grad: Any) -> None:
        st = self.stage
        if st.is_last:  # the runner seeds the loss unit with the scale
            self._out[mb] = st.backward_input(mb, None, float(grad))
        else:
            self._out[mb] = st.backward_input(mb, grad)

    def backward_finish(self, mb: int, reduced: torch.Tensor | None) -> torch.Tensor | None:
        return self._out.pop(mb)

    def weight(self, mb: int) -> None:
        self.stage.backward_weight(mb)


class _OneUnitStage:
    """`stage` seen as a UnitStage of one unit (see `as_unit_stage`)."""

    def __init__(self, stage: PipelineStage) -> None:
        self.inner = stage
        self.stage, self.is_first, self.is_last = stage.stage, stage.is_first, stage.is_last
        self.units = (_WholePass(stage),)

    def launch_allreduce(self, partial: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise AssertionError("a whole-pass unit has nothing to reduce")

    def check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        check = getattr(self.inner, "check_input", None)
        if check is not None:
            check(x, targets)


def as_unit_stage(stage: PipelineStage) -> UnitStage:
    """`stage` itself when it is cut into units, else a one-unit view of it: a
    full backward then runs as B followed by W, which is what `backward_full`
    means, so the executor needs no pass-level path."""
    if isinstance(stage, UnitStage):
        return stage
    return _OneUnitStage(stage)
