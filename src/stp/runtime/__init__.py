"""The runtime: runs stp schedules on torch.distributed (TP x PP x DP).

- `mesh`: ParallelDims (validated sizes) and Mesh (this rank's process groups).
- `launch`: torchrun environment or local workers via PyTorch's launcher API.
- `p2p`: batched point-to-point transfers with timeouts.
- `executor`: the one interpreter of lowered per-rank programs.
- `braid`: compute actions run unit by unit, braided blocks interleaved.
- `offload`, `offload_copy`: activation offload to the host and back.
- `trace`: measured traces in the simulator's shape.
- `errors`: RankError / CommTimeout / PeerLost, messages naming rank, action and
  peer; `errors.wrap` turns a backend error into the one it is.
- `stage_api`: the contracts the model side implements (PipelineStage,
  UnitStage, Unit).

The runtime knows neither the models nor the trainer: `stp.models` implements
`stage_api`, and `stp.train.step.trainer.Trainer` ties the two together.
"""

from stp.runtime.errors import CommTimeout, RankError
from stp.runtime.executor import Executor, ExecutorOptions
from stp.runtime.mesh import Coord, Mesh, ParallelDims
from stp.runtime.p2p import P2P
from stp.runtime.stage_api import PipelineStage, Unit, UnitStage

__all__ = [
    "CommTimeout",
    "Coord",
    "Executor",
    "ExecutorOptions",
    "Mesh",
    "P2P",
    "ParallelDims",
    "PipelineStage",
    "RankError",
    "Unit",
    "UnitStage",
]
