"""How a Trainer is set up: its options, and the pieces it is built from.

`TrainerOptions` says how a Trainer runs; `resolve_schedule`, `stage_builder`
and `world_mesh` turn what the user passed (a schedule name or file, a model
config or builder, a mesh or nothing) into the schedule, the stage builder
and the process groups, each refusing bad input with one ValueError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stp.runtime.launch import in_torchrun, init_distributed
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import Schedule, registry, validate
from stp.train.families import family_of
from stp.train.lr import LRSchedule
from stp.train.schedules import is_schedule_file, load_schedule_file

__all__ = ["TrainerOptions", "StageBuilder", "resolve_schedule", "stage_builder", "world_mesh"]

StageBuilder = Callable[..., Any]
"""`builder(stage, num_stages, *, tp_group, tp_size, tp_rank, device, dtype)` -> a
PipelineStage that also has `named_parameters()`, `shard_dim(name)`, `zero_grad()`."""


@dataclass(frozen=True)
class TrainerOptions:
    """How a Trainer runs (what it trains: the model, optimizer and schedule)."""

    dtype: torch.dtype = torch.float32
    """Parameter and activation dtype."""
    device: torch.device | str | None = None
    """None: the mesh's device (CUDA when the backend is NCCL, else the CPU)."""
    timeout: float = 300.0
    """Seconds every receive and collective may wait before the rank gives up."""
    hidden: int | None = None
    """Width of stage boundary tensors; read from a ModelConfig, needed for a builder."""
    lookahead: int = 1
    """Receives are posted this many compute actions early (stp.schedule.lower)."""
    offload: str | None = None
    """Activation offload policy (none, stp, all, selective:X; stp.runtime.offload);
    given, even as "none", resident activation bytes are measured every step."""
    braid: bool = True
    """Run braided blocks unit by unit with the TP all-reduces hidden (False: the
    unbraided baseline)."""
    trace: bool = False
    """Record every step (`write_trace` writes the last one)."""
    clip_grad: float | None = None
    """Clip the global gradient norm to this (stp.train.clip); None: measured, not clipped."""
    lr_schedule: LRSchedule | None = None
    """Warm-up and decay of the optimizer's lr (stp.train.lr); None: constant."""
    partition: tuple[int, ...] | None = None
    """Transformer layers of each global stage (uneven stages, e.g. fewer on the
    stages holding the embedding and the output layer); None: the even split."""
    sequence_parallel: bool = False
    """Megatron-style sequence parallelism (stp.models.tp.sequence): between TP regions
    each TP rank holds s/t rows of the sequence; ignored at tp=1 (the identity)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(f"clip_grad must be > 0 (or None: no clipping), got {self.clip_grad}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")


def resolve_schedule(schedule: str | Schedule, dims: ParallelDims,
                     microbatches: int | None) -> Schedule:
    """A registry name, a schedule file or a Schedule, validated against pp."""
    if isinstance(schedule, str):
        if is_schedule_file(schedule):  # validated, fitted to pp (and microbatches)
            return load_schedule_file(schedule, dims.pp, microbatches)
        return registry.make(schedule, dims.pp, microbatches)
    if schedule.num_ranks != dims.pp:
        raise ValueError(
            f"schedule {schedule.name} has {schedule.num_ranks} ranks, not pp={dims.pp}"
        )
    validate(schedule)
    return schedule

def stage_builder(model: Any, opts: TrainerOptions, num_stages: int, tp: int,
                  source: Any = None) -> tuple[StageBuilder, int]:
    """(stage builder, boundary width) for a model family's config (its weights read
    from `source`, an HFCheckpoint, when given) or a builder."""
    family = family_of(model)
    if family is not None:
        family.model.check(model, tp, num_stages)
        weights = None if source is None else source.read
        sp = {"sequence_parallel": True} if opts.sequence_parallel and tp > 1 else {}
        builder = family.model.stage_builder(model, num_stages, partition=opts.partition,
                                             weights=weights, **sp)
        return builder, family.model.hidden(model)
    if opts.sequence_parallel:
        raise ValueError("sequence_parallel= needs a model config; a stage builder decides "
                         "its own collectives")
    if opts.partition is not None:
        raise ValueError("partition= splits a ModelConfig's layers; a stage builder "
                         "decides its own stages' layers")
    if isinstance(model, nn.Module) or not callable(model):
        raise ValueError(
            f"Trainer takes a stp.models.ModelConfig, a stage builder function, or None "
            f"with init_from=DIR (a Hugging Face checkpoint), not a {type(model).__name__}"
        )
    if opts.hidden is None:
        raise ValueError("a stage builder needs hidden= (width of boundary tensors)")
    return model, opts.hidden


def world_mesh(dims: ParallelDims, opts: TrainerOptions) -> Mesh:
    """The mesh over the whole world, initialising torch.distributed if needed
    (from torchrun's environment, or a world of one)."""
    device = None if opts.device is None else torch.device(opts.device)
    if not dist.is_initialized():
        if dims.world_size != 1 and not in_torchrun():
            raise ValueError(
                f"a {dims.world_size}-rank mesh needs torch.distributed initialised "
                "(start under torchrun, or use `stp train`)"
            )
        init_distributed(timeout=opts.timeout, device=device)
    return Mesh.from_world(dims, device=device, timeout=opts.timeout)
