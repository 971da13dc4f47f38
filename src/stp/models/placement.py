"""Where one pipeline stage sits in the mesh and how it runs: the record every
family's stage builder takes (`build_stage`, `build_moe_stage`, `build_mllm_stage`),
so that the builders add only what their family needs (a checkpoint reader, an
expert-parallel group) and the placement is checked once, here.

The trainer calls a stage builder with the mesh's words (stp.models.family.
StageBuilder: stage, num_stages, tp_group, tp_size, tp_rank, device, dtype);
`placed_builder` turns a family's builder into one, completing the placement with
what the family fixed for the whole run (partition, sequence parallelism,
recomputation, TP overlap chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stp.models.family import StageBuilder
from stp.models.recompute import check_recompute
from stp.schedule.placement import partition_layers

__all__ = ["StagePlacement", "placed_builder"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StagePlacement:
    """Stage `stage` of `num_stages` on TP rank `tp_rank` of `tp_size`, made on
    `device` in `dtype`. Every field is checked on construction (ValueError naming
    the bad value); `device` is normalised to a torch.device, `partition` to a tuple."""

    stage: int
    num_stages: int
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    """The TP ranks' process group (None: the default group where one is needed)."""
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    partition: tuple[int, ...] | None = None
    """Layers of each global stage (uneven stages); None: the even split
    (stp.schedule.placement.partition_layers)."""
    sequence_parallel: bool = False
    """Shard the stream between TP regions along the sequence (the identity at tp_size 1)."""
    recompute: str = "none"
    """Activation recomputation: none / selective / full (stp.models.recompute)."""
    tp_overlap_chunks: int = 0
    """In-layer TP overlap (stp.models.decoder.chunked): the pieces each sequence-parallel
    unit's all-gather and reduce-scatter are cut into, each under the next piece's
    matmuls; 0: off (1 runs the chunked path in one piece)."""

    def __post_init__(self) -> None:
        if not _is_int(self.num_stages) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        if not _is_int(self.stage) or not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, num_stages={self.num_stages}), "
                             f"got {self.stage!r}")
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if not _is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be an int in [0, tp_size={self.tp_size}), "
                             f"got {self.tp_rank!r}")
        object.__setattr__(self, "device", _device(self.device))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.partition is not None:
            if not isinstance(self.partition, (tuple, list)):
                raise ValueError(f"partition must be a tuple of layer counts, got "
                                 f"{self.partition!r}")
            object.__setattr__(self, "partition", tuple(self.partition))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        check_recompute(self.recompute)
        if not _is_int(self.tp_overlap_chunks) or self.tp_overlap_chunks < 0:
            raise ValueError(f"tp_overlap_chunks must be an int >= 0 (0: no overlap), got "
                             f"{self.tp_overlap_chunks!r}")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def shards_sequence(self) -> bool:
        """Sequence parallelism in effect: asked for, on more than one TP rank."""
        return self.sequence_parallel and self.tp_size > 1

    def layers(self, num_layers: int) -> range:
        """The global layers of this stage, of a model of `num_layers` (ValueError for
        a partition that does not cut them into num_stages stages)."""
        return partition_layers(num_layers, self.num_stages, self.partition)[self.stage]

    def check_distributed(self) -> None:
        """ValueError unless torch.distributed is up where TP needs it (tp_size > 1)."""
        if self.tp_size > 1 and not dist.is_initialized():
            raise ValueError(f"tp_size={self.tp_size} needs torch.distributed initialised")


def _device(device: Any) -> torch.device:
    if isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or its name (cpu, cuda, cuda:1, "
                         f"...), got {device!r}") from None


def placed_builder(build: Callable[..., Any], config: Any, *,
                   partition: tuple[int, ...] | None = None,
                   sequence_parallel: bool = False, recompute: str = "none",
                   tp_overlap_chunks: int = 0, **family_args: Any) -> StageBuilder:
    """A StageBuilder (stp.models.family) over `build(config, placement, **family_args)`:
    the trainer's words for the stage and the mesh, with the placement fields the
    family fixed for the run. Keywords the builder is called with beyond the mesh's
    (an expert-parallel group: ModelFamily.builder_on_mesh) go to `build`."""
    fixed: dict[str, Any] = {"partition": partition, "sequence_parallel": sequence_parallel,
                             "recompute": recompute, "tp_overlap_chunks": tp_overlap_chunks}

    def builder(stage: int, num_stages: int, *, tp_group: dist.ProcessGroup | None = None,
                tp_size: int = 1, tp_rank: int = 0, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, **more: Any) -> Any:
        placement = StagePlacement(stage, num_stages, tp_size=tp_size, tp_rank=tp_rank,
                                   tp_group=tp_group, device=device, dtype=dtype, **fixed)
        return build(config, placement, **family_args, **more)

    return builder
