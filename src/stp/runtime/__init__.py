"""The runtime: runs stp schedules on torch.distributed (TP x PP x DP).

- `mesh`: ParallelDims (validated sizes) and Mesh (this rank's process groups).
- `launch`: torchrun environment or local workers via PyTorch's launcher API.
- `p2p`: batched point-to-point transfers with timeouts.
- `executor`: the one interpreter of lowered per-rank programs.
- `data`: the byte-level corpus and deterministic batches.
- `job`: the settings and loop of one `stp train` run.
- `errors`: RankError / CommTimeout, messages naming rank, action and peer.
- `stage_api`: the PipelineStage contract the model side implements.

The Trainer that ties them together is `stp.trainer.Trainer`. Names below
are loaded on first use, so `stp.runtime.job` (read by `stp train --help`)
does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = [
    "CommTimeout",
    "Coord",
    "Executor",
    "Mesh",
    "P2P",
    "ParallelDims",
    "PipelineStage",
    "RankError",
]

_WHERE = {
    "CommTimeout": "errors",
    "RankError": "errors",
    "Coord": "mesh",
    "Mesh": "mesh",
    "ParallelDims": "mesh",
    "Executor": "executor",
    "P2P": "p2p",
    "PipelineStage": "stage_api",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"stp.runtime.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'stp.runtime' has no attribute {name!r}")
