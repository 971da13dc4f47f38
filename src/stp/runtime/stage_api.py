"""The contract between the executor and a model chunk (one pipeline stage).

The executor (stp.runtime.executor) interprets a schedule's lowered action
lists and calls these methods; the model side (stp.models) implements them
with tensor-parallel layers whose collectives run on the TP group. Keeping the
contract this small is what lets one interpreter run every schedule
(STYLE.md: "one interpreter", DualPipe's primitives).

Microbatch bookkeeping lives in the stage: `forward(mb, ...)` stores what the
backward of `mb` needs; `backward_input(mb, ...)` consumes it and stores what
`backward_weight(mb)` needs (the Zero Bubble split, seed 002 section 2).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["PipelineStage"]


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
