"""How an Executor runs its program: the runtime's slice of a run's settings.

What it runs (the lowered program, the stages, the transfers) the Executor
takes on its own; this record holds only what a rank needs to run it, and
names no model: the Trainer builds it once from its options and the mesh
(stp.train.run.setup), an Evaluator reuses it for its forward-only program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExecutorOptions"]


@dataclass(frozen=True)
class ExecutorOptions:
    """How an Executor runs its program (what it runs: the program and stages)."""

    boundary_shape: tuple[int, ...] = (1, 1, 1)
    """Shape of the tensors crossing stage boundaries (hidden states [b, s, h] and
    their gradients), for receive buffers; `run` may replace it."""
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    where: str = ""
    """This rank as error messages name it (stp.runtime.mesh.Mesh.describe)."""
    collective_peers: str = ""
    """The group a stage's own collectives wait on, for timeout messages."""
    braid: bool = True
    """Run braided blocks braided (False: the unbraided baseline)."""

    def __post_init__(self) -> None:
        shape = tuple(self.boundary_shape)  # a list given is kept as the tuple it means
        if not shape or not all(isinstance(n, int) and n > 0 for n in shape):
            raise ValueError("boundary_shape must be positive integers, got "
                             f"{self.boundary_shape!r}")
        object.__setattr__(self, "boundary_shape", shape)
        if not isinstance(self.braid, bool):
            raise ValueError(f"braid must be True or False, got {self.braid!r}")
